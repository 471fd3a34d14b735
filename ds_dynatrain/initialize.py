"""``ds_dynatrain.initialize``: ``deepspeed.initialize`` with an elastic engine behind it."""
from __future__ import annotations

import atexit
import os
from typing import Any, Optional, Tuple

import torch

from .batch import split_global_batch
from .config import ConfigError, load_ds_config
from .engine import (ElasticEngine, ElasticState, PendingResize, begin_transition, construct, ds_config_for,
                     build_joiner_xfer, install_state, join_header, own_layout,
                     scalars_for)
from .errors import NotAMemberError, ResizeRefusedError
from .launch_env import LaunchContext, member_id
from .membership import GenerationRecord, Membership
from .metrics import MetricsWriter, logger


def resolve_global_batch(ds_config: dict, world_size: int) -> Tuple[int, int]:
    """``(global batch, largest micro-batch)`` in samples from DeepSpeed's batch keys at ``world_size``.

    Follows DeepSpeed's rule ``train_batch_size = micro * accumulation * world_size``.

    Raises:
        ConfigError: no batch key, or keys that contradict each other.
    """
    tb = ds_config.get("train_batch_size")
    mb = ds_config.get("train_micro_batch_size_per_gpu")
    ga = ds_config.get("gradient_accumulation_steps")
    for name, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                    ("gradient_accumulation_steps", ga)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(f"invalid DeepSpeed config: {name} must be a positive integer, got {v!r}")
    if tb and mb:
        if ga and tb != mb * ga * world_size:
            raise ConfigError(f"invalid DeepSpeed config: train_batch_size {tb} != micro batch {mb} * "
                              f"gradient_accumulation_steps {ga} * world size {world_size}")
        return tb, mb
    if tb and ga:
        if tb % (ga * world_size):
            raise ConfigError(f"invalid DeepSpeed config: train_batch_size {tb} not divisible by "
                              f"gradient_accumulation_steps {ga} * world size {world_size}")
        return tb, tb // (ga * world_size)
    if mb:
        return mb * (ga or 1) * world_size, mb
    if tb:
        if tb % world_size:
            raise ConfigError(f"invalid DeepSpeed config: train_batch_size {tb} not divisible by world size {world_size}")
        return tb, tb // world_size
    raise ConfigError("invalid DeepSpeed config: set train_batch_size and train_micro_batch_size_per_gpu")


def check_elastic_config(ds_config: dict, dt_cfg, world_size: int, elastic: bool) -> Tuple[int, int]:
    """Refuse, before any process or engine exists, a config the elastic engine cannot serve.

    Checks: both batch keys for a job started by ``dynatrain launch`` (``elastic``); the launch
    world size and every scheduled one keep the global batch and respect ``max_world_size``; a
    schedule only with what a resize can move (ZeRO stage 1, 2 or 3, no offload). Returns
    ``(global batch, largest micro-batch)``.

    Raises:
        ConfigError: naming the key and the problem.
    """
    if elastic and not (ds_config.get("train_batch_size") and ds_config.get("train_micro_batch_size_per_gpu")):
        raise ConfigError("invalid DeepSpeed config: an elastic job needs both train_batch_size (kept across "
                          "resizes) and train_micro_batch_size_per_gpu (the largest micro-batch)")
    global_batch, micro = resolve_global_batch(ds_config, world_size)
    for ws, where in [(world_size, "the launch world size")] + [
            (e.world_size, f"dynatrain.resize_schedule (step {e.step})") for e in dt_cfg.resize_schedule]:
        try:
            split_global_batch(global_batch, micro, ws, dt_cfg.max_world_size)
        except ResizeRefusedError as err:
            raise ConfigError(f"invalid DeepSpeed config: {where}: {err}") from None
    if dt_cfg.resize_schedule:
        zero = ds_config.get("zero_optimization", {}) or {}
        stage = zero.get("stage", 0)
        if stage not in (1, 2, 3):
            raise ConfigError(f"invalid DeepSpeed config: dynatrain.resize_schedule needs zero_optimization.stage "
                              f"1, 2 or 3 (stage {stage} has no partitions to resize)")
        for key in ("offload_optimizer", "offload_param"):
            dev = (zero.get(key) or {}).get("device", "none")
            if dev not in (None, "none"):
                raise ConfigError(f"invalid DeepSpeed config: dynatrain.resize_schedule with "
                                  f"zero_optimization.{key}.device={dev!r}: offloaded state is not moved by a resize")
    return global_batch, micro


def _client_groups(model: torch.nn.Module, optimizer, model_parameters):
    """The parameter groups DeepSpeed will build the optimizer over, as lists of parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [list(g["params"]) for g in optimizer.param_groups]
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if params and isinstance(params[0], dict):
        return [list(g["params"]) for g in params]
    return [params]


def initialize(args: Any = None,
               model: Optional[torch.nn.Module] = None,
               optimizer=None,
               model_parameters=None,
               training_data=None,
               lr_scheduler=None,
               distributed_port: int = 29500,
               mpu=None,
               dist_init_required: Optional[bool] = None,
               collate_fn=None,
               config=None,
               config_params=None,
               *,
               seed: int = 0,
               shuffle: bool = True):
    """Drop-in for ``deepspeed.initialize`` returning an :class:`~ds_dynatrain.engine.ElasticEngine`.

    Same arguments and return values as ``deepspeed.initialize``: ``(engine, optimizer,
    training_dataloader, lr_scheduler)``. Differences:

    * the config may hold a ``"dynatrain"`` section (validated; DeepSpeed never sees it);
    * ``training_data`` is served by an :class:`~ds_dynatrain.data.ElasticDataLoader` (sample order
      from ``seed``), whose position survives resizes;
    * in a process the launcher started as a *joiner*, this call joins the running job: it receives
      its partitions and the training state, and returns an engine positioned at the job's step.

    Raises:
        ConfigError: invalid ``"dynatrain"`` section or batch keys, a resize schedule that cannot
            keep the global batch, or resizing asked of a job not started by ``dynatrain launch``.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if model is None:
        raise ValueError("ds_dynatrain.initialize requires a model")
    if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
        model_parameters = list(model_parameters)  # a generator would be spent by the first engine
    if config is None:
        config = config_params
    if config is None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
    if config is None:
        raise ConfigError("no DeepSpeed config: pass config= or args.deepspeed_config")
    ds_config, dt_cfg = load_ds_config(config)
    if not dt_cfg.enabled:
        return deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model_parameters,
                                    training_data=training_data, lr_scheduler=lr_scheduler,
                                    distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
                                    collate_fn=collate_fn, config=ds_config)
    if mpu is not None:
        raise ConfigError("ds_dynatrain resizes data-parallel-only jobs; a model-parallel mpu is not supported")

    _skip_cpu_shm_op(get_accelerator())
    ctx = LaunchContext.from_environ()
    atexit.register(_shutdown)
    backend = get_accelerator().communication_backend_name()
    membership = Membership(ctx, dt_cfg.collective_timeout_s) if ctx is not None else None
    if ctx is None:
        if dt_cfg.resize_schedule:
            raise ConfigError("dynatrain.resize_schedule needs the job to be started by `dynatrain launch`")
        deepspeed.init_distributed(dist_backend=backend, distributed_port=distributed_port,
                                   dist_init_required=dist_init_required)
        import torch.distributed as tdist
        world_size, rank, member, generation = tdist.get_world_size(), tdist.get_rank(), "g0r0", 0
        member = member_id(0, rank)
    else:
        world_size, rank, member, generation = ctx.world_size, ctx.rank, ctx.member, ctx.generation

    # the launch world size, and every scheduled one, must keep the global batch
    global_batch, micro = check_elastic_config(ds_config, dt_cfg, world_size, elastic=ctx is not None)

    dt = ElasticState(config=dt_cfg, ds_config=ds_config, global_batch=global_batch, micro_batch=micro,
                      membership=membership, member=member, members=(), generation=generation, backend=backend,
                      metrics=MetricsWriter(dt_cfg.metrics_path), collate_fn=collate_fn)
    engine = ElasticEngine.__new__(ElasticEngine)
    if ctx is not None and ctx.joiner:
        _join(engine, dt, ctx, model, optimizer, model_parameters, lr_scheduler)
    else:
        dt.members = tuple(member_id(generation, r) for r in range(world_size))
        dt.history = [dt.members]
        if ctx is not None:
            membership.form(generation, dt.members, member, backend, dt_cfg.collective_timeout_s)
        construct(engine, dt, model, optimizer, model_parameters, lr_scheduler,
                  ds_config_for(dt, dt.split(world_size), client_objects=False))
        if ctx is not None and rank == 0:
            membership.publish(GenerationRecord(generation, world_size, dt.members, 0))
            membership.publish_job(global_batch, micro, dt_cfg.max_world_size, world_size)
    dt.returned_optimizer = engine.optimizer
    if ctx is not None:
        _take_preemption_notices(dt)
        dt.requests_seen = membership.served()
        restore = os.environ.get(RESTORE_ENV)
        if restore and not ctx.joiner:
            _restore(engine, dt, restore)
    _at_thread_shutdown(_close_snapshots, engine)
    loader = None
    if training_data is not None:
        from .data import ElasticDataLoader
        loader = ElasticDataLoader(training_data, engine, global_batch, seed=seed, shuffle=shuffle,
                                   collate_fn=collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


RESTORE_ENV = "DYNATRAIN_RESTORE"  # set by the launcher when it restarts a job from its snapshots


def _restore(engine: ElasticEngine, dt: ElasticState, snapshot_dir: str) -> None:
    """Load the latest complete snapshot of ``snapshot_dir`` (any saving world size) into a job the
    launcher restarted after a worker died; log and record how many steps were lost."""
    last = dt.membership.last_step()
    path, _client = engine.load_checkpoint(snapshot_dir)
    if path is None:
        raise NotAMemberError(f"no snapshot to restore from in {snapshot_dir}")
    lost = max(0, last - engine.global_steps)
    if engine.global_rank == 0:
        dt.metrics.write({"event": "restore", "step": engine.global_steps, "world_size": engine.dp_world_size,
                          "lost_steps": lost, "last_step": last, "dir": os.path.dirname(path)})
        logger.info(f"restored {os.path.dirname(path)} on {engine.dp_world_size} ranks: the job goes on after step "
                    f"{engine.global_steps}; {lost} step(s) since that snapshot were lost")


def _take_preemption_notices(dt: ElasticState) -> None:
    """SIGTERM to a worker of a ``dynatrain launch`` job is a preemption notice: the process
    hands over its partitions and leaves at the next step boundary (the others shrink the job)
    instead of dying. A second SIGTERM ends the process at once."""
    import signal

    def on_sigterm(signum, _frame):
        if dt.preempted:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        dt.preempted = True
        logger.info(f"member {dt.member}: preemption notice (SIGTERM); "
                    + ("it stops standing by" if dt.retired else "leaving at the next step boundary"))

    import threading
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def _skip_cpu_shm_op(accelerator) -> None:
    """Tell DeepSpeed its CPU shared-memory all-reduce op is unavailable, so it is not built.

    ``deepspeed.comm`` JIT-compiles that op (``deepspeed_shm_comm``) whenever it starts on the CPU
    accelerator, though only ``inference_all_reduce`` uses it. The build takes about 30 s on a
    fresh machine, and a worker killed during it leaves a lock file in the torch extensions
    directory that makes every later job wait forever. Training never calls it; marking it
    incompatible (DeepSpeed's own switch, ``deepspeed.ops.__compatible_ops__``) skips the build.
    """
    if accelerator.device_name() != "cpu":
        return
    import deepspeed.ops as ops
    ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _at_thread_shutdown(fn, *args) -> None:
    """Run ``fn(*args)`` when the main thread finishes, before thread pools stop taking work.

    Python stops ``concurrent.futures`` executors from ``threading``'s shutdown hooks, which run
    *before* ``atexit`` handlers; the snapshot engine's io threads must still work when the last
    snapshot is finished at exit, so this hook is registered with ``threading`` (later
    registrations run first). Falls back to ``atexit`` where that hook does not exist.
    """
    import threading
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython < 3.9
        atexit.register(fn, *args)
    else:
        register(fn, *args)


def _close_snapshots(engine) -> None:
    """At exit: stop joiners that will never be needed; let the last snapshot finish and publish
    (bounded by the collective timeout)."""
    from .snapshot import SnapshotCheckpointEngine
    dt = getattr(engine, "_dt", None)
    if dt is not None and engine.is_member:
        engine.cancel_pending_joiners()
        if dt.membership is not None and engine.global_rank == 0:
            dt.membership.done()  # standby processes leave
        try:
            engine.wait_transition()  # peers may still be sending to or receiving from this process
        except Exception as err:  # noqa: BLE001 - exiting anyway; say why
            logger.warning(f"at exit: the last resize's transfer failed: {err}")
    ce = getattr(engine, "checkpoint_engine", None)
    if isinstance(ce, SnapshotCheckpointEngine):
        ce.close()


def _shutdown() -> None:
    """Before the interpreter exits: destroy the process group (left to the interpreter's
    teardown, gloo's threads can outlive it and abort the process, status -6, after training
    finished), and move every object into the garbage collector's permanent generation
    (``gc.freeze``). The collections Python runs while it tears down modules otherwise traverse
    the whole object graph of torch, DeepSpeed and transformers again and again: about 2.5 s of
    CPU in a process that leaves a job at a resize, taken from the survivors' first steps on a
    shared host. Nothing is lost: the process is ending, and only cyclic garbage is left for the
    operating system to reclaim."""
    import gc
    import torch.distributed as tdist
    from .groups import close_all
    close_all()  # the cached groups too, not only the default one
    if tdist.is_initialized():
        tdist.destroy_process_group()
    gc.freeze()


def _join(engine: ElasticEngine, dt: ElasticState, ctx: LaunchContext, model, optimizer, model_parameters,
          lr_scheduler) -> None:
    """Join the running job as a new rank of generation ``ctx.generation``."""
    cfg = dt.config
    dt.membership.wait_go(ctx.generation, cfg.join_timeout_s)
    rec = dt.membership.read(ctx.generation, cfg.join_timeout_s)
    if ctx.member not in rec.members:
        raise NotAMemberError(f"member {ctx.member} is not in generation {rec.generation} "
                              f"({list(rec.members)}): it was cancelled")
    logger.info(f"member {ctx.member} joining generation {rec.generation} as rank {ctx.rank} of {rec.world_size}")
    dt.published_step[rec.generation] = rec.step
    dt.membership.form(rec.generation, rec.members, ctx.member, dt.backend, cfg.join_timeout_s, step=rec.step)
    xfer = build_joiner_xfer(dt, rec, cfg.join_timeout_s)
    own = own_layout(dt, model, _client_groups(model, optimizer, model_parameters), rec.world_size)
    header, plan = join_header(dt, rec, own)
    dests, _, transfer, overlap, xfer = begin_transition(plan, dt, rec.generation, header, None, receives=True,
                                                         group=xfer.get(cfg.join_timeout_s))
    dt.members = plan.new_members
    dt.generation = rec.generation
    dt.rebuild_broadcast = plan.survivor_ranks
    construct(engine, dt, model, optimizer, model_parameters, lr_scheduler,
              ds_config_for(dt, dt.split(rec.world_size), client_objects=False), light=True)
    install_state(engine, header, dests, joiner=True)
    record = {"event": "join", "step": engine.global_steps, "generation": rec.generation, "transfer_s": 0.0}
    dt.pending = PendingResize(transfer, dests, scalars_for(plan, header["scalars"]), record, None, xfer)
    if overlap != "step":
        engine.wait_transition()
