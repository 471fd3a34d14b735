"""Building a pipeline engine: the job's pipeline layout from its ``PipelineModule`` and optimizer
groups, ``PipelineEngine.__init__`` run on our object (at start, again in place at a change of PP
degree, and in a joiner) as ``deepspeed.initialize`` runs it for a ``PipelineModule``, and the
check that DeepSpeed's build is the job's pipeline layout."""

from __future__ import annotations

import contextlib

import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..config import ConfigError, DynatrainConfig
from ..elastic.launch_env import local_rank
from ..elastic.threads import share_cpus
from ..errors import LayoutMismatchError
from ..zero.geometry import working_dtype, zero12_settings
from ..zero.pipeline import pipeline_layout
from ..zero.quiet import scheduler_start_quiet, use_current_collectives
from ..zero.rebuild import light_rebuild
from .construct import attach_snapshot_engine
from .device import bind_device, engine_args
from .state import ElasticState


def construct_pipeline(
    engine, dt: ElasticState, module, optimizer, model_parameters, lr_scheduler, ds_config: dict, light: bool = False
) -> None:
    """Run ``PipelineEngine.__init__`` on ``engine`` (a new object or one being rebuilt), as
    ``deepspeed.initialize`` does for a ``PipelineModule`` (its ``mpu`` is the module's grid),
    then give it the snapshot engine. ``light``: the optimizer state is installed right after (a
    layout change). Under ``dynatrain launch`` its intra-op threads are first set to its share of
    the host's CPUs among the generation's workers there (:func:`~ds_dynatrain.elastic.threads.
    share_cpus`), as a DP job's."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    if dt.membership is not None:  # this host's CPUs shared among the generation's workers on it
        share_cpus(dt.membership.store, dt.members, dt.member)
    engine._dt = dt
    use_current_collectives()  # DeepSpeed's comm started with the script's init: torch's current names
    mpu = module.mpu()
    config_class = DeepSpeedConfig(ds_config, mpu)
    deepspeed.set_optimizer_flags(config_class, module)
    with light_rebuild((), True) if light else contextlib.nullcontext(), scheduler_start_quiet():
        PipelineEngine.__init__(
            engine,
            args=engine_args(bind_device(get_accelerator(), local_rank())),
            model=module,
            optimizer=optimizer,
            model_parameters=model_parameters,
            lr_scheduler=lr_scheduler,
            mpu=mpu,
            dist_init_required=False,
            config=ds_config,
            config_class=config_class,
        )
    engine._configure_python_gc()
    dt.rebuild_broadcast = None
    attach_snapshot_engine(engine, dt)


def check_pipeline_layout(engine) -> None:
    """Raise :class:`LayoutMismatchError` when DeepSpeed's build is not the job's layout on this
    rank: the stage's parameters (names, shapes, order), its optimizer groups (the parameters of
    each, in order) or its fp32 partitions' sizes."""
    from ..zero.geometry import fp32_partitions, zero_optimizer_of

    layout = engine._dt.pp_layout
    rank = tdist.get_rank()
    stage = layout.stage_of_rank(rank)
    theirs = [(n, tuple(p.shape)) for n, p in engine.module.named_parameters()]
    ours = [(p.key, tuple(p.shape)) for p in layout.stage_params(stage)]
    if theirs != ours:
        raise LayoutMismatchError(f"stage {stage} holds {theirs[:3]}..., the pipeline layout says {ours[:3]}...")
    zl = layout.zero(stage)
    name = {id(p): n for n, p in engine.module.named_parameters()}
    theirs = [[name.get(id(p)) for p in group] for group in zero_optimizer_of(engine).bit16_groups]
    ours = [[p.key for p in group] for group in zl.groups]
    if theirs != ours:
        raise LayoutMismatchError(
            f"stage {stage}'s optimizer groups hold {[g[:2] for g in theirs]}..., the pipeline layout says "
            f"{[g[:2] for g in ours]}... (each group's parameters in the module's order)"
        )
    sizes = [int(t.numel()) for t in fp32_partitions(zero_optimizer_of(engine))]
    expected = [zl.partition_numel(b) for b in range(zl.num_partitions)]
    if sizes != expected:
        raise LayoutMismatchError(
            f"this rank's fp32 partitions hold {sizes} elements, the pipeline layout says {expected}"
        )


def job_layout(module, ds_config: dict, dt_cfg: DynatrainConfig, pp: int, world: int, optimizer_groups=()):
    """The job's :class:`~ds_dynatrain.vps.pipeline.PipelineLayout` at ``pp`` stages."""
    dtype = str(working_dtype(ds_config, module)).replace("torch.", "")
    method = dt_cfg.pipeline_partition_method
    zero = dict(stage=1, optimizer_groups=optimizer_groups, **zero12_settings(ds_config))
    return pipeline_layout(module, pp, world, dtype, method, **zero)


def gather_optimizer_groups(module, optimizer, model_parameters):
    """``(key, index)`` of every trainable parameter of the whole pipeline outside the optimizer's
    group 0 (each process names its stage's; collective), for :class:`PipelineLayout`: the
    parameter groups of ``optimizer`` (a torch optimizer) or of ``model_parameters`` (a list of
    ``{"params": ...}`` dicts); one group otherwise.

    Raises:
        ConfigError: (on every rank) a process with another number of groups than the others, a
            trainable parameter of the stage in no group or in two, a tied parameter in different
            groups on different stages.
    """
    groups = optimizer.param_groups if optimizer is not None else list(model_parameters or [])
    if not groups or not isinstance(groups[0], dict):
        groups = [{"params": list(module.parameters())}]
    name = {id(p): n for n, p in module.named_parameters()}
    mine, problem = {}, None
    for g, group in enumerate(groups):
        for p in group["params"]:
            key = name.get(id(p))
            if key is None:
                problem = problem or f"optimizer group {g} holds a tensor that is no parameter of the stage"
            elif key in mine:
                problem = problem or f"parameter {key} is in optimizer groups {mine[key]} and {g}"
            mine[key] = g
    missing = [n for n, p in module.named_parameters() if p.requires_grad and n not in mine]
    if missing:
        problem = problem or f"parameter {missing[0]} is in no optimizer group"
    every = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, (len(groups), mine, problem))
    merged: dict = {}
    for r, (count, theirs, said) in enumerate(every):
        if said is None and count != len(groups):
            said = f"{count} optimizer parameter groups on rank {r}, {len(groups)} on rank {tdist.get_rank()}"
        for key, g in theirs.items():
            if merged.setdefault(key, g) != g and said is None:
                said = f"tied parameter {key} is in optimizer group {merged[key]} on one stage and {g} on another"
        if said is not None:
            raise ConfigError(
                f"a PipelineModule job's optimizer groups (rank {r}): {said}; every stage needs the same groups"
            )
    return tuple(sorted((k, g) for k, g in merged.items() if g))
