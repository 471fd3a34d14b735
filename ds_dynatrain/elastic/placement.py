"""Where a joiner starts: the live agents, their free slots, and the choice among them.

A *slot* is a place for one worker process on a host: each agent offers ``--slots`` of them
(default: its ``--nproc``, the workers it starts), one per device on an accelerator host. A joiner
starts in a free slot (a slot no worker or standby process of the job holds); a host is
oversubscribed (more workers than slots) only when its agent was started with
``--allow-oversubscribe``. A grow that needs more free slots than the hosts have is refused with
the reason (:class:`~ds_dynatrain.errors.ResizeRefusedError`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

from ..errors import ResizeRefusedError
from ..log import plural
from .keys import MEMBER_NODE_KEY, NODE_ALIVE_KEY, NODE_COUNT, NODE_DONE_KEY, NODE_KEY

HEARTBEAT_LOST_S = 30.0  # an agent whose heartbeat is older than this is lost (its host serves nothing)


@dataclass(frozen=True)
class Host:
    """What one agent offers: ``slots`` worker processes; ``oversubscribe``: more when none is free."""

    slots: int
    oversubscribe: bool = False


def live_nodes(store, now: Optional[float] = None) -> Dict[int, Host]:
    """``{node: Host}`` of the agents still running (not finished, heartbeat not lost)."""
    now = time.time() if now is None else now
    out = {}
    for i in range(int(store.add(NODE_COUNT, 0))):
        if not store.check([NODE_KEY.format(i)]) or store.check([NODE_DONE_KEY.format(i)]):
            continue
        beat = NODE_ALIVE_KEY.format(i)
        if store.check([beat]) and now - json.loads(store.get(beat))["time"] > HEARTBEAT_LOST_S:
            continue
        rec = json.loads(store.get(NODE_KEY.format(i)))
        out[i] = Host(int(rec["slots"]), bool(rec.get("oversubscribe", False)))
    return out


def _describe(hosts: Mapping[int, Host], taken: Mapping[int, int]) -> str:
    return ", ".join(f"node {i}: {taken.get(i, 0)} of {h.slots} used" for i, h in sorted(hosts.items()))


def choose_nodes(
    hosts: Mapping[int, Host], used: Mapping[int, int], joiners: Sequence[str], force: bool = False
) -> Dict[str, int]:
    """The node of each of ``joiners`` (pure): the one with the most free slots (its slots minus
    the processes ``used[node]`` already placed there, counting the joiners placed before), lowest
    node id first on a tie; when no slot is free, the least loaded of the hosts that allow
    oversubscription (``force``: of every host). Node 0 for all when ``hosts`` is empty (no agent
    registry).

    Raises:
        ResizeRefusedError: a joiner has no free slot and no host allows oversubscription (nothing
            is placed).
    """
    if not hosts:
        return {j: 0 for j in joiners}
    taken = {i: int(used.get(i, 0)) for i in hosts}
    free = sum(max(0, h.slots - taken[i]) for i, h in hosts.items())
    if len(joiners) > free and not force and not any(h.oversubscribe for h in hosts.values()):
        raise ResizeRefusedError(
            f"{plural(len(joiners), 'new worker')} need{'s' if len(joiners) == 1 else ''} a free slot each, "
            f"but the job's hosts have {free} free "
            f"({_describe(hosts, taken)}); add hosts with dynatrain join, or launch with --slots or "
            "--allow-oversubscribe"
        )
    out = {}
    for j in joiners:
        spare = [i for i in sorted(hosts) if hosts[i].slots > taken[i]]
        pool = spare or [i for i in sorted(hosts) if hosts[i].oversubscribe or force]
        node = max(pool, key=lambda i: hosts[i].slots - taken[i])
        out[j] = node
        taken[node] += 1
    return out


def used_slots(store, members: Sequence[str]) -> Dict[int, int]:
    """``{node: processes}`` of ``members`` (the processes that stay or stand by) per node."""
    used: Dict[int, int] = {}
    for m in members:
        key = MEMBER_NODE_KEY.format(m)
        if store.check([key]):
            node = int(store.get(key))
            used[node] = used.get(node, 0) + 1
    return used


def place_joiners(store, members: Sequence[str], joiners: Sequence[str], force: bool = False) -> Dict[str, int]:
    """The node of each of ``joiners`` on the job's live agents (:func:`live_nodes`), given where
    ``members`` (the processes that stay or stand by) run: :func:`choose_nodes`.

    Raises:
        ResizeRefusedError: not enough free slots (see :func:`choose_nodes`; never with ``force``).
    """
    return choose_nodes(live_nodes(store), used_slots(store, members), joiners, force)


def check_slots(store, world_size: int) -> None:
    """A requester's check before it queues a resize to ``world_size``: the live agents' slots
    hold that many workers (or one of them allows oversubscription).

    Raises:
        ResizeRefusedError: naming the slots the job has.
    """
    hosts = live_nodes(store)
    total = sum(h.slots for h in hosts.values())
    if hosts and world_size > total and not any(h.oversubscribe for h in hosts.values()):
        per = ", ".join(f"node {i}: {h.slots}" for i, h in sorted(hosts.items()))
        raise ResizeRefusedError(
            f"world size {world_size} needs {world_size} slots, but the job's hosts have {total} ({per}); "
            "add hosts with dynatrain join, or launch with --slots or --allow-oversubscribe"
        )


def alive_workers(store, own_node: int, now: Optional[float] = None) -> Dict[int, int]:
    """``{node: running workers}`` from the agents' heartbeats (a lost host's count is left out;
    ``own_node``'s is always read)."""
    now = time.time() if now is None else now
    alive = {}
    for i in range(int(store.add(NODE_COUNT, 0))):
        key = NODE_ALIVE_KEY.format(i)
        if store.check([key]):
            beat = json.loads(store.get(key))
            if i == own_node or now - beat["time"] <= HEARTBEAT_LOST_S:
                alive[i] = int(beat["alive"])
    return alive


def others_running(store, own_node: int) -> bool:
    """Whether another node's agent still runs workers (node 0 keeps the store up for them)."""
    for i in range(int(store.add(NODE_COUNT, 0))):
        if i == own_node or store.check([NODE_DONE_KEY.format(i)]):
            continue
        key = NODE_ALIVE_KEY.format(i)
        if store.check([key]) and time.time() - json.loads(store.get(key))["time"] < HEARTBEAT_LOST_S:
            return True
    return False
