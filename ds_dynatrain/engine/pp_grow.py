"""A grow of a pipeline job under ``dynatrain launch``: new processes join, and the PP and DP
degrees of the larger world are chosen anew; the survivors' side (:func:`grow_pipeline_parallel`)
and the joiners' (:func:`join_pipeline_parallel`).

As the AutoTP grow (:mod:`.tp_grow`), over pipeline layouts:

1. **plan** (survivors): the new :class:`~ds_dynatrain.vps.pipeline.PipelineLayout` (DeepSpeed's
   split of the layers at the new PP degree), the ranks the survivors take (the assignment that
   keeps the most state in place over the boxes' overlaps) and the joiners the others; rank 0
   publishes the generation, the launcher's agents start the joiners;
2. **form**: survivors and joiners form the new generation's group (the survivors wait there for
   the joiners' start-up); old rank 0 broadcasts the header (the plan's digest, the old PP and DP
   degrees, the new PP degree, the optimizer's scalars and the non-tensor training state); a
   joiner computes both layouts from the layer list of its own ``PipelineModule`` and checks the
   plan's digest;
3. **transfer**: the fp32 master and Adam moments move by the plan over the new group, whole
   layers to their new stages and partitioned inside each stage's DP group
   (:func:`~ds_dynatrain.engine.band_grow.move_into_new_world`), survivors sending, joiners
   receiving;
4. **rebuild**: every process builds a ``PipelineModule`` of the job's layer list at the new PP
   degree on the new group (its stage's layers only, allocated empty:
   :func:`~ds_dynatrain.zero.pipe_module.pipeline_module_at`) and ``PipelineEngine.__init__`` runs
   on it; the moved state is installed and the working parameters made from it.

A joiner's script sees a world of one process when it starts (``deepspeed.init_distributed()``
forms a group of one, :mod:`~ds_dynatrain.elastic.launch_env`): it builds its ``PipelineModule``
at one stage there, and only the layer list and settings of that module are used.
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

from ..elastic.membership import GenerationRecord
from ..errors import ResizeRefusedError
from ..planner.pp_plan import plan_pp_transition
from ..zero.pipe_module import layer_param_counts, pipeline_module_at, reset_pipeline_globals
from ..zero.pipeline import layer_type_names
from .band_grow import grow_in_place, grow_members, joiner_receives, publish_join
from .box_state import install_moved_state
from .construct import ds_config_for, keep_returned_optimizer
from .header import agree_on_header, header_failures, install_header_state
from .join import enter_generation, wait_for_switch
from .members import evict_groups, request_joiners
from .pp_build import check_pipeline_layout, construct_pipeline, job_layout
from .pp_switch import layout_for, pp_record, rebuild_pipeline_at, stage_groups
from .records import JoinRecord, ResizeRecord
from .state import Preparation


def assign_pp_grow(engine, world_size: int, pp: int):
    """Decide a grow of ``engine``'s pipeline job to ``world_size`` processes at PP degree ``pp``:
    the batch split over the new DP size, the new layout and its processes (survivors where they
    keep the most, joiners named after their ranks; recorded as the next generation's members for
    :func:`~ds_dynatrain.engine.members.request_joiners`).

    Raises:
        ResizeRefusedError: ``world_size`` not above the job's, ``pp`` not dividing it, more
            stages than layers, a split the optimizer groups cannot take, or a DP size that cannot
            keep the global batch; nothing has changed.
    """
    dt = engine._dt
    if world_size <= len(dt.members):
        raise ResizeRefusedError(f"world size {world_size} refused: a grow needs more than {len(dt.members)} processes")
    old = dt.pp_layout
    new = layout_for(old, layer_type_names(engine.module), pp, world_size, dt.config.pipeline_partition_method)
    split = dt.split(world_size // pp, "DP size")
    g = dt.generation + 1
    members = grow_members(old, new, dt.members, g)
    dt.assigned[(g, world_size, ())] = members
    return split, new, members


def grow_pipeline_parallel(engine, world_size: int, pp: int, prepared: Optional[Preparation] = None) -> ResizeRecord:
    """Grow ``engine``'s pipeline job to ``world_size`` processes at PP degree ``pp`` now.

    Collective over the current generation; the joiners it asks the launcher for take part from
    the rendezvous on (:func:`join_pipeline_parallel`). ``prepared``: a request whose generation
    was published and whose joiners and group were started behind training. Returns the resize
    record.

    Raises:
        ResizeRefusedError: as :func:`assign_pp_grow`; nothing has changed.
        TransitionAbortedError: the joiners did not come within ``collective_timeout_s``, the
            processes planned differently, or a peer failed during the transfer.
    """
    dt = engine._dt
    t0 = time.perf_counter()
    members, old, g = tuple(dt.members), dt.pp_layout, dt.generation + 1
    split, new, new_members = assign_pp_grow(engine, world_size, pp)
    request_joiners(engine, world_size)  # publishes generation g; the agents start its joiners
    plan = plan_pp_transition(old, new, members, new_members)
    rec = pp_record(engine, len(members), world_size, g, old.pp, pp, t0)

    def rebuild():
        rebuild_pipeline_at(engine, new, split)
        dt.pp_layout = new
        check_pipeline_layout(engine)

    return grow_in_place(engine, plan, g, rec, t0, rebuild, prepared)


def join_pipeline_parallel(
    engine, rec: GenerationRecord, module, optimizer, model_parameters, lr_scheduler, optimizer_groups: Tuple
) -> JoinRecord:
    """Join a pipeline job's generation ``rec`` (its membership names this process): form its
    group, receive and check the header, receive this process's fp32 master and moments, build
    the new stage's ``PipelineModule`` from ``module``'s layer list and the engine on it, install
    the state. Returns the join record.

    Args:
        module: the script's ``PipelineModule`` (built at one stage in the joiner's world of one).
        optimizer, model_parameters, lr_scheduler: what ``ds_dynatrain.initialize`` took.
        optimizer_groups: ``(key, index)`` of the parameters outside the optimizer's group 0
            (:func:`~ds_dynatrain.engine.pp_build.gather_optimizer_groups`).

    Raises:
        TransitionAbortedError: the generation was given up, a rendezvous or the header failed,
            or the plan this process computed differs from the survivors' (another model).
    """
    dt = engine._dt
    t0 = time.perf_counter()
    timeout = dt.group_timeout_s
    reused = enter_generation(dt, rec, timeout)
    wait_for_switch(dt, rec, timeout)
    dt.held.clear()  # the warm-up's memory, touched and held until now: the set-up and first step reuse it
    method, names = dt.config.pipeline_partition_method, layer_type_names(module)
    box: dict = {}

    def check(h) -> Optional[str]:
        was = h.old_layout
        if h.pipeline_parallel_to is None or "pipeline_parallel" not in was:
            return "the survivors' job is not a pipeline job"
        pp_old, pp_new = int(was["pipeline_parallel"]), int(h.pipeline_parallel_to)
        old = job_layout(module, dt.ds_config, dt.config, pp_old, pp_old * int(was["data_parallel"]), optimizer_groups)
        try:
            new = layout_for(old, names, pp_new, rec.world_size, method)
        except ResizeRefusedError as err:
            return str(err)
        box["plan"] = plan = plan_pp_transition(old, new, h.old_members, h.new_members)
        return "plan digest differs" if plan.digest() != h.digest else None

    with header_failures(rec.generation):
        header = agree_on_header(None, check, src=rec.header_rank)
    plan = box["plan"]
    new = plan.new_layout
    dests, scalars, stats = joiner_receives(dt, plan, header)
    dt.members, dt.generation, dt.retired = plan.new_members, rec.generation, False
    dt.pp_layout = new
    reset_pipeline_globals()
    stage_module = pipeline_module_at(module, new.pp, method, layer_param_counts(new))
    optimizer, model_parameters = _on_stage(stage_module, new, optimizer, model_parameters)
    dt.rebuild_broadcast = "none"  # the working parameters are made from the installed master
    config = ds_config_for(dt, dt.split(new.dp, "DP size"), client_objects=False)
    construct_pipeline(engine, dt, stage_module, optimizer, model_parameters, lr_scheduler, config, light=True)
    keep_returned_optimizer(engine)
    check_pipeline_layout(engine)
    install_moved_state(engine, dests, scalars)
    install_header_state(engine, header, None, joiner=True)
    evict_groups(dt)
    return publish_join(engine, rec.generation, reused, t0, stats)


def _on_stage(stage_module, layout, optimizer, model_parameters):
    """The optimizer and ``model_parameters`` a joiner's engine is built with, over ``stage_module``'s
    parameters: a torch optimizer's groups (or ``{"params": ...}`` dicts) each hold the stage's
    parameters of that group in module order (DeepSpeed leaves the empty ones out); else the
    stage's parameters for the config's optimizer."""
    by_group = stage_groups(stage_module, layout)
    if isinstance(optimizer, torch.optim.Optimizer):
        for g, group in enumerate(optimizer.param_groups):
            group["params"] = by_group.get(g, [])
        optimizer.state.clear()
        return optimizer, None
    groups = list(model_parameters) if model_parameters is not None else []
    if groups and isinstance(groups[0], dict):
        return None, [{**group, "params": by_group.get(g, [])} for g, group in enumerate(groups)]
    return None, list(stage_module.parameters())
