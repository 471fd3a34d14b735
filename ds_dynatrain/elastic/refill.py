"""The refill policy of ``dynatrain launch --max-refills N``: after a failure, the job restarts from
its latest snapshot on the workers still alive (fewer ranks); the slot of the worker that died is
free again, so the agent that published the restart asks the job to grow back to its slots, a
request in the queue of ``dynatrain resize`` (served at a step boundary of the restarted job, its
joiners started in the free slots like any grow's), at most N times over the job's life."""

from __future__ import annotations

import json
from typing import Callable, Optional

from ..log import logger, plural
from .keys import ANSWER_KEY, REQUEST_COUNT, REQUEST_KEY
from .placement import live_nodes


class Refill:
    """One agent's refill budget and its pending request.

    Args:
        store: the job's store.  max_refills: grows back allowed (0: the job stays smaller).
        largest: the largest world size at most ``n`` workers serve (the global batch rule).
    """

    def __init__(self, store, max_refills: int, largest: Callable[[int], int]):
        self.store = store
        self.left = max_refills
        self.largest = largest
        self.request: Optional[int] = None

    def after_restart(self, size: int) -> Optional[int]:
        """The job restarts on ``size`` ranks: queue a grow to the largest world size the live
        hosts' slots serve, when that is larger and the budget allows. Returns the request index
        (None: nothing asked)."""
        target = self.largest(sum(h.slots for h in live_nodes(self.store).values()))
        if self.left <= 0 or target <= size:
            return None
        self.left -= 1
        i = int(self.store.add(REQUEST_COUNT, 1)) - 1
        self.store.set(REQUEST_KEY.format(i), json.dumps({"world_size": target, "refill": True}))
        self.request = i
        logger.info(
            f"agent: refill: asking the job to grow back from {size} to {target} ranks once it runs again "
            f"(request {i}; {plural(self.left, 'refill')} left)"
        )
        return i

    def poll(self) -> None:
        """Log the job's answer to the pending request once it came."""
        i = self.request
        if i is None or not self.store.check([ANSWER_KEY.format(i)]):
            return
        self.request = None
        answer = json.loads(self.store.get(ANSWER_KEY.format(i)))
        logger.info(f"agent: refill request {i}: {'' if answer['ok'] else 'not served: '}{answer['message']}")
