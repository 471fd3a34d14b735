"""The first build of an elastic engine in a worker: the launch context, the job's store and first
generation, DeepSpeed's set-up on our object, or joining a running job; then the restore of a
restarted job and the exit hooks."""

from __future__ import annotations

import atexit
from typing import List

import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator

from ..config import (
    ConfigError,
    DynatrainConfig,
    check_elastic_config,
    check_tensor_parallel,
    is_tensor_parallel_job,
    tensor_parallel_degree,
)
from ..elastic.launch_env import (
    LAUNCHER_LIMITS,
    LaunchContext,
    enter_lone_process,
    local_rank,
    lone_process,
    member_id,
    started_elsewhere,
)
from ..elastic.membership import GenerationRecord, Membership
from ..elastic.threads import one_thread_unless_fixed
from ..log import logger
from ..planner.assignment import import_solver_in_background
from ..zero.comm import reset_deepspeed_comm, skip_cpu_shm_op
from .construct import construct, ds_config_for
from .device import bind_device
from .elastic_engine import ElasticEngine
from .join import join_generation, joined_generation
from .lifecycle import at_thread_shutdown, close_at_exit, shutdown, take_preemption_notices
from .members import form_generation
from .records import MetricsWriter
from .restore import restore
from .state import ElasticState
from .tp_grow import join_tensor_parallel
from .tp_switch import check_layout, tp_layout_for_model
from .warmup import hold_engine_memory, warm_joiner


def client_groups(model: torch.nn.Module, optimizer, model_parameters) -> List[list]:
    """The parameter groups DeepSpeed will build the optimizer over, as lists of parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [list(g["params"]) for g in optimizer.param_groups]
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if params and isinstance(params[0], dict):
        return [list(g["params"]) for g in params]
    return [params]


def start_engine(
    model,
    optimizer,
    model_parameters,
    lr_scheduler,
    ds_config: dict,
    dt_cfg: DynatrainConfig,
    collate_fn=None,
    distributed_port: int = 29500,
    dist_init_required=None,
) -> ElasticEngine:
    """An :class:`ElasticEngine` for this worker: built on the job's first generation, or joined
    to the running job (a process the launcher started as a joiner), or built on
    ``torch.distributed`` as ``deepspeed.initialize`` would be outside ``dynatrain launch``.

    Raises:
        ConfigError: batch keys or a schedule the job cannot serve, or a schedule outside
            ``dynatrain launch``.
        NotAMemberError: a joiner whose generation was cancelled.
    """
    accelerator = get_accelerator()
    skip_cpu_shm_op(accelerator)
    bind_device(accelerator, local_rank())  # before any group forms and any state is allocated
    ctx = LaunchContext.from_environ()
    atexit.register(shutdown)
    backend = dt_cfg.dist_backend or accelerator.communication_backend_name()
    membership = None
    if ctx is None:
        if dt_cfg.resize_schedule and not is_tensor_parallel_job(ds_config):  # a TP job's keeps its world
            raise ConfigError(f"dynatrain.resize_schedule: this process was {started_elsewhere()}; {LAUNCHER_LIMITS}")
        _init_distributed(backend, distributed_port, dist_init_required)
        world_size, rank, generation = tdist.get_world_size(), tdist.get_rank(), 0
        member = member_id(0, rank)
    else:
        membership = Membership(ctx, dt_cfg.collective_timeout_s, backend, on_new_default=reset_deepspeed_comm)
        world_size, member, generation = ctx.world_size, ctx.member, ctx.generation
    # the launch world size, and every scheduled one, must keep the global batch (split over DP ranks);
    # an AutoTP joiner checks what the job's first processes checked, at the job's launch world size:
    # the generation it joins may train at another TP degree than the config's (a switch), one that
    # need not divide the config's (a grow to TP 1 x DP 3 of a job launched at TP 2). A DP joiner
    # checks its own world (a front-end fills the batch keys in for it)
    tp_joiner = ctx is not None and ctx.joiner and is_tensor_parallel_job(ds_config)
    checked_world = int(membership.job()["world_size"]) if tp_joiner else world_size
    tp = check_tensor_parallel(ds_config, dt_cfg, checked_world, launched=ctx is not None)
    global_batch, micro = check_elastic_config(ds_config, dt_cfg, checked_world // tp, elastic=ctx is not None)
    if ctx is not None and ctx.joiner:
        # the batch rule is the job's: its largest micro-batch is the launch config's (a front-end may
        # have given this joiner its generation's smaller one, as Trainer's per-device batch)
        micro = int(membership.job()["micro_batch"])
    dt = ElasticState(
        config=dt_cfg,
        ds_config=ds_config,
        global_batch=global_batch,
        micro_batch=micro,
        membership=membership,
        member=member,
        members=(),
        generation=generation,
        backend=backend,
        metrics=MetricsWriter(dt_cfg.metrics_path),
        collate_fn=collate_fn,
    )
    engine = ElasticEngine.__new__(ElasticEngine)
    engine._dt = dt
    if ctx is not None and ctx.joiner:
        _join(engine, ctx, model, optimizer, model_parameters, lr_scheduler)
    else:
        _build_first(engine, ctx, world_size, model, optimizer, model_parameters, lr_scheduler)
    dt.returned_optimizer = engine.optimizer
    if ctx is not None:
        take_preemption_notices(dt)
        dt.requests_seen = membership.served()
        if ctx.restore_dir and not ctx.joiner:
            restore(engine, ctx.restore_dir)
    at_thread_shutdown(close_at_exit, engine)
    if ctx is not None:  # a later shrink or grow plans at once: the solver's import off its path
        import_solver_in_background()
    return engine


def _init_distributed(backend: str, distributed_port: int, dist_init_required) -> None:
    """``deepspeed.init_distributed`` outside ``dynatrain launch``: from what the launcher set
    (env://, MPI, ...), or, in a process no launcher started, a group of one over a store of its
    own on a free port of the loopback (where DeepSpeed would look for MPI)."""
    import deepspeed

    if tdist.is_initialized() or not lone_process():
        deepspeed.init_distributed(
            dist_backend=backend, distributed_port=distributed_port, dist_init_required=dist_init_required
        )
        return
    enter_lone_process()
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, init_method="tcp://127.0.0.1:0", rank=0, world_size=1
    )
    logger.info("no launcher: a job of one process")


def _build_first(engine: ElasticEngine, ctx, world_size: int, model, optimizer, model_parameters, lr_scheduler) -> None:
    """Build the engine of the job's first generation (every rank of it); rank 0 publishes the
    generation and what a requester checks a world size against."""
    dt = engine._dt
    dt.members = tuple(member_id(dt.generation, r) for r in range(world_size))
    dt.history = [dt.members]
    if ctx is not None:
        form_generation(dt, dt.generation, dt.members, dt.config.collective_timeout_s)
    tp = tensor_parallel_degree(dt.ds_config)
    if is_tensor_parallel_job(dt.ds_config):  # described on the uncut model, before AutoTP cuts it
        dt.tp_layout = tp_layout_for_model(model, client_groups(model, optimizer, model_parameters), tp, world_size, dt)
    config = ds_config_for(dt, dt.split(world_size // tp), client_objects=False)
    construct(engine, dt, model, optimizer, model_parameters, lr_scheduler, config)
    if dt.tp_layout is not None:
        check_layout(engine)  # a cut these layouts do not describe stops the job now
    if ctx is not None and ctx.rank == 0:
        dt.membership.publish(GenerationRecord(dt.generation, world_size, dt.members, 0))
        dt.membership.publish_job(dt.global_batch, dt.micro_batch, dt.config.max_world_size, world_size)


def _join(engine: ElasticEngine, ctx: LaunchContext, model, optimizer, model_parameters, lr_scheduler) -> None:
    """Join the running job as a new rank of generation ``ctx.generation``."""
    dt = engine._dt
    # warm while the survivors train (until the generation forms): no collective, no state changed,
    # one CPU thread beside the host's running workers
    one_thread_unless_fixed()
    tensor_parallel = is_tensor_parallel_job(dt.ds_config)
    groups = client_groups(model, optimizer, model_parameters)
    if not tensor_parallel:  # an AutoTP grow waits for its joiners at the rendezvous: no warm-up
        dt.warmup_s = warm_joiner(dt.membership.store, model, ctx.generation, dt.group_timeout_s, hold=dt.held)
        hold_engine_memory(dt, model, groups, ctx.world_size, ctx.generation)
    rec = joined_generation(dt, ctx)
    if tensor_parallel:
        join_tensor_parallel(engine, rec, model, optimizer, model_parameters, lr_scheduler, groups)
        return
    join_generation(engine, rec, model, optimizer, model_parameters, lr_scheduler, groups, rebuilt=False)
