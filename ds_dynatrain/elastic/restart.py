"""The restart of a job from its latest snapshot after a worker failed, as the agents publish it:
which snapshot, which ranks each node starts, and the record every agent applies
(:meth:`~ds_dynatrain.elastic.agent.Agent._poll_restarts`)."""

from __future__ import annotations

import json
from typing import Dict, List, Optional

from io_engine import BadLatestError, read_latest

from ..log import logger
from .keys import RESTART_COUNT, RESTART_KEY


def latest_tag(restore_dir: str) -> Optional[str]:
    """What the snapshot directory's ``latest`` names (None: none); a damaged ``latest`` is
    reported as such (the restarted workers' restore then tries the directory's older snapshots)."""
    try:
        return read_latest(restore_dir)
    except BadLatestError as err:
        logger.warning(f"agent: {err}; the restore will try the other snapshots of {restore_dir}")
        return "(damaged latest)"


def restart_ranks(alive: Dict[int, int], size: int) -> Dict[str, List[int]]:
    """``{node: [ranks]}`` of a restart on ``size`` ranks: the nodes in order, each up to its live
    workers (``alive[node]``)."""
    ranks, r = {}, 0
    for node in sorted(alive):
        k = min(alive[node], size - r)
        if k > 0:
            ranks[str(node)] = list(range(r, r + k))
            r += k
    return ranks


def post_restart(store, rec: dict) -> None:
    """Publish a restart record (``{"generation", "world_size", "ranks"}``, or ``{"stop": rc}``)."""
    i = int(store.add(RESTART_COUNT, 1)) - 1
    store.set(RESTART_KEY.format(i), json.dumps(rec))
