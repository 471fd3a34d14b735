"""Loading a checkpoint onto another data-parallel world size or ZeRO stage (DESIGN.md §2,
"Migration / restore").

Instead of DeepSpeed's route (``ds_to_universal.py``, which reads and rewrites every byte, then
``load_universal``), the saved layout is rebuilt from metadata (:class:`~ds_dynatrain.checkpoint.
saved.SavedCheckpoint`), the planner intersects it with the live engine's layout
(:func:`~ds_dynatrain.planner.plan_transition`, saved ranks as sources), and each rank reads only
the byte ranges of the fragments it will hold: with io_uring (``io_engine`` reader, one batch of
ranges per file) from this project's files, through ``torch.load(mmap=True, weights_only=True)``
(only the touched pages are read) from DeepSpeed's. Nothing is converted on disk and no rank holds
more than its own new partitions. Every rank agrees that its reads succeeded before anything is
installed.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as tdist

from ..elastic.collective import raise_on_every_rank
from ..errors import CheckpointIncompleteError, LayoutMismatchError
from ..planner.plan import plan_transition, scalars_for
from ..transition.buffers import allocate_partitions
from ..zero.geometry import fp32_partitions, is_zero3, layout_of, zero_optimizer_of
from ..zero.state import install_master, install_optimizer_state
from .saved import MOMENTS, OPTIM_FILE, SavedCheckpoint, numel_of, partitions_of


@dataclass
class LoadStats:
    """What one rank's load did: ``bytes_read`` (partition bytes), ``seconds``, ``plan_s``,
    ``read_s``, ``install_s`` (wall seconds; install includes ``gather_s``, rebuilding the working
    parameters from the master), the saved and new world sizes and ZeRO stages."""

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


def load_resharded(
    engine,
    load_dir: str,
    tag: Optional[str] = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    saved: Optional["SavedCheckpoint"] = None,
) -> Tuple[str, dict, LoadStats]:
    """Load a ZeRO checkpoint saved at any world size and ZeRO stage into ``engine``.

    Collective (the final parameter all-gather at ZeRO-1/2): every rank of the engine calls it,
    right after the engine is built. Each rank reads only its new partitions' fragments.

    ``saved``: the checkpoint already opened (and checked) by the caller; it is closed here.

    Returns:
        ``(path of the model-state file, client state of the model-state file, LoadStats)``.

    Raises:
        CheckpointIncompleteError: missing or damaged files (before anything is loaded).
        LayoutMismatchError: the checkpoint holds another model (names the first differing
            parameter; before anything is loaded).
    """
    t0 = time.perf_counter()
    if saved is None:
        saved = SavedCheckpoint(load_dir, tag)
    try:
        live = layout_of(engine)
        old = saved.layout_for(live)
        rank, ws = tdist.get_rank(), live.world_size
        src_ids = tuple(f"saved{r}" for r in range(saved.world_size))
        dst_ids = tuple(f"rank{r}" for r in range(ws))
        plan = plan_transition(old, live, src_ids, dst_ids, same_settings=False)
        kinds = ("fp32",) + (MOMENTS if load_optimizer_states else ())
        device = fp32_partitions(zero_optimizer_of(engine))[0].device
        dests = allocate_partitions(plan, dst_ids[rank], kinds, torch.float32, device)
        plan_s = time.perf_counter() - t0
        t = time.perf_counter()
        nbytes, scalars0, problem = _read_fragments(saved, plan, rank, kinds, dests)
        # every rank agrees before anything is installed: one rank's damaged file fails all
        raise_on_every_rank(problem, CheckpointIncompleteError, "nothing was loaded")
        read_s = time.perf_counter() - t
        t = time.perf_counter()
        order = sorted(dests)
        install_master(engine, [dests[b]["fp32"] for b in order])
        if load_optimizer_states:
            install_optimizer_state(
                engine, [{k: dests[b][k] for k in MOMENTS} for b in order], scalars_for(plan, scalars0)
            )
        gather_s = _working_from_master(engine)
        _load_frozen(engine, saved)
        client = _load_non_tensor_state(engine, saved, load_optimizer_states, load_lr_scheduler_states)
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
        stage=live.stage,
    )
    # as DeepSpeed's load_checkpoint: the path of the model-state file it loaded
    return saved.model_file.path, client, stats


def _read_fragments(saved: SavedCheckpoint, plan, rank: int, kinds, dests) -> Tuple[int, list, Optional[str]]:
    """Read this rank's fragments of every saved partition into ``dests``, one batch per saved
    file. Returns ``(bytes read, rank 0's scalars per saved partition, problem or None)``: a
    damaged or incomplete file is reported, not raised, so every rank can agree first."""
    by_src: Dict[int, list] = defaultdict(list)
    for tr in plan.transfers:
        if tr.dst == rank:
            by_src[tr.src].append(tr)
    nbytes = 0
    try:
        for src in sorted(by_src):
            parts = partitions_of(saved.optim(src).tree, saved.stage)
            requests = []
            for tr in by_src[src]:
                for k in kinds:
                    if k not in parts.tensors[tr.group]:
                        raise CheckpointIncompleteError(f"{OPTIM_FILE.format(src)}: partition {tr.group} has no {k}")
                    dest = dests[tr.dst_group][k].narrow(0, tr.dst_offset, tr.numel)
                    requests.append((parts.tensors[tr.group][k], tr.src_offset, dest))
            nbytes += saved.optim(src).read_into(requests)
        scalars0 = partitions_of(saved.optim(0).tree, saved.stage).scalars
    except (CheckpointIncompleteError, LayoutMismatchError) as err:
        return nbytes, [], f"{type(err).__name__}: {err}"
    return nbytes, scalars0, None


def _working_from_master(engine) -> float:
    """Rebuild the working parameters from the installed fp32 master (ZeRO-1/2: all-gathered;
    collective). Returns the seconds it took."""
    zopt = zero_optimizer_of(engine)
    t = time.perf_counter()
    with torch.no_grad():
        if is_zero3(zopt):
            for flat, fp32 in zip(zopt.fp16_partitioned_groups_flat, fp32_partitions(zopt)):
                flat.copy_(fp32)
        else:
            zopt.update_lp_params()  # working copy from the master, all-gathered
    return time.perf_counter() - t


def _load_frozen(engine, saved: SavedCheckpoint) -> None:
    """Frozen parameters and persistent buffers are not in the optimizer's partitions; ZeRO-1/2
    model-state files hold them whole (``module``). At ZeRO-3 frozen parameters keep the values
    the model was built with; buffers are loaded where the file has them.

    Raises:
        LayoutMismatchError: a frozen parameter of the model is not in the checkpoint.
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
    for src, t in targets:
        dest = torch.empty(t.numel(), dtype=src.dtype)
        saved.model_file.read_into([(src, 0, dest)])
        with torch.no_grad():
            t.data.view(-1).copy_(dest)


def _load_non_tensor_state(engine, saved: SavedCheckpoint, optimizer: bool, scheduler: bool) -> dict:
    """Step counters, LR scheduler, loss scaler; returns the client state (the model-state
    file's keys DeepSpeed does not own)."""
    ms = saved.model_state
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
        # the hyper-parameters of each group as saved (the LR the scheduler set last, betas, ...)
        live = engine.optimizer.optimizer.param_groups
        if len(groups) != len(live):
            raise LayoutMismatchError(
                f"the checkpoint has {len(groups)} optimizer parameter groups, the model {len(live)}"
            )
        for g, h in zip(live, groups):
            g.update({k: v for k, v in h.items() if k != "params"})
    if optimizer:
        scaler, sent = getattr(engine.optimizer, "loss_scaler", None), osd.get("loss_scaler")
        if scaler is not None and sent is not None and type(scaler).__name__ == type(sent).__name__:
            scaler.__dict__.update(vars(sent))
    own = {
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
    return {k: v for k, v in ms.items() if k not in own}
