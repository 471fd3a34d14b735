"""Building the engine: ``DeepSpeedEngine.__init__`` run on our object (at start, and again in place
at every resize), with DeepSpeed's config at the current world size and our snapshot engine."""

from __future__ import annotations

import contextlib
import copy
from typing import Tuple

import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine

from ..batch import BatchSplit
from ..checkpoint.footer import VPSAttributes
from ..checkpoint.snapshot import SnapshotCheckpointEngine
from ..config import tensor_parallel_degree
from ..elastic.launch_env import local_rank
from ..elastic.threads import share_cpus
from ..vps.layout import ZeroLayout
from ..zero.comm import start_deepspeed_comm
from ..zero.geometry import layout_for_model, layout_of, working_dtype
from ..zero.quiet import scheduler_start_quiet, use_current_collectives
from ..zero.rebuild import light_rebuild
from ..zero.state import working_is_cast_of_master
from ..zero.zero3 import client_attrs
from .device import bind_device, engine_args
from .records import SnapshotRecord
from .state import ElasticState


def ds_config_for(dt: ElasticState, split: BatchSplit, client_objects: bool) -> dict:
    """DeepSpeed's config at one world size: the global batch kept, the per-rank split recomputed.

    ``client_objects``: the optimizer and scheduler are passed as live objects (a rebuild), so
    their config sections are dropped.
    """
    cfg = copy.deepcopy(dt.ds_config)
    cfg["train_batch_size"] = split.train_batch_size
    cfg["train_micro_batch_size_per_gpu"] = split.micro_batch
    cfg["gradient_accumulation_steps"] = split.gradient_accumulation_steps
    if client_objects:
        cfg.pop("optimizer", None)
        cfg.pop("scheduler", None)
    return cfg


def tensor_parallel_groups(ds_config: dict):
    """For an AutoTP config: DeepSpeed's groups module with the TP mesh made (its TP and DP groups;
    DeepSpeed's own set-up finds them made) and its AutoTP training mode set, as
    ``deepspeed.initialize`` sets it; the ``mpu`` that makes ``DeepSpeedConfig`` count the batch over
    the DP ranks, not every process. None without AutoTP."""
    tp = tensor_parallel_degree(ds_config)
    if tp == 1:
        return None
    from deepspeed.module_inject.layers import set_autotp_mode
    from deepspeed.utils import groups

    set_autotp_mode(training=True)
    groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
    return groups


def construct(
    engine,
    dt: ElasticState,
    model,
    optimizer,
    model_parameters,
    lr_scheduler,
    ds_config: dict,
    light: bool = False,
    reuse_flat=(),
    values_follow: bool = False,
) -> None:
    """Run ``DeepSpeedEngine.__init__`` on ``engine`` (a new object or one being rebuilt), then
    give it the snapshot engine of this generation.

    ``light``: the optimizer state is installed right after (a resize), so DeepSpeed's
    throw-away state initialisation is skipped (:func:`~ds_dynatrain.zero.rebuild.light_rebuild`);
    ``reuse_flat``: the old engine's flat parameter buffers, which the new one may keep;
    ``values_follow``: the working parameters are written from the installed master right after,
    so the flat buffers are not filled from the model's (a TP switch).
    """
    import deepspeed

    if dt.membership is not None:  # this host's CPUs shared among the generation's workers on it
        share_cpus(dt.membership.store, dt.members, dt.member)
    engine._dt = dt  # before DeepSpeed's set-up: _broadcast_model reads it
    if not dt.param_attrs:  # what is the client's own, before ZeRO-3 attaches its attributes
        dt.param_attrs = client_attrs(model)
    # DeepSpeed's comm started here, not in the set-up, so that it uses torch's current collectives
    # before the set-up's first gather (ZeRO-3 partitions the parameters there)
    start_deepspeed_comm(dt.backend)
    use_current_collectives()
    config_class = DeepSpeedConfig(ds_config, tensor_parallel_groups(ds_config))
    deepspeed.set_optimizer_flags(config_class, model)
    # the scheduler's own "before it has started" call in its constructor is not the user's
    with light_rebuild(reuse_flat, values_follow) if light else contextlib.nullcontext(), scheduler_start_quiet():
        DeepSpeedEngine.__init__(
            engine,
            args=engine_args(bind_device(get_accelerator(), local_rank())),
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=None,
            lr_scheduler=lr_scheduler,
            mpu=None,
            dist_init_required=False,
            collate_fn=dt.collate_fn,
            config=ds_config,
            config_class=config_class,
        )
    if hasattr(DeepSpeedEngine, "_configure_python_gc"):  # DeepSpeed >= 0.19.8 (disable_python_gc), as initialize does
        engine._configure_python_gc()
    dt.rebuild_broadcast = None
    attach_snapshot_engine(engine, dt)


def attach_snapshot_engine(engine, dt: ElasticState) -> None:
    """Give a built ``engine`` (DP, AutoTP or pipeline) the snapshot engine of this generation as
    DeepSpeed's ``checkpoint_engine``. A DP job's files record each fragment's VPS attributes; an
    AutoTP or pipeline job's record none (a load checks their ``param_shapes``). A ZeRO-1/2 DP job's
    model-state file leaves its trainable parameters to the fp32 master (``snapshot.module_from_master``,
    :mod:`~ds_dynatrain.checkpoint.module_master`)."""
    snap = dt.config.snapshot
    engine.checkpoint_engine = SnapshotCheckpointEngine(
        store_address=store_address(dt),
        rank=tdist.get_rank(),
        world_size=tdist.get_world_size(),
        generation=dt.generation,
        keep_last=snap.keep_last,
        timeout_s=dt.config.collective_timeout_s,
        cache_bytes=snap.host_cache_mib << 20,
        asynchronous=snap.asynchronous,
        on_write_error=snap.on_write_error,
        worker_nice=snap.worker_nice,
        write_from_memory=snap.write_from_memory,
    )
    if dt.tp_layout is None and dt.pp_layout is None:
        layout = layout_of(engine)
        engine.checkpoint_engine.tensor_attrs = VPSAttributes(layout, tdist.get_rank())
        if snap.module_from_master and working_is_cast_of_master(engine):
            engine.checkpoint_engine.module_from_master = {p.key: tuple(p.shape) for g in layout.groups for p in g}
    if tdist.get_rank() == 0:  # every snapshot's outcome, committed or failed, is a record of rank 0
        engine.checkpoint_engine.on_outcome = lambda outcome: dt.metrics.write(SnapshotRecord.of(outcome))


def latest_by_commit(engine, save_latest: bool) -> bool:
    """Before DeepSpeed's ``save_checkpoint``: the snapshot engine's commit replaces ``latest``
    atomically (when ``save_latest``); returns what DeepSpeed's own ``save_latest`` becomes
    (False under the snapshot engine: its own write of ``latest`` is skipped)."""
    ce = engine.checkpoint_engine
    if isinstance(ce, SnapshotCheckpointEngine):
        ce.publish_latest = save_latest
        return False
    return save_latest


def close_snapshots(engine) -> None:
    """Finish the pending snapshot of the engine being torn down."""
    if isinstance(engine.checkpoint_engine, SnapshotCheckpointEngine):
        engine.checkpoint_engine.close()


@contextlib.contextmanager
def counters_kept(engine):
    """Around an in-place rebuild: the engine's step counters and loss scaler state carried over
    (the rebuilt engine counts from zero and has a fresh loss scaler), and the optimizer object
    handed out at start kept (:func:`keep_returned_optimizer`)."""
    counters = (engine.global_steps, engine.global_samples, engine.skipped_steps)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    scaler_state = None if scaler is None else dict(vars(scaler))
    yield
    keep_returned_optimizer(engine)
    engine.global_steps, engine.global_samples, engine.skipped_steps = counters
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    if scaler_state is not None:
        engine.optimizer.loss_scaler.__dict__.update(scaler_state)


def keep_returned_optimizer(engine) -> None:
    """After a rebuild: the optimizer object handed out at start shares the rebuilt one's state
    (the caller's reference stays valid)."""
    returned = engine._dt.returned_optimizer
    if returned is not None and returned is not engine.optimizer:
        returned.__dict__ = engine.optimizer.__dict__
        engine.optimizer = returned


def store_address(dt: ElasticState) -> Tuple[str, int]:
    """``(host, port)`` of the job's store: the launcher's, or torch.distributed's default one."""
    if dt.membership is not None:
        return dt.membership.ctx.store_host, dt.membership.ctx.store_port
    st = tdist.distributed_c10d._get_default_store()
    while isinstance(st, tdist.PrefixStore):
        st = st.underlying_store
    return st.host, st.port


def own_layout(dt: ElasticState, model, groups, world_size: int) -> ZeroLayout:
    """The layout this process's model (parameter ``groups`` as the optimizer holds them) has at
    ``world_size`` (what a joiner checks rank 0's layout against)."""
    dtype = working_dtype(dt.ds_config, model)
    return layout_for_model(list(model.named_parameters()), groups, world_size, dt.ds_config, dtype)
