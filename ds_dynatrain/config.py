"""The ``"dynatrain"`` section of a DeepSpeed JSON config, and the checks of the DeepSpeed config
around it that an elastic job needs (batch keys, world sizes of the schedule, ZeRO stage).

Declared once, as pydantic models (as DeepSpeed declares its own sections); unknown keys and wrong
types are refused with a :class:`~ds_dynatrain.errors.ConfigError` naming the key, before any
process group or engine exists. Example::

    "dynatrain": {
        "resize_schedule": [{"step": 20, "world_size": 3}, {"step": 40, "world_size": 1}],
        "max_world_size": 4,
        "snapshot": {"interval_steps": 25, "dir": "runs/snapshots", "keep_last": 2},
        "metrics_path": "runs/metrics.jsonl"
    }
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, List, Literal, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from io_engine.errors import StorageError
from io_engine.storage_check import DirCheck, check_snapshot_dir

from .batch import split_global_batch
from .errors import ConfigError, ResizeRefusedError

SECTION = "dynatrain"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ResizeEvent(_Strict):
    """Change the data-parallel world size after optimizer step ``step`` (an AutoTP job: its TP
    degree; a PipelineModule job: its PP degree)."""

    step: int = Field(ge=1, description="global step (optimizer steps) after which the resize happens")
    world_size: int = Field(
        ge=1, description="data-parallel world size from then on (AutoTP job: TP x DP; PipelineModule job: PP x DP)"
    )
    tensor_parallel: Optional[int] = Field(
        None, ge=1, description="an AutoTP job's TP degree from then on, at an unchanged world size"
    )
    pipeline_parallel: Optional[int] = Field(
        None, ge=1, description="a PipelineModule job's PP degree from then on, at an unchanged world size"
    )

    @model_validator(mode="after")
    def _one_degree(self):
        if self.tensor_parallel is not None and self.pipeline_parallel is not None:
            raise ValueError(f"resize_schedule step {self.step}: tensor_parallel and pipeline_parallel both given")
        return self


class SnapshotConfig(_Strict):
    """Resilience snapshots taken during training."""

    interval_steps: int = Field(0, ge=0, description="save every this many optimizer steps; 0 = never")
    dir: Optional[str] = Field(None, description="directory of the snapshots (one sub-directory per tag)")
    keep_last: int = Field(2, ge=1, description="complete snapshots kept; older ones are pruned after a commit")
    asynchronous: bool = Field(
        True,
        description="capture beside forward/backward and flush in the background; False writes inside save_checkpoint",
    )
    host_cache_mib: int = Field(256, ge=8, description="bounded host cache the snapshot is copied through, MiB")
    write_from_memory: bool = Field(
        True,
        description="write a tensor of 4 KiB or more whose address is aligned as the file system asks of O_DIRECT "
        "buffers (512 bytes on common disks) straight from that memory, without a copy through the host cache; "
        "the next optimizer step then waits for those writes, not for a copy. False: copy every tensor (where "
        "storage is slower than the copy and the state fits in the host cache)",
    )
    module_from_master: bool = Field(
        True,
        description="ZeRO-1/2 data-parallel jobs: leave the working parameters out of the model-state file, since "
        "every optimizer step makes them the cast of the fp32 master partitions the optimizer files hold, and "
        "rebuild them from those partitions when the file is read (an fp32 job's snapshot is a quarter smaller, "
        "a bf16 or fp16 job's a seventh). False: write them, so the model-state file alone holds the module",
    )
    worker_nice: int = Field(
        5,
        ge=0,
        le=19,
        description="added to the nice value of the thread that copies, checksums and flushes a "
        "snapshot (Linux: that thread alone), so training keeps the CPUs it needs; 0 = as training",
    )
    restore_on_failure: bool = Field(
        True,
        description="when a worker dies (a process killed without notice), "
        "the launcher restarts the job on the largest world size the live workers "
        "can serve, from the latest complete snapshot",
    )
    on_write_error: Literal["warn", "raise"] = Field(
        "warn",
        description="what a snapshot that could not be written (on any rank: ENOSPC, EIO, a "
        "directory gone read-only) does to training. 'warn' (the default, because a resilience "
        "snapshot must not end the training it protects): training goes on, every rank logs a "
        "warning naming the tag, the failed ranks and the cause, the metrics file records the "
        "snapshot as failed, 'latest' keeps naming the previous complete snapshot, and the next "
        "snapshot tries again. 'raise': SnapshotWriteError on every rank at the next save (the "
        "record says failed too)",
    )

    @model_validator(mode="after")
    def _dir_needed(self):
        if self.interval_steps and not self.dir:
            raise ValueError("snapshot.dir is required when snapshot.interval_steps > 0")
        return self


class RecoveryConfig(_Strict):
    """In-place recovery from a worker killed without notice: peer replicas in host memory."""

    peer_replicas: Literal[0, 1] = Field(
        0,
        description="copies of each rank's partition state (fp32 master, optimizer moments, step scalars) kept in "
        "another rank's host memory, on another host when the job spans hosts; 1 turns in-place recovery on, 0 "
        "leaves a worker's death to snapshot.restore_on_failure",
    )
    interval_steps: int = Field(
        1, ge=1, description="refresh the replicas every this many optimizer steps (at most this many steps are lost)"
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="how long the survivors wait for each phase of a recovery (the dead worker's report, the "
        "others' offers, the new group), seconds; past it the job falls back to the restart from the snapshot",
    )


class DynatrainConfig(_Strict):
    """The whole ``"dynatrain"`` section. Every field has a default; an empty section is valid."""

    enabled: bool = Field(True, description="False makes ds_dynatrain.initialize a plain deepspeed.initialize")
    resize_schedule: List[ResizeEvent] = Field(
        default_factory=list, description="resizes at fixed steps, in increasing step order"
    )
    max_world_size: Optional[int] = Field(None, ge=1, description="largest data-parallel world size allowed")
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    metrics_path: Optional[str] = Field(None, description="JSON-lines file of step and resize records (rank 0)")
    log_interval_steps: int = Field(
        1, ge=1, description="print one step line every this many steps (step time and throughput averaged over them)"
    )
    collective_timeout_s: float = Field(300.0, gt=0, description="timeout of every wait of a transition, seconds")
    dist_backend: Optional[Literal["gloo", "nccl"]] = Field(
        None,
        description="torch.distributed backend of the job's process groups; none: the accelerator's "
        "(nccl on CUDA, gloo on a CPU). 'gloo' on CUDA lets several workers share one device (NCCL "
        "refuses two ranks on one GPU); gloo stages device tensors through pinned host memory",
    )
    join_timeout_s: float = Field(
        600.0, gt=0, description="how long a spawned joiner waits for its generation, seconds"
    )
    max_inflight_bytes: int = Field(
        256 << 20,
        ge=1024,
        description="bound of the bytes a process has in flight "
        "during a resize (messages sent and received plus packing buffers)",
    )
    transfer_overlap: Literal["none", "rebuild", "step"] = Field(
        "rebuild",
        description="what the optimizer-moment transfer of a resize overlaps: 'none' (it completes "
        "before the engine is rebuilt), 'rebuild' (it runs while the DeepSpeed engine is rebuilt and completes "
        "before the resize returns), 'step' (it completes only before the first optimizer step on the new world)",
    )
    leaver_nice: int = Field(
        19,
        ge=0,
        le=19,
        description="a process that leaves the job at a resize raises its "
        "nice value by this much (0: unchanged), so its teardown yields the CPU to the survivors",
    )
    joiner_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="a joiner starts this much above the agent's nice value (0: unchanged), so its start-up "
        "and warm-up yield the CPU to the running workers of its host, and returns to the agent's value when "
        "its generation forms; only where the agent may lower a nice value again (CAP_SYS_NICE or RLIMIT_NICE), "
        "else joiners start unchanged. On a host whose CPUs the workers keep busy a lower joiner may take "
        "much longer to be ready",
    )
    spawn_lookahead_steps: int = Field(
        3,
        ge=0,
        description="start joiners of a scheduled grow this many steps early, so their start-up overlaps training",
    )
    warm_switch_steps: int = Field(
        2,
        ge=0,
        description="this many steps before a scheduled TP or PP switch at the job's world size, or a "
        "scheduled change of a DP job's world size (and while a requested one is prepared behind training, "
        "and at `engine.prepare_resize`), a background thread touches the memory the new layout will need "
        "on top of what each process holds (new partitions; for a TP or PP switch also larger working "
        "parameters and gradient buffers) and holds it until the switch, which frees it just before the new "
        "partitions and engine are allocated: "
        "on a VM whose host takes back free pages they then come back with a fault in the guest only, not "
        "on the host. A joiner of a DP job holds its engine's partitions and flat parameter copy the same way "
        "until the switch. CPU training only (on an accelerator nothing is held); 0: never. A `dynatrain "
        "resize` request for another TP or PP degree at the job's world size is switched this many steps "
        "after it is read (0: at once)",
    )
    standby: bool = Field(
        False,
        description="processes that leave at a shrink (not a preemption) stay as "
        "standby members instead of exiting: a later grow takes them back before it starts "
        "new processes, and reuses the process groups they were part of (4 -> 2 -> 4 forms "
        "no new group). They exit when the job ends. Off by default: a shrink usually hands "
        "the device to another job",
    )
    background_groups: bool = Field(
        True,
        description="a `dynatrain resize` request builds the next "
        "generation's process groups (and starts its joiners) in the background while "
        "training goes on, and switches at the first step boundary where they are "
        "ready; false: the resize blocks training at the step it is served",
    )

    pipeline_partition_method: str = Field(
        "parameters",
        description="a PipelineModule job: the partition_method its PipelineModule was built "
        "with (parameters, uniform, type:<regex>; DeepSpeed keeps no record of it), used to split "
        "the layers at another PP degree; checked against the module's stage bounds at start",
    )

    @model_validator(mode="after")
    def _schedule_ordered(self):
        steps = [e.step for e in self.resize_schedule]
        for a, b in zip(steps, steps[1:]):
            if b <= a:
                raise ValueError(f"resize_schedule steps must increase strictly; got {a} then {b}")
        return self


def check_snapshot_storage(dt_cfg: DynatrainConfig) -> Optional[DirCheck]:
    """Check ``dynatrain.snapshot.dir`` (when it is set and the plugin enabled) before anything
    trains: it exists or is created, is a directory, a file can be created, written and removed
    there, and the write path (O_DIRECT or buffered) is decided
    (:func:`io_engine.storage_check.check_snapshot_dir`).

    Returns:
        What was found, or None when there is no snapshot directory to check.

    Raises:
        ConfigError: one line naming the directory and the reason
            (``dynatrain.snapshot.dir: /data/snaps: is not writable: ... (EROFS)``).
    """
    where = dt_cfg.snapshot.dir
    if not (dt_cfg.enabled and where):
        return None
    try:
        return check_snapshot_dir(where)
    except StorageError as err:
        raise ConfigError(f"{SECTION}.snapshot.dir: {err}") from None


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in (SECTION, *e["loc"]))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        parts.append(f"{loc}: {msg}")
    return "invalid DeepSpeed config: " + "; ".join(parts)


def parse_section(section: Any) -> DynatrainConfig:
    """Validate a ``"dynatrain"`` section (a dict from JSON).

    Raises:
        ConfigError: naming each offending key (``dynatrain.snapshot.intervall: unknown key``).
    """
    if section is None:
        return DynatrainConfig()
    if not isinstance(section, dict):
        raise ConfigError(f"invalid DeepSpeed config: '{SECTION}' must be an object, got {type(section).__name__}")
    try:
        return DynatrainConfig.model_validate(section)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_ds_config(config: Any) -> Tuple[dict, DynatrainConfig]:
    """Split a DeepSpeed config (dict or path to JSON) into DeepSpeed's part and ours.

    Returns:
        ``(deepspeed_config, dynatrain_config)``: a deep copy of the DeepSpeed config without the
        ``"dynatrain"`` section (DeepSpeed never sees it), and the validated section.

    Raises:
        ConfigError: unreadable file, not a JSON object, or an invalid ``"dynatrain"`` section.
    """
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read DeepSpeed config {os.fspath(config)!r}: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"DeepSpeed config must be a JSON object, got {type(config).__name__}")
    ds_config = copy.deepcopy(config)
    section = ds_config.pop(SECTION, None)
    return ds_config, parse_section(section)


def resolve_global_batch(ds_config: dict, world_size: int) -> Tuple[int, int]:
    """``(global batch, largest micro-batch)`` in samples from DeepSpeed's batch keys at ``world_size``.

    Follows DeepSpeed's rule ``train_batch_size = micro * accumulation * world_size``. With both
    batch sizes given, ``gradient_accumulation_steps`` may be ``"auto"`` (Hugging Face Trainer fills
    it in for the world each process trains in).

    Raises:
        ConfigError: no batch key, or keys that contradict each other.
    """
    tb = ds_config.get("train_batch_size")
    mb = ds_config.get("train_micro_batch_size_per_gpu")
    ga = ds_config.get("gradient_accumulation_steps")
    if ga == "auto" and tb and mb:
        ga = None
    for name, v in (
        ("train_batch_size", tb),
        ("train_micro_batch_size_per_gpu", mb),
        ("gradient_accumulation_steps", ga),
    ):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(f"invalid DeepSpeed config: {name} must be a positive integer, got {v!r}")
    if tb and mb:
        if ga and tb != mb * ga * world_size:
            raise ConfigError(
                f"invalid DeepSpeed config: train_batch_size {tb} != micro batch {mb} * "
                f"gradient_accumulation_steps {ga} * world size {world_size}"
            )
        return tb, mb
    if tb and ga:
        if tb % (ga * world_size):
            raise ConfigError(
                f"invalid DeepSpeed config: train_batch_size {tb} not divisible by "
                f"gradient_accumulation_steps {ga} * world size {world_size}"
            )
        return tb, tb // (ga * world_size)
    if mb:
        return mb * (ga or 1) * world_size, mb
    if tb:
        if tb % world_size:
            raise ConfigError(
                f"invalid DeepSpeed config: train_batch_size {tb} not divisible by world size {world_size}"
            )
        return tb, tb // world_size
    raise ConfigError("invalid DeepSpeed config: set train_batch_size and train_micro_batch_size_per_gpu")


def tensor_parallel_degree(ds_config: dict) -> int:
    """The AutoTP degree of a DeepSpeed config (``tensor_parallel.autotp_size``; 1 when off)."""
    return max(int(((ds_config.get("tensor_parallel") or {}).get("autotp_size") or 0)), 1)


def tensor_parallel_grain(ds_config: dict) -> int:
    """AutoTP's ``tensor_parallel.tp.tp_grain_size`` of a DeepSpeed config (1 when not given)."""
    return int((((ds_config.get("tensor_parallel") or {}).get("tp") or {}).get("tp_grain_size")) or 1)


def is_tensor_parallel_job(ds_config: dict) -> bool:
    """An AutoTP job: ``tensor_parallel.autotp_size`` of 1 or more (1: not cut yet, but its TP
    degree may be switched up)."""
    return int(((ds_config.get("tensor_parallel") or {}).get("autotp_size") or 0)) >= 1


def check_tensor_parallel(ds_config: dict, dt_cfg, world_size: int, launched: bool) -> int:
    """Refuse, before any engine exists, an AutoTP job asking for what a TP job cannot have yet;
    return its TP degree (1 without AutoTP).

    An AutoTP job (``tensor_parallel.autotp_size`` of 1 or more) switches its TP and DP degree online
    (``engine.resize(world_size, tensor_parallel=N)``, the schedule), and under ``dynatrain launch``
    shrinks and grows (the schedule, a request, a preemption); its snapshots load at any TP and DP
    degree. Its restart from a snapshot after a dead worker, peer replicas and offloaded state are
    not served yet: each is refused here, naming the key.

    Raises:
        ConfigError: naming the key and the problem.
    """
    tp = tensor_parallel_degree(ds_config)
    for e in dt_cfg.resize_schedule:
        if e.pipeline_parallel is not None:
            raise ConfigError(
                f"invalid DeepSpeed config: dynatrain.resize_schedule (step {e.step}) gives pipeline_parallel, "
                "but the model is no PipelineModule"
            )
    if not is_tensor_parallel_job(ds_config):
        for e in dt_cfg.resize_schedule:
            if e.tensor_parallel is not None:
                raise ConfigError(
                    f"invalid DeepSpeed config: dynatrain.resize_schedule (step {e.step}) gives tensor_parallel, "
                    "but the job is no AutoTP job (tensor_parallel.autotp_size)"
                )
        return 1
    where = f"tensor_parallel.autotp_size {tp}"
    stage = (ds_config.get("zero_optimization", {}) or {}).get("stage", 0)
    problems = []
    if world_size % tp:
        problems.append(f"a world size of {world_size}, which it does not divide")
    if stage not in (1, 2, 3):
        problems.append(f"zero_optimization.stage {stage} (a TP switch needs stage 1, 2 or 3)")
    tp_cfg = ds_config.get("tensor_parallel") or {}
    for key in ("partition_config", "preset_model", "vocab_parallel_lm_head"):
        if tp_cfg.get(key) is not None:
            problems.append(f"tensor_parallel.{key} (only AutoTP's Hugging Face tp_plan route is described)")
    zero = ds_config.get("zero_optimization", {}) or {}
    for key in ("offload_optimizer", "offload_param"):
        if (zero.get(key) or {}).get("device", "none") not in (None, "none"):
            problems.append(f"zero_optimization.{key} (offloaded state is not moved by a TP switch)")
    if dt_cfg.snapshot.interval_steps and dt_cfg.snapshot.restore_on_failure and launched:
        problems.append(
            "dynatrain.snapshot.restore_on_failure (restarting an AutoTP job from its snapshot after a worker "
            "died is not served yet; set it to false: the snapshots are still written, and load at any TP degree)"
        )
    if dt_cfg.recovery.peer_replicas:
        problems.append("dynatrain.recovery.peer_replicas (recovery of TP jobs is not served yet)")
    world, degree = world_size, tp  # the schedule's entries in order: a TP degree dividing the world
    for e in dt_cfg.resize_schedule:
        entry = f"dynatrain.resize_schedule (step {e.step})"
        if e.tensor_parallel is None and e.world_size % degree:  # as at run time: the largest smaller degree
            degree = max(t for t in range(1, degree + 1) if e.world_size % t == 0)
        degree = e.tensor_parallel or degree
        if e.world_size != world and not launched:
            what = "grow" if e.world_size > world else "shrink"
            problems.append(f"{entry}: a {what} to {e.world_size} needs `dynatrain launch` (it hosts the membership)")
        elif e.world_size % degree:
            problems.append(f"{entry}: TP degree {degree} does not divide the world size {e.world_size}")
        world = e.world_size
    if problems:
        raise ConfigError(f"invalid DeepSpeed config: {where} with " + "; ".join(problems))
    return tp


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
        raise ConfigError(
            "invalid DeepSpeed config: an elastic job needs both train_batch_size (kept across "
            "resizes) and train_micro_batch_size_per_gpu (the largest micro-batch)"
        )
    global_batch, micro = resolve_global_batch(ds_config, world_size)
    checks, degree = [(world_size, "the launch world size")], tensor_parallel_degree(ds_config)
    for e in dt_cfg.resize_schedule:  # an AutoTP job's entries split the batch over world / TP degree
        if e.pipeline_parallel is not None:
            continue  # a PipelineModule job's: split over world / PP degree, checked against its layout
        if e.tensor_parallel is None and e.world_size % degree:  # as at run time: the largest smaller degree
            degree = max(t for t in range(1, degree + 1) if e.world_size % t == 0)
        degree = e.tensor_parallel or degree
        if e.world_size % degree == 0:  # else check_tensor_parallel names it
            checks.append((e.world_size // degree, f"dynatrain.resize_schedule (step {e.step})"))
    for ws, where in checks:
        try:
            split_global_batch(global_batch, micro, ws, dt_cfg.max_world_size)
        except ResizeRefusedError as err:
            raise ConfigError(f"invalid DeepSpeed config: {where}: {err}") from None
    if dt_cfg.recovery.peer_replicas:
        stage = (ds_config.get("zero_optimization", {}) or {}).get("stage", 0)
        if stage not in (1, 2, 3):
            raise ConfigError(
                f"invalid DeepSpeed config: dynatrain.recovery.peer_replicas needs zero_optimization.stage 1, 2 or 3 "
                f"(stage {stage}: the replicas are copies of ZeRO partitions)"
            )
    if dt_cfg.resize_schedule:
        zero = ds_config.get("zero_optimization", {}) or {}
        stage = zero.get("stage", 0)
        if stage not in (1, 2, 3):
            raise ConfigError(
                f"invalid DeepSpeed config: dynatrain.resize_schedule needs zero_optimization.stage "
                f"1, 2 or 3 (stage {stage} has no partitions to resize)"
            )
        for key in ("offload_optimizer", "offload_param"):
            dev = (zero.get(key) or {}).get("device", "none")
            if dev not in (None, "none"):
                raise ConfigError(
                    f"invalid DeepSpeed config: dynatrain.resize_schedule with "
                    f"zero_optimization.{key}.device={dev!r}: offloaded state is not moved by a resize"
                )
    return global_batch, micro
