"""The routing plan of a change of TP and DP degree (pure): what every process keeps, sends and
receives when an AutoTP + ZeRO layout becomes another one.

The same method as a DP-only resize (:mod:`~ds_dynatrain.planner.plan`): the old and new
regions of every parameter are intersected (here as boxes, :mod:`~ds_dynatrain.planner.boxes`),
the processes are assigned to new ranks so that the most elements stay in place
(:func:`~ds_dynatrain.planner.assignment.assign_by_overlap`), and each intersection whose two
ends are one process is a keep. A parameter AutoTP does not cut is held by every old TP rank:
each new rank takes it from the copy its own process held (so what it held stays in place), a
joiner from old TP rank ``new TP rank mod old TP``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..vps.tensor_parallel import TensorParallelLayout
from .box_plan import BoxPlan
from .boxes import box_transfers


def source_bands(old: TensorParallelLayout, new: TensorParallelLayout, old_members, new_members) -> np.ndarray:
    """The old TP rank whose copy of a replicated parameter each new rank takes (int64, one per
    new rank): its own process's old TP rank, or, for a joiner, ``new TP rank mod old TP``."""
    old_rank = {m: i for i, m in enumerate(old_members)}
    out = np.empty(len(new_members), dtype=np.int64)
    for j, m in enumerate(new_members):
        i = old_rank.get(m)
        out[j] = (i % old.tp) if i is not None else (j % new.tp) % old.tp
    return out


def plan_tp_transition(
    old: TensorParallelLayout,
    new: TensorParallelLayout,
    old_members: Sequence[str],
    new_members: Sequence[str],
    same_settings: bool = True,
) -> BoxPlan:
    """The plan that moves ``old`` to ``new`` with the given processes at each rank.
    ``same_settings=False``: the two may differ in ZeRO stage and settings and in working dtype
    (a checkpoint loaded into another configuration); the parameters must still be the same.

    Raises:
        LayoutMismatchError: the layouts describe different models (or ZeRO settings).
        ValueError: as :class:`BoxPlan`.
    """
    old.check_same_model(new, settings=same_settings)
    bands = source_bands(old, new, old_members, new_members)
    return BoxPlan(old, new, tuple(old_members), tuple(new_members), box_transfers(old, new, bands))
