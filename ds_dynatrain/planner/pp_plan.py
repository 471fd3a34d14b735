"""The routing plan of a change of PP and DP degree (pure): what every process keeps, sends and
receives when a pipeline + ZeRO-1 layout becomes another one.

The method of a TP change (:mod:`~ds_dynatrain.planner.tp_plan`) with stages as bands: the old
and new boxes of every parameter are intersected (a parameter moves whole with its layer, then is
partitioned inside its new stage's DP group), the processes are assigned to new ranks so that the
most elements stay in place, and each intersection whose two ends are one process is a keep. A
tied parameter is held by every stage owning its key: each new rank takes it from the copy its own
process held where it held one (it stays in place), else from the lowest old stage holding it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..vps.pipeline import PipelineLayout
from .box_plan import BoxPlan
from .boxes import box_transfers


def source_stages(old: PipelineLayout, new: PipelineLayout, old_members, new_members) -> np.ndarray:
    """``(parameters, new world size)`` int64: the old stage whose copy of each parameter new rank
    ``j`` takes: its own process's old stage where that stage holds the parameter, else the lowest
    old stage that does (for an untied parameter, the one stage holding it)."""
    held = old.holders()
    lowest = np.argmax(held, axis=1).astype(np.int64)
    old_rank = {m: i for i, m in enumerate(old_members)}
    out = np.repeat(lowest[:, None], len(new_members), axis=1)
    for j, m in enumerate(new_members):
        i = old_rank.get(m)
        if i is not None:
            s = old.stage_of_rank(i)
            out[held[:, s], j] = s
    return out


def plan_pp_transition(
    old: PipelineLayout,
    new: PipelineLayout,
    old_members: Sequence[str],
    new_members: Sequence[str],
    same_settings: bool = True,
) -> BoxPlan:
    """The plan that moves ``old`` to ``new`` with the given processes at each rank.
    ``same_settings=False``: the two may differ in ZeRO settings and working dtype (a checkpoint
    loaded into another configuration); the parameters must still be the same.

    Raises:
        LayoutMismatchError: the layouts describe different models (or ZeRO settings).
        ValueError: as :class:`~ds_dynatrain.planner.box_plan.BoxPlan`.
    """
    old.check_same_model(new, settings=same_settings)
    source = source_stages(old, new, old_members, new_members)
    return BoxPlan(old, new, tuple(old_members), tuple(new_members), box_transfers(old, new, source))
