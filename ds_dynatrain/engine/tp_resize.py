"""A shrink of an AutoTP job under ``dynatrain launch``: fewer processes, and the TP and DP degrees
of the processes that stay chosen anew (a scheduled shrink, or a preemption that breaks a TP group).

1. **plan**: the new :class:`~ds_dynatrain.vps.tensor_parallel.TensorParallelLayout`, the
   processes that take its ranks (the assignment that keeps the most state in place, over the
   boxes' overlaps; preempted processes never stay), the box plan; rank 0 publishes the new
   generation; every process checks the plan's digest against rank 0's;
2. **transfer**: the fp32 master and Adam moments move by the plan over the old world's group
   (:func:`~ds_dynatrain.transition.boxes.execute_box_plan`), leavers included;
3. **leave**: a process not in the new world hands over and exits;
4. **rebuild**: the others form the new generation's group, and the engine is rebuilt on it at the
   new TP degree (:func:`~ds_dynatrain.engine.tp_switch.rebuild_at`).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, Tuple

from ..batch import split_global_batch
from ..errors import ResizeRefusedError
from ..planner.box_plan import assign_box_members_best
from ..planner.tp_plan import plan_tp_transition
from .band_shrink import agree_on_plan, form_shrunk, hand_over, publish_shrink
from .box_state import install_moved_state
from .members import evict_groups
from .pending import publish
from .records import ResizeRecord
from .tp_switch import new_layout, rebuild_at, tp_record


def largest_tp_layout(
    global_batch: int, micro_batch: int, at_most: int, tp: int, max_world_size: Optional[int] = None
) -> Tuple[int, int]:
    """The largest ``(world size, TP degree)`` with at most ``at_most`` processes whose DP size
    (world / TP) keeps the global batch: the current TP degree ``tp`` where it divides the world,
    else the largest smaller degree that does (AutoTP cuts a model at any degree). ``(0, 0)`` if
    none."""
    for world in range(at_most, 0, -1):
        for t in range(min(tp, world), 0, -1):
            if world % t:
                continue
            try:
                split_global_batch(global_batch, micro_batch, world // t, max_world_size)
                return world, t
            except ResizeRefusedError:
                continue
    return 0, 0


def shrink_tensor_parallel(engine, world_size: int, tp: int, must_leave: Sequence[str] = ()) -> Optional[ResizeRecord]:
    """Shrink ``engine``'s AutoTP job to ``world_size`` processes at TP degree ``tp`` now.

    Collective over the current generation. Returns the resize record in a process that stays,
    None in one that left (it has torn its engine down and left the process group).

    Raises:
        ResizeRefusedError: ``tp`` does not divide ``world_size``, the DP size cannot keep the
            global batch, or a grow; nothing has changed.
        LayoutMismatchError: the processes computed different plans.
        TransitionAbortedError: a peer failed during the transfer.
    """
    dt = engine._dt
    t0 = time.perf_counter()
    members = tuple(dt.members)
    if world_size > len(members):
        raise ResizeRefusedError(f"world size {world_size} refused: a grow (engine.tp_grow), not a shrink")
    if tp < 1:
        raise ResizeRefusedError(f"TP degree {tp} refused: it must be >= 1")
    if world_size % tp:
        raise ResizeRefusedError(f"TP degree {tp} refused: it does not divide the world size {world_size}")
    split = dt.split(world_size // tp, "DP size")
    old = dt.tp_layout
    new = new_layout(engine, tp, world_size)
    new_members, _ = assign_box_members_best(old, new, members, (), tuple(must_leave))
    g = publish_shrink(engine, world_size, must_leave, new_members)
    plan = plan_tp_transition(old, new, members, new_members)
    agree_on_plan(plan, len(members), "TP resize")
    rec = tp_record(engine, len(members), world_size, g, old.tp, tp, t0)
    moved = hand_over(engine, plan, rec)
    if moved is None:
        return None
    t = time.perf_counter()
    rebuild_at(engine, tp, split, before_groups=lambda: form_shrunk(engine, g, rec), same_world=False)
    install_moved_state(engine, *moved)
    dt.tp_layout = new
    evict_groups(dt)
    rec.rebuild_s = time.perf_counter() - t - rec.group_s
    rec.seconds = time.perf_counter() - t0
    publish(engine, rec)
    return rec
