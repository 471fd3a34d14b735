"""A change of an AutoTP job's TP and DP degree at an unchanged world size, in memory, at a step
boundary on every rank (``engine.resize(world_size, tensor_parallel=N)``).

1. **plan**: the new :class:`~ds_dynatrain.vps.tensor_parallel.TensorParallelLayout` (AutoTP's
   split at the new degree, from the model's class and config on the meta device) and the box
   plan between the two layouts; the processes keep their ranks (the world does not change);
2. **transfer**: every rank's fp32 master and Adam moments move by the plan into new partitions
   (:func:`~ds_dynatrain.transition.boxes.execute_box_plan`, point-to-point on the world group);
3. **rebuild**: DeepSpeed's TP/DP groups are made for the new degree, the model is rebuilt on the
   meta device, cut by AutoTP and its local shards allocated (:mod:`~ds_dynatrain.zero.tp_module`),
   and ``DeepSpeedEngine.__init__`` runs again on the same engine object with the new model and
   the batch split over the new DP size;
4. **install**: the moved partitions become the optimizer's master and moments, and every rank's
   working parameters are made from the master (an all-gather over the new DP group).

The engine object stays the same; ``engine.module`` is a new model (a reference to the old one
that the caller kept does not train any more).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as tdist

from ..config import tensor_parallel_grain
from ..errors import LayoutMismatchError, ResizeRefusedError
from ..planner.tp_plan import plan_tp_transition
from ..vps.tensor_parallel import TensorParallelLayout
from ..zero.autotp import autotp_splits
from ..zero.geometry import is_zero3, zero_optimizer_of
from ..zero.rebuild import teardown
from ..zero.tp_module import reset_tp_groups, tp_module
from ..zero.zero3 import forget_zero3_module
from .box_state import switch_in_place
from .construct import close_snapshots, construct, counters_kept, ds_config_for, own_layout
from .records import ResizeRecord
from .switch_memory import prepare_switch


def tp_layout_for_model(model: torch.nn.Module, groups, tp: int, world_size: int, dt) -> TensorParallelLayout:
    """The AutoTP + ZeRO layout DeepSpeed will build for ``model`` (not yet cut) at degree ``tp``
    over ``world_size`` ranks, with the job's ZeRO settings and working dtype.

    Raises:
        LayoutMismatchError: AutoTP's cut of the model is not one these layouts describe.
    """
    zl = own_layout(dt, model, groups, world_size // tp)  # full shapes, the job's ZeRO settings and dtype
    splits = autotp_splits(model, tp, tensor_parallel_grain(dt.ds_config))
    return TensorParallelLayout(
        tp,
        world_size // tp,
        zl.groups,
        tuple(sorted(splits.items())),
        zl.stage,
        zl.round_robin,
        zl.parameter_alignment,
        zl.sub_group_size,
    )


def skeleton_splits(module: torch.nn.Module, tp: int, grain: int = 1):
    """AutoTP's split at ``tp`` of a fresh, uncut instance of ``module``'s class (meta device)."""
    with torch.device("meta"):
        fresh = type(module)(module.config)
    return autotp_splits(fresh, tp, grain)


def switch_tensor_parallel(engine, tp: int) -> ResizeRecord:
    """Switch ``engine``'s AutoTP degree to ``tp`` (DP becomes world size / ``tp``) now.

    Collective: every rank calls it at the same step boundary.

    Raises:
        ResizeRefusedError: ``tp`` does not divide the world size, the new DP size cannot keep
            the global batch, or AutoTP cannot cut the model at ``tp``; nothing has changed.
        TransitionAbortedError: a peer failed during the transfer.
    """
    dt = engine._dt
    t0 = time.perf_counter()
    world = tdist.get_world_size()
    if tp < 1:
        raise ResizeRefusedError(f"TP degree {tp} refused: it must be >= 1")
    if world % tp:
        raise ResizeRefusedError(f"TP degree {tp} refused: it does not divide the world size {world}")
    split = dt.split(world // tp, "DP size")  # ResizeRefusedError: the global batch cannot be kept
    old: TensorParallelLayout = dt.tp_layout
    new = new_layout(engine, tp, world)
    plan = plan_tp_transition(old, new, dt.members, dt.members)
    rec = tp_record(engine, world, world, dt.generation, old.tp, tp, t0)

    def rebuild():
        rebuild_at(engine, tp, split)
        dt.tp_layout = new

    return switch_in_place(engine, plan, rec, t0, rebuild)


def prepare_tensor_switch(engine, tp: int) -> int:
    """Start touching, in the background, the memory a switch of ``engine`` to TP ``tp`` at its
    world size will need on this process, held until the switch
    (:func:`~ds_dynatrain.engine.switch_memory.prepare_switch`). Returns the bytes the thread
    will touch. Not collective.

    Raises:
        ResizeRefusedError: as :func:`switch_tensor_parallel` (``tp`` does not divide the world
            size, the new DP size cannot keep the global batch, AutoTP cannot cut the model at
            ``tp``); nothing has changed.
    """
    dt = engine._dt
    world = len(dt.members)
    if tp < 1 or world % tp:
        raise ResizeRefusedError(f"TP degree {tp} refused: it must be >= 1 and divide the world size {world}")
    dt.split(world // tp, "DP size")  # ResizeRefusedError: the global batch cannot be kept
    return prepare_switch(engine, ("tp", world, tp), lambda: new_layout(engine, tp, world))


def tp_degree_for(dt, world_size: int, tensor_parallel: Optional[int]) -> int:
    """The TP degree of a resize to ``world_size``: ``tensor_parallel`` where given, else the job's
    degree where it divides ``world_size``, else the largest smaller degree that does."""
    if tensor_parallel is not None:
        return tensor_parallel
    if world_size < 1:
        return dt.tp
    return max(t for t in range(1, dt.tp + 1) if world_size % t == 0)


def tp_record(engine, from_world: int, to_world: int, generation: int, tp_from: int, tp_to: int, t0: float):
    """The resize record of an AutoTP job's layout change decided at ``t0`` (``time.perf_counter()``;
    planning counted until now): numbers of processes and TP degrees before and after."""
    return ResizeRecord(
        step=engine.global_steps,
        from_world_size=from_world,
        to_world_size=to_world,
        generation=generation,
        plan_s=time.perf_counter() - t0,
        tensor_parallel_from=tp_from,
        tensor_parallel_to=tp_to,
    )


def new_layout(engine, tp: int, world_size: int) -> TensorParallelLayout:
    """The job's layout at TP degree ``tp`` over ``world_size`` processes.

    Raises:
        ResizeRefusedError: AutoTP cannot cut the model at ``tp``, or a frozen parameter (one
            the optimizer does not hold, so no plan moves it) is cut by AutoTP at the current
            or the new degree.
    """
    try:
        splits = skeleton_splits(engine.module, tp, tensor_parallel_grain(engine._dt.ds_config))
    except (ValueError, AssertionError) as err:
        raise ResizeRefusedError(f"TP degree {tp} refused: AutoTP cannot cut the model at it: {err}") from None
    old = engine._dt.tp_layout
    cut = [
        n
        for n, p in engine.module.named_parameters()
        if not p.requires_grad and (old.split(n).dim is not None or n in splits)
    ]
    if cut:
        raise ResizeRefusedError(
            f"layout TP {tp} x DP {world_size // tp} refused: frozen parameters cut by AutoTP "
            f"cannot move to other processes (only the optimizer's state does): {', '.join(cut[:4])}"
        )
    return old.with_degrees(tp, world_size // tp, splits)


def check_layout(engine) -> None:
    """Raise :class:`LayoutMismatchError` when the job's TP layout is not what DeepSpeed built on
    this rank: a parameter's split (its ``ds_autotp_uc_meta``) or a flat partition's size differs.
    Checked when the job starts, so a model AutoTP cuts in a way these layouts do not describe
    stops there, not at a switch."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    from ..zero.geometry import fp32_partitions

    layout = engine._dt.tp_layout
    for name, p in engine.module.named_parameters():
        meta = getattr(p, DS_AUTOTP_UC_META, None)
        theirs = None if not meta else (meta["partition_dim"], tuple(meta["partition_sizes"]))
        s = layout.split(name)
        ours = None if s.dim is None else (s.dim, s.sizes)
        if theirs != ours:
            raise LayoutMismatchError(f"AutoTP cut {name} as {theirs}, the job's TP layout says {ours}")
    rank = tdist.get_rank()
    zl = layout.zero(rank % layout.tp)
    sizes = [int(t.numel()) for t in fp32_partitions(zero_optimizer_of(engine))]
    expected = [zl.partition_numel(b) for b in range(zl.num_partitions)]
    if sizes != expected:
        raise LayoutMismatchError(f"this rank's fp32 partitions hold {sizes} elements, the TP layout says {expected}")


def rebuild_at(engine, tp: int, split, before_groups=None, same_world: bool = True) -> None:
    """Rebuild ``engine`` in place on a model cut at ``tp``, with the torch optimizer and scheduler
    it had (its groups re-pointed, by name, to the new model's parameters of the job's
    layout); its working parameters are
    neither filled nor broadcast: :func:`install_moved_state` writes them. ``before_groups``: called
    after the old engine is torn down and before DeepSpeed's groups are made for ``tp`` (a shrink
    forms the new world there); ``same_world``: the processes are those DeepSpeed's cached groups
    were made over (False after a shrink or a grow)."""
    dt = engine._dt
    basic, scheduler, old_module = engine.optimizer.optimizer, engine.lr_scheduler, engine.module
    zero3 = is_zero3(zero_optimizer_of(engine))
    with counters_kept(engine):
        close_snapshots(engine)  # a snapshot still being written finishes with the old engine's state
        teardown(engine)  # the torch optimizer holds the old model's parameters again
        if zero3:  # the old model goes; DeepSpeed's process-wide ZeRO-3 state must not carry it on
            forget_zero3_module(old_module)
        dt.ds_config.setdefault("tensor_parallel", {})["autotp_size"] = tp  # 1: uncut, still switchable
        if before_groups is not None:
            before_groups()
        reset_tp_groups(tp, same_world=same_world)
        model = tp_module(old_module, tp, dt.ds_config)
        params = dict(model.named_parameters())
        # the optimizer's groups by the job's layout, not by DeepSpeed's: its groups leave out the
        # empty shards (a TP degree above the KV heads), which the new degree may fill
        for g, metas in zip(basic.param_groups, dt.tp_layout.groups):
            g["params"] = [params[m.key] for m in metas]
        dt.rebuild_broadcast = "none"  # the working parameters are made from the installed master
        cfg = ds_config_for(dt, split, client_objects=True)
        construct(engine, dt, model, basic, None, scheduler, cfg, light=True, values_follow=True)
