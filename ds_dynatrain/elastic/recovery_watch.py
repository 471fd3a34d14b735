"""An agent's side of an in-place recovery (``recovery.peer_replicas``): it reports its worker's
death to the survivors through the store instead of killing the job, then watches what they do.

The survivors answer with ``dynatrain/recovery/<member>/done`` (recovered) or ``.../fallback``
(``{"reason"}``); no answer within the deadline counts as a fallback. On a fallback the agent
applies the restart from the latest snapshot as it did before replicas existed
(:mod:`~ds_dynatrain.elastic.agent`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from ..log import logger
from .keys import DEAD_KEY, FALLBACK_KEY, RECOVERED_KEY

PHASES = 4  # the survivors' waits bounded by the timeout: offers, group, transfer, new group


@dataclass
class _Death:
    why: str
    rc: int
    deadline: float


class RecoveryWatch:
    """Deaths this agent reported and is waiting on.

    Args:
        store: the job's store.  node: this agent's node.  timeout_s: ``recovery.timeout_s`` (the
            survivors' limit per phase; the agent waits :data:`PHASES` times it, plus a margin).
    """

    def __init__(self, store, node: int, timeout_s: float):
        self.store = store
        self.node = node
        self.timeout_s = timeout_s
        self.waiting: Dict[str, _Death] = {}

    def report(self, member: str, why: str, rc: int) -> None:
        """Tell the survivors that ``member`` died (``why``; exit status ``rc``)."""
        self.store.set(DEAD_KEY.format(member), json.dumps({"why": why, "node": self.node}))
        self.waiting[member] = _Death(why, rc, time.monotonic() + PHASES * self.timeout_s + 10.0)
        logger.info(f"agent: worker {member} died ({why}); the survivors recover in place from the peer replicas")

    def poll(self, alive: Callable[[], int]) -> List[Tuple[str, str, int, str]]:
        """Deaths the survivors could not recover from, as ``(member, why, rc, reason)``; recovered
        ones are logged and forgotten. ``alive()``: the job's running workers (none left: nobody
        will recover, the fallback is at once)."""
        out = []
        if self.waiting and alive() == 0:
            for member, d in self.waiting.items():
                out.append((member, d.why, d.rc, "no worker of the job is left"))
            self.waiting.clear()
            return out
        for member, d in list(self.waiting.items()):
            if self.store.check([RECOVERED_KEY.format(member)]):
                rec = json.loads(self.store.get(RECOVERED_KEY.format(member)))
                logger.info(
                    f"agent: the job recovered in place from the death of {member}: step {rec['step']}, "
                    f"{rec['steps_lost']} steps lost, {rec['seconds']:.2f} s"
                )
            elif self.store.check([FALLBACK_KEY.format(member)]):
                reason = json.loads(self.store.get(FALLBACK_KEY.format(member)))["reason"]
                out.append((member, d.why, d.rc, reason))
            elif time.monotonic() > d.deadline:
                waited = PHASES * self.timeout_s + 10.0
                out.append((member, d.why, d.rc, f"the survivors did not recover within {waited:.0f} s"))
            else:
                continue
            del self.waiting[member]
        return out
