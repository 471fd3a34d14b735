"""A change of a pipeline job's PP and DP degree at an unchanged world size, in memory, at a step
boundary on every rank (``engine.resize(world_size, pipeline_parallel=P)``).

1. **plan**: the new :class:`~ds_dynatrain.vps.pipeline.PipelineLayout` (DeepSpeed's split of
   the layer list at ``P`` stages) and the box plan between the two layouts: every layer that
   changes stage moves whole, then is partitioned inside its new stage's DP group; a tied
   parameter is taken from a copy its process held where it held one; the processes keep their
   ranks;
2. **transfer**: every rank's fp32 master and Adam moments move by the plan into new partitions
   (:func:`~ds_dynatrain.transition.boxes.execute_box_plan`, point-to-point on the world group);
3. **rebuild**: DeepSpeed's cached groups and pipeline globals are forgotten, a new
   ``PipelineModule`` of the same layer list is built at ``P`` stages (on the meta device, then
   allocated empty: :func:`~ds_dynatrain.zero.pipe_module.pipeline_module_at`), and
   ``PipelineEngine.__init__`` runs again on the same engine object with the batch split over the
   new DP size;
4. **install**: the moved partitions become the optimizer's master and moments, and the working
   parameters are made from the master (an all-gather over each stage's DP group).

The engine object stays the same; ``engine.module`` is a new module.
"""

from __future__ import annotations

import time

import torch.distributed as tdist

from ..errors import LayoutMismatchError, ResizeRefusedError
from ..planner.pp_plan import plan_pp_transition
from ..zero.pipe_module import layer_param_counts, pipeline_module_at, reset_pipeline_globals
from ..zero.pipeline import layer_type_names, pipeline_parts
from ..zero.rebuild import teardown
from .box_state import switch_in_place
from .construct import close_snapshots, counters_kept, ds_config_for
from .pp_build import check_pipeline_layout, construct_pipeline
from .records import ResizeRecord
from .switch_memory import prepare_switch


def new_pipeline_layout(engine, pp: int):
    """The job's layout at ``pp`` stages over its processes (:func:`layout_at`).

    Raises:
        ResizeRefusedError: as :func:`layout_at`.
    """
    dt = engine._dt
    return layout_at(dt.pp_layout, layer_type_names(engine.module), pp, dt.config.pipeline_partition_method)


def layout_at(old, type_names, pp: int, method: str):
    """``old`` (a :class:`~ds_dynatrain.vps.pipeline.PipelineLayout`) at ``pp`` stages over its
    world (:func:`layout_for`).

    Raises:
        ResizeRefusedError: as :func:`layout_for`.
    """
    return layout_for(old, type_names, pp, old.world_size, method)


def layout_for(old, type_names, pp: int, world: int, method: str):
    """``old`` (a :class:`~ds_dynatrain.vps.pipeline.PipelineLayout`) at ``pp`` stages of
    ``world / pp`` ranks, the layers split by DeepSpeed's partition ``method`` (``type_names``:
    each layer's class name, for ``type:`` methods).

    Raises:
        ResizeRefusedError: ``pp`` below 1, not dividing ``world``, above the number of layers, a
            split leaving a stage without a trainable parameter or without one of an optimizer
            group the others hold (:func:`check_stage_groups`).
    """
    if pp < 1 or world % pp:
        raise ResizeRefusedError(f"PP degree {pp} refused: it must be >= 1 and divide the world size {world}")
    if pp > len(old.layers):
        raise ResizeRefusedError(f"PP degree {pp} refused: the pipeline has {len(old.layers)} layers")
    parts = pipeline_parts(old.layers, type_names, pp, method)
    try:
        new = old.with_degrees(pp, world // pp, parts)
        check_stage_groups(new)
    except LayoutMismatchError as err:
        raise ResizeRefusedError(f"PP degree {pp} refused: {err}") from None
    return new


def check_stage_groups(layout) -> None:
    """Every stage of ``layout`` holds parameters of the same optimizer groups: DeepSpeed's ZeRO-1
    all-reduces each group's gradient norm over the stages (``stage_1_and_2.py``
    ``get_grad_norm_direct``, over the model-parallel group), so stages with other groups wait
    on each other for ever.

    Raises:
        LayoutMismatchError: naming the first stage whose groups differ from stage 0's.
    """
    first = layout.optimizer_group_ids(0)
    for s in range(1, layout.pp):
        ids = layout.optimizer_group_ids(layout.rank(s, 0))
        if ids != first:
            raise LayoutMismatchError(
                f"stage {s} holds parameters of optimizer groups {list(ids)} and stage 0 of {list(first)} (split at "
                f"{list(layout.parts)}); DeepSpeed's ZeRO-1 reduces every group's gradient norm over the stages, "
                "so each stage must hold parameters of every group"
            )


def switch_pipeline_parallel(engine, pp: int) -> ResizeRecord:
    """Switch ``engine``'s pipeline degree to ``pp`` (DP becomes world size / ``pp``) now.

    Collective: every rank calls it at the same step boundary.

    Raises:
        ResizeRefusedError: as :func:`new_pipeline_layout`, or the new DP size cannot keep the
            global batch; nothing has changed.
        TransitionAbortedError: a peer failed during the transfer.
    """
    dt = engine._dt
    t0 = time.perf_counter()
    world = tdist.get_world_size()
    old = dt.pp_layout
    new = new_pipeline_layout(engine, pp)
    split = dt.split(world // pp, "DP size")  # ResizeRefusedError: the global batch cannot be kept
    plan = plan_pp_transition(old, new, dt.members, dt.members)
    rec = pp_record(engine, world, world, dt.generation, old.pp, pp, t0)

    def rebuild():
        rebuild_pipeline_at(engine, new, split)
        dt.pp_layout = new
        check_pipeline_layout(engine)

    return switch_in_place(engine, plan, rec, t0, rebuild)


def prepare_pipeline_switch(engine, pp: int) -> int:
    """Start touching, in the background, the memory a switch of ``engine`` to ``pp`` stages at
    its world size will need on this process, held until the switch
    (:func:`~ds_dynatrain.engine.switch_memory.prepare_switch`). Returns the bytes the thread
    will touch. Not collective.

    Raises:
        ResizeRefusedError: as :func:`switch_pipeline_parallel` (:func:`new_pipeline_layout`, or
            the new DP size cannot keep the global batch); nothing has changed.
    """
    dt = engine._dt
    world = len(dt.members)
    if pp >= 1 and world % pp == 0:
        dt.split(world // pp, "DP size")  # ResizeRefusedError: the global batch cannot be kept
    return prepare_switch(engine, ("pp", world, pp), lambda: new_pipeline_layout(engine, pp))


def pp_record(engine, from_world: int, to_world: int, generation: int, pp_from: int, pp_to: int, t0: float):
    """The resize record of a pipeline job's layout change decided at ``t0``
    (``time.perf_counter()``; its planning time so far), ``from_world`` -> ``to_world`` processes
    at PP ``pp_from`` -> ``pp_to``, into ``generation``."""
    return ResizeRecord(
        step=engine.global_steps,
        from_world_size=from_world,
        to_world_size=to_world,
        generation=generation,
        plan_s=time.perf_counter() - t0,
        pipeline_parallel_from=pp_from,
        pipeline_parallel_to=pp_to,
    )


def stage_groups(module, layout) -> dict:
    """``{optimizer group: [parameter, ...]}`` of a stage's ``module`` (its parameters in module
    order, by ``layout``'s group of each name): what each torch optimizer group holds there
    (DeepSpeed leaves a stage's empty groups out)."""
    by_group: dict = {}
    for n, p in module.named_parameters():
        by_group.setdefault(layout.group_of(n), []).append(p)
    return by_group


def rebuild_pipeline_at(engine, new, split) -> None:
    """Rebuild ``engine`` in place on a new ``PipelineModule`` of the same layers at ``new.pp``
    stages (``new``: the job's :class:`~ds_dynatrain.vps.pipeline.PipelineLayout` there), with the
    torch optimizer and scheduler it had (each parameter group now holds the new stage's
    parameters of that group, in module order; DeepSpeed leaves the empty ones out); its values
    are written after by :func:`~ds_dynatrain.engine.box_state.install_moved_state`."""
    dt = engine._dt
    basic, scheduler, old_module = engine.optimizer.optimizer, engine.lr_scheduler, engine.module
    with counters_kept(engine):
        close_snapshots(engine)  # a snapshot still being written finishes with the old engine's state
        teardown(engine)
        reset_pipeline_globals()
        module = pipeline_module_at(old_module, new.pp, dt.config.pipeline_partition_method, layer_param_counts(new))
        by_group = stage_groups(module, new)
        for g, group in enumerate(basic.param_groups):
            group["params"] = by_group.get(g, [])
        dt.rebuild_broadcast = "none"  # the working parameters are made from the installed master
        construct_pipeline(engine, dt, module, basic, None, scheduler, ds_config_for(dt, split, True), light=True)
    if dt.pipeline_data is not None:  # the first and last stages read it (new ones among them)
        engine.set_dataiterator(dt.pipeline_data)
