"""A shrink of a pipeline job under ``dynatrain launch``: fewer processes, its PP and DP degrees
chosen anew (a request for fewer processes, or preemption notices).

As the AutoTP shrink (:mod:`.tp_resize`), over pipeline layouts:

1. **plan**: the new :class:`~ds_dynatrain.vps.pipeline.PipelineLayout` (DeepSpeed's split of the
   layers at the new PP degree), the processes that take its ranks (the assignment that keeps the
   most state in place over the boxes' overlaps; preempted processes never stay), the box plan;
   rank 0 publishes the new generation; every process checks the plan's digest against rank 0's;
2. **transfer**: the fp32 master and Adam moments move by the plan over the old world's group,
   leavers included (a preempted process hands its state over before it exits);
3. **leave**: a process not in the new world tears its engine down and leaves (its script sees
   ``engine.is_member`` False);
4. **rebuild**: the others form the new generation's group, and the engine is rebuilt on it at
   the new PP degree (:func:`~ds_dynatrain.engine.pp_switch.rebuild_pipeline_at`: a new
   ``PipelineModule`` and its groups on the new world).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, Tuple

from ..errors import ResizeRefusedError
from ..planner.box_plan import assign_box_members_best
from ..planner.pp_plan import plan_pp_transition
from ..zero.pipeline import layer_type_names
from .band_shrink import agree_on_plan, form_shrunk, hand_over, publish_shrink
from .box_state import install_moved_state
from .members import evict_groups
from .pending import publish
from .pp_build import check_pipeline_layout
from .pp_switch import layout_for, pp_record, rebuild_pipeline_at
from .records import ResizeRecord


def pp_for_world(engine, world: int) -> int:
    """The PP degree the job takes over ``world`` processes: the current one where it divides
    them, else the largest smaller one, else the smallest larger one (up to the number of layers);
    the layers, the optimizer groups and the global batch (split over ``world / PP`` DP ranks)
    must allow it. 0 if none."""
    dt = engine._dt
    names, pp = layer_type_names(engine.module), dt.pp_layout.pp
    order = [*range(min(pp, world), 0, -1), *range(pp + 1, min(world, len(dt.pp_layout.layers)) + 1)]
    for p in order:
        if world % p:
            continue
        try:
            layout_for(dt.pp_layout, names, p, world, dt.config.pipeline_partition_method)
            dt.split(world // p, "DP size")
            return p
        except ResizeRefusedError:
            continue
    return 0


def largest_pp_layout(engine, at_most: int) -> Tuple[int, int]:
    """The largest ``(world size, PP degree)`` of at most ``at_most`` processes the job can take
    (:func:`pp_for_world`: the current PP degree first). ``(0, 0)`` if none."""
    for world in range(at_most, 0, -1):
        pp = pp_for_world(engine, world)
        if pp:
            return world, pp
    return 0, 0


def shrink_pipeline_parallel(
    engine, world_size: int, pp: int, must_leave: Sequence[str] = ()
) -> Optional[ResizeRecord]:
    """Shrink ``engine``'s pipeline job to ``world_size`` processes at PP degree ``pp`` now.

    Collective over the current generation. Returns the resize record in a process that stays,
    None in one that left (it has torn its engine down and left the process group).

    Raises:
        ResizeRefusedError: not fewer processes (a grow is :func:`~ds_dynatrain.engine.pp_grow.
            grow_pipeline_parallel`), or a layout the layers, the optimizer groups or the global
            batch cannot take; nothing has changed.
        LayoutMismatchError: the processes computed different plans.
        TransitionAbortedError: a peer failed during the transfer.
    """
    dt = engine._dt
    t0 = time.perf_counter()
    members = tuple(dt.members)
    if world_size > len(members):
        raise ResizeRefusedError(f"world size {world_size} refused: a shrink needs fewer than {len(members)} processes")
    old = dt.pp_layout
    new = layout_for(old, layer_type_names(engine.module), pp, world_size, dt.config.pipeline_partition_method)
    split = dt.split(world_size // pp, "DP size")
    new_members, _ = assign_box_members_best(old, new, members, (), tuple(must_leave))
    g = publish_shrink(engine, world_size, must_leave, new_members)
    plan = plan_pp_transition(old, new, members, new_members)
    agree_on_plan(plan, len(members), "PP resize")
    rec = pp_record(engine, len(members), world_size, g, old.pp, pp, t0)
    moved = hand_over(engine, plan, rec)
    if moved is None:
        return None
    t = time.perf_counter()
    form_shrunk(engine, g, rec)
    rebuild_pipeline_at(engine, new, split)
    install_moved_state(engine, *moved)
    dt.pp_layout = new
    check_pipeline_layout(engine)
    evict_groups(dt)
    rec.rebuild_s = time.perf_counter() - t - rec.group_s
    rec.seconds = time.perf_counter() - t0
    publish(engine, rec)
    return rec
