"""Loading a checkpoint onto another data-parallel world size or ZeRO stage (DESIGN.md §2,
"Migration / restore").

Instead of DeepSpeed's route (``ds_to_universal.py``, which reads and rewrites every byte, then
``load_universal``), the saved layout is rebuilt from metadata (:class:`~ds_dynatrain.checkpoint.
saved.SavedCheckpoint`), the planner intersects it with the live engine's layout
(:func:`~ds_dynatrain.planner.plan_transition`, saved ranks as sources), and each rank reads only
the byte ranges of the fragments it will hold: with io_uring (``io_engine`` reader, one batch of
ranges per file) from this project's files, through ``torch.load(mmap=True, weights_only=True)``
(only the touched pages are read) from DeepSpeed's. Nothing is converted on disk and no rank holds
more than its own new partitions. Every rank agrees that its checks and reads succeeded before
anything is installed; the client state comes back whole (every tensor read, whatever its size).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as tdist

from io_engine.errors import IOEngineError

from ..elastic.collective import raise_on_every_rank
from ..errors import CheckpointIncompleteError, DynatrainError, LayoutMismatchError
from ..planner.plan import Transfer, plan_transition, scalars_for
from ..transition.buffers import allocate_partitions
from ..zero.geometry import fp32_partitions, layout_of, zero_optimizer_of
from ..zero.state import install_master, install_optimizer_state, working_from_master
from . import resharded_bands
from .fit import check_frozen, check_model, check_param_groups, check_partition_order
from .module_master import MARKER
from .saved import MOMENTS, SavedCheckpoint, SavedFile, TensorRef, numel_of, partitions_of


@dataclass
class LoadStats:
    """What one rank's load did: ``bytes_read`` (partition bytes), ``seconds``, ``plan_s``,
    ``read_s``, ``install_s`` (wall seconds; install includes ``gather_s``, rebuilding the working
    parameters from the master), the saved and new (data-parallel) world sizes, ZeRO stages and
    TP degrees."""

    bytes_read: int
    seconds: float
    plan_s: float
    read_s: float
    install_s: float
    gather_s: float
    saved_world_size: int
    saved_stage: int
    world_size: int
    stage: int
    saved_tp: int = 1
    tp: int = 1
    saved_pp: int = 1
    pp: int = 1


@dataclass(frozen=True)
class BandLoad:
    """A load through the box planner (the checkpoint or the engine AutoTP's or a pipeline's).

    Attributes:
        live: the engine's band layout (:class:`~ds_dynatrain.vps.tensor_parallel.
            TensorParallelLayout` or :class:`~ds_dynatrain.vps.pipeline.PipelineLayout`).
        saved_layout: ``saved -> layout`` the checkpoint was written in, of the same kind, checked
            against its files (raises ``LayoutMismatchError``).
    """

    live: Any
    saved_layout: Callable[[SavedCheckpoint], Any]


def load_resharded(
    engine,
    load_dir: str,
    tag: Optional[str] = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    saved: Optional["SavedCheckpoint"] = None,
    bands: Optional[BandLoad] = None,
) -> Tuple[str, dict, LoadStats]:
    """Load a ZeRO checkpoint saved at any world size and ZeRO stage into ``engine``.

    ``bands``: a load across TP or PP degrees (:class:`BandLoad`); the reads then come from
    :mod:`~ds_dynatrain.checkpoint.resharded_bands`.

    Collective (the agreement on the reads, the final parameter all-gather at ZeRO-1/2): every
    rank of the engine calls it, right after the engine is built. Each rank reads only its new
    partitions' fragments, the frozen parameters and buffers, and the model-state file's other
    entries whole (the client state: every tensor of any size and dtype, nested in dicts, lists
    and tuples, as saved).

    ``saved``: the checkpoint already opened (and checked) by the caller; it is closed here.

    Returns:
        ``(path of the model-state file, client state of the model-state file, LoadStats)``.

    Raises:
        CheckpointIncompleteError: missing or damaged files (its subclass
            ``CheckpointCorruptError`` for bytes that fail their checksum).
        LayoutMismatchError: the checkpoint holds another model (names the first differing
            parameter).
        Either on every rank, each distinct problem named once, before anything is installed.
    """
    t0 = time.perf_counter()
    if saved is None:
        saved = SavedCheckpoint(load_dir, tag)
    try:
        rank, ws = tdist.get_rank(), engine.dp_world_size
        kinds = ("fp32",) + (MOMENTS if load_optimizer_states else ())
        problem, nbytes, plan_s, read_s = None, 0, 0.0, 0.0
        try:
            if bands is None:
                live = layout_of(engine)
                plan, dests = _plan(engine, saved, live, kinds, load_optimizer_states)
                plan_s = time.perf_counter() - t0
                t = time.perf_counter()
                nbytes, scalars0 = _read_fragments(saved, plan, rank, kinds, dests)
                dests, scalars = [dests[b] for b in sorted(dests)], scalars_for(plan, scalars0)
            else:
                dests, scalars, nbytes, plan_s = _read_boxes(engine, saved, bands, rank, kinds, load_optimizer_states)
                t = t0 + plan_s
            frozen = _read_frozen(engine, saved)
            state = _read_model_state(saved)
            read_s = time.perf_counter() - t
        except (DynatrainError, IOEngineError, OSError) as err:
            problem = err
        # every rank agrees before anything is installed: one rank's damaged file or a model that
        # does not fit fails all, each distinct problem named once
        raise_on_every_rank(problem, CheckpointIncompleteError, f"{saved.dir}: nothing was loaded")
        t = time.perf_counter()
        install_master(engine, [d["fp32"] for d in dests])
        if load_optimizer_states:
            install_optimizer_state(engine, [{k: d[k] for k in MOMENTS} for d in dests], scalars)
        t_gather = time.perf_counter()
        working_from_master(engine)
        gather_s = time.perf_counter() - t_gather
        with torch.no_grad():
            for value, target in frozen:
                target.data.view(-1).copy_(value)
        client = _load_non_tensor_state(engine, saved, state, load_optimizer_states, load_lr_scheduler_states)
        install_s = time.perf_counter() - t
    finally:
        saved.close()
    stats = LoadStats(
        bytes_read=nbytes,
        seconds=time.perf_counter() - t0,
        plan_s=plan_s,
        read_s=read_s,
        install_s=install_s,
        gather_s=gather_s,
        saved_world_size=saved.world_size,
        saved_stage=saved.stage,
        world_size=ws,
        stage=engine.zero_optimization_stage(),
        saved_tp=saved.tp,
        tp=getattr(bands.live, "tp", 1) if bands else 1,
        saved_pp=saved.pp,
        pp=getattr(bands.live, "pp", 1) if bands else 1,
    )
    # as DeepSpeed's load_checkpoint: the path of the model-state file it loaded
    return saved.model_file.path, client, stats


def _plan(engine, saved: SavedCheckpoint, live, kinds, optimizer: bool):
    """Check the checkpoint against the model, rebuild the saved layout, plan the reads and
    allocate this rank's new partitions. Returns ``(plan, dests)``.

    Raises:
        LayoutMismatchError: the checkpoint does not fit the model.
        CheckpointIncompleteError: an optimizer-state file without its partitions.
    """
    check_model(engine, saved, live, frozen_from_module=True)
    check_partition_order(saved, live)
    old = saved.layout_for(live)
    check_param_groups(engine, saved, optimizer)
    rank = tdist.get_rank()
    src_ids = tuple(f"saved{r}" for r in range(saved.world_size))
    dst_ids = tuple(f"rank{r}" for r in range(live.world_size))
    plan = plan_transition(old, live, src_ids, dst_ids, same_settings=False)
    device = fp32_partitions(zero_optimizer_of(engine))[0].device
    return plan, allocate_partitions(plan, dst_ids[rank], kinds, torch.float32, device)


def _read_boxes(engine, saved: SavedCheckpoint, bands: BandLoad, rank: int, kinds, optimizer: bool):
    """Check the checkpoint against the model at the saved TP or PP degree, plan and read this
    rank's boxes. Returns ``(new partitions in order, their scalars, bytes read, seconds planning)``.

    Raises:
        LayoutMismatchError: the checkpoint does not fit the model.
        CheckpointIncompleteError: a damaged file or a partition without a state kind.
    """
    t0 = time.perf_counter()
    live = bands.live
    check_frozen(engine, saved, {p.key for p in live.params}, from_module=True)
    check_param_groups(engine, saved, optimizer)
    old = bands.saved_layout(saved)
    plan = resharded_bands.plan_reads(old, live)
    device = fp32_partitions(zero_optimizer_of(engine))[0].device
    dests = resharded_bands.new_partitions(live, rank, kinds, device)
    plan_s = time.perf_counter() - t0
    nbytes = resharded_bands.read_boxes(saved, plan, rank, kinds, dests)
    return dests, resharded_bands.new_scalars(saved, old, live, rank), nbytes, plan_s


def _read_fragments(saved: SavedCheckpoint, plan, rank: int, kinds, dests) -> Tuple[int, list]:
    """Read this rank's fragments of every saved partition into ``dests``, one batch per saved
    file. Returns ``(bytes read, rank 0's scalars per saved partition)``.

    Raises:
        CheckpointIncompleteError: a damaged or incomplete file (the caller has every rank agree).
    """
    by_src: Dict[int, list] = defaultdict(list)
    for tr in map(Transfer._make, plan.rows_into(plan.new_members[rank]).tolist()):
        by_src[tr.src].append(tr)
    nbytes = 0
    for src in sorted(by_src):
        parts = partitions_of(saved.optim(src).tree, saved.stage)
        requests = []
        for tr in by_src[src]:
            for k in kinds:
                if k not in parts.tensors[tr.group]:
                    raise CheckpointIncompleteError(f"{saved.optim_name(src)}: partition {tr.group} has no {k}")
                dest = dests[tr.dst_group][k].narrow(0, tr.dst_offset, tr.numel)
                requests.append((parts.tensors[tr.group][k], tr.src_offset, dest))
        nbytes += saved.optim(src).read_into(requests)
    return nbytes, partitions_of(saved.optim(0).tree, saved.stage).scalars


def materialize(file: SavedFile, obj: Any, own: bool = True) -> Any:
    """``obj`` (a value of ``file.tree``) with every :class:`TensorRef` in it read, in one batch
    (:meth:`SavedFile.read_into`): tensors of their saved dtype and shape, at any depth of dicts
    (their type and order kept), lists and tuples. ``own``: tensors that share memory with the
    file (DeepSpeed's memory-mapped files) are copied, so the result outlives the file.

    Raises:
        CheckpointIncompleteError: a damaged range (``CheckpointCorruptError`` for bytes that fail
            their checksum).
    """
    refs: List[TensorRef] = []

    def collect(x):
        if isinstance(x, TensorRef):
            refs.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(obj)
    read: Dict[int, torch.Tensor] = {}
    if refs:
        dests = [torch.empty(r.numel(), dtype=r.dtype) for r in refs]
        file.read_into([(r, 0, d) for r, d in zip(refs, dests)])
        read = {id(r): d.reshape(r.shape) for r, d in zip(refs, dests)}

    def rebuild(x):
        if isinstance(x, TensorRef):
            return read[id(x)]
        if isinstance(x, torch.Tensor):
            return x.clone() if own and not file.ours else x
        if isinstance(x, dict):
            out = type(x)() if type(x) is not dict else {}
            for k, v in x.items():
                out[k] = rebuild(v)
            return out
        if isinstance(x, list):
            return [rebuild(v) for v in x]
        if isinstance(x, tuple):
            items = [rebuild(v) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return x

    return rebuild(obj)


def _read_frozen(engine, saved: SavedCheckpoint) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Frozen parameters and persistent buffers are not in the optimizer's partitions; ZeRO-1/2
    model-state files hold them whole (``module``). At ZeRO-3 frozen parameters keep the values
    the model was built with; buffers are loaded where the file has them. Returns ``[(saved
    values, 1-D, the target parameter or buffer)]``, read in one batch, installed by the caller.

    Raises:
        LayoutMismatchError: a frozen parameter of the model is not in the checkpoint.
        CheckpointIncompleteError: a damaged range.
    """
    module_sd = saved.model_state.get("module") or {}
    targets = []
    if saved.stage != 3 and engine.zero_optimization_stage() != 3:
        for name, p in engine.module.named_parameters():
            if not p.requires_grad:
                src = module_sd.get(name)
                if src is None or numel_of(src) != p.numel():
                    raise LayoutMismatchError(
                        f"frozen parameter {name} {list(p.shape)} is not in the checkpoint's module state"
                    )
                targets.append((src, p))
    for name, b in engine.module.named_buffers():
        src = module_sd.get(name)
        if src is not None and numel_of(src) == b.numel() and b.numel() > 0:
            targets.append((src, b))
    values = [torch.empty(t.numel(), dtype=src.dtype) for src, t in targets]
    saved.model_file.read_into([(src, 0, v) for (src, _t), v in zip(targets, values)])
    return [(v, t) for v, (_src, t) in zip(values, targets)]


# the model-state file's keys DeepSpeed (and the snapshot engine) owns; the others are the client state
DEEPSPEED_KEYS = frozenset(
    {
        MARKER,
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
    }
)


def _read_model_state(saved: SavedCheckpoint) -> dict:
    """The model-state dict with every tensor of the LR scheduler's state and of the client state
    read; DeepSpeed's other entries as they are (the module state is read by :func:`_read_frozen`,
    DeepSpeed's copies of frozen fragments are not needed)."""
    ms = saved.model_state
    read = materialize(
        saved.model_file, {k: v for k, v in ms.items() if k not in DEEPSPEED_KEYS or k == "lr_scheduler"}
    )
    return {**ms, **read}


def _load_non_tensor_state(engine, saved: SavedCheckpoint, ms: dict, optimizer: bool, scheduler: bool) -> dict:
    """Step counters, LR scheduler, group hyper-parameters, loss scaler, from ``ms`` (the
    model-state dict, read); returns the client state (the keys DeepSpeed does not own)."""
    engine.global_steps = int(ms.get("global_steps", 0))
    engine.global_samples = int(ms.get("global_samples", engine.global_steps * engine.train_batch_size()))
    engine.skipped_steps = int(ms.get("skipped_steps", 0))
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    if scheduler and engine.lr_scheduler is not None and ms.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(ms["lr_scheduler"])
    osd = saved.optim(0).tree.get("optimizer_state_dict", {})
    base = osd.get("optimizer_state_dict" if saved.stage == 3 else "base_optimizer_state")
    groups = base.get("param_groups") if isinstance(base, dict) else None
    if optimizer and groups:
        # the hyper-parameters of each group as saved (the LR the scheduler set last, betas, ...);
        # their number was checked before anything was installed (fit.check_param_groups)
        for g, h in zip(engine.optimizer.optimizer.param_groups, groups):
            g.update({k: v for k, v in h.items() if k != "params"})
    if optimizer:
        scaler, sent = getattr(engine.optimizer, "loss_scaler", None), osd.get("loss_scaler")
        if scaler is not None and sent is not None and type(scaler).__name__ == type(sent).__name__:
            scaler.__dict__.update(vars(sent))
    return {k: v for k, v in ms.items() if k not in DEEPSPEED_KEYS}
