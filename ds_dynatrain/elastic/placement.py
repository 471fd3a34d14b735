"""Where a joiner starts: the live agents, their free slots, and the choice among them."""

from __future__ import annotations

import json
import time
from typing import Dict, Mapping, Optional, Sequence

from .keys import MEMBER_NODE_KEY, NODE_ALIVE_KEY, NODE_COUNT, NODE_DONE_KEY, NODE_KEY

HEARTBEAT_LOST_S = 30.0  # an agent whose heartbeat is older than this is lost (its host serves nothing)


def live_nodes(store, now: Optional[float] = None) -> Dict[int, int]:
    """``{node: slots}`` of the agents still running (not finished, heartbeat not lost)."""
    now = time.time() if now is None else now
    out = {}
    for i in range(int(store.add(NODE_COUNT, 0))):
        if not store.check([NODE_KEY.format(i)]) or store.check([NODE_DONE_KEY.format(i)]):
            continue
        beat = NODE_ALIVE_KEY.format(i)
        if store.check([beat]) and now - json.loads(store.get(beat))["time"] > HEARTBEAT_LOST_S:
            continue
        out[i] = int(json.loads(store.get(NODE_KEY.format(i)))["slots"])
    return out


def choose_nodes(slots: Mapping[int, int], used: Mapping[int, int], joiners: Sequence[str]) -> Dict[str, int]:
    """The node of each of ``joiners`` (pure): the one with the most free slots (``slots[node]``
    minus the processes ``used[node]`` already placed there, counting the joiners placed before),
    lowest node id first on a tie; a node may be oversubscribed when none is free. Node 0 when
    ``slots`` is empty."""
    taken = {i: int(used.get(i, 0)) for i in slots}
    out = {}
    for j in joiners:
        node = max(sorted(slots), key=lambda i: slots[i] - taken[i]) if slots else 0
        out[j] = node
        taken[node] = taken.get(node, 0) + 1
    return out


def place_joiners(store, members: Sequence[str], joiners: Sequence[str]) -> Dict[str, int]:
    """The node of each of ``joiners`` on the job's live agents (:func:`live_nodes`), given where
    ``members`` (the processes that stay or stand by) run: :func:`choose_nodes`."""
    used: Dict[int, int] = {}
    for m in members:
        key = MEMBER_NODE_KEY.format(m)
        if store.check([key]):
            node = int(store.get(key))
            used[node] = used.get(node, 0) + 1
    return choose_nodes(live_nodes(store), used, joiners)
