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
from typing import List, Optional, Sequence, Tuple

import torch.distributed as tdist

from ..batch import split_global_batch
from ..errors import LayoutMismatchError, ResizeRefusedError
from ..planner.box_plan import assign_box_members_best
from ..planner.tp_plan import plan_tp_transition
from ..zero.state import extract_partitions
from .box_state import count_transfer, install_moved_state, kinds_of, move_state, new_partitions, new_scalars
from .members import evict_groups, form_generation, leave_job, request_joiners
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
    g = dt.generation + 1
    dt.assigned[(g, world_size, tuple(must_leave))] = new_members
    request_joiners(engine, world_size, tuple(must_leave))  # publishes generation g (no joiner)
    if engine.global_rank == 0:
        dt.membership.go(g)
    plan = plan_tp_transition(old, new, members, new_members)
    digests: List[Optional[str]] = [None] * len(members)
    tdist.all_gather_object(digests, plan.digest())
    if len(set(digests)) != 1:
        raise LayoutMismatchError(f"the processes planned the TP resize differently: digests {sorted(set(digests))}")
    rank = members.index(dt.member)
    stays = dt.member in new_members
    new_rank = new_members.index(dt.member) if stays else None
    state = extract_partitions(engine)
    dests = new_partitions(new, new_rank, kinds_of(state)) if stays else None
    rec = tp_record(engine, len(members), world_size, g, old.tp, tp, t0)
    peers = [members.index(m) for m in new_members]
    count_transfer(rec, plan, state, move_state(dt, plan, rank, state, dests, new_rank, peers))
    scalars = new_scalars(old, rank, new, new_rank, state.scalars) if stays else None
    state = None
    if not stays:
        leave_job(engine, rec)
        return None
    t = time.perf_counter()

    def form() -> None:
        t_group = time.perf_counter()
        rec.group_reused = form_generation(dt, g, new_members, dt.group_timeout_s, step=dt.published_step[g])
        rec.group_s = time.perf_counter() - t_group
        dt.members = new_members
        dt.generation = g

    rebuild_at(engine, tp, split, before_groups=form, same_world=False)
    install_moved_state(engine, dests, scalars)
    dt.tp_layout = new
    evict_groups(dt)
    rec.rebuild_s = time.perf_counter() - t - rec.group_s
    rec.seconds = time.perf_counter() - t0
    publish(engine, rec)
    return rec
