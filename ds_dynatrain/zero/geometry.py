"""ZeRO geometry of a live DeepSpeed engine: its optimizer, its partitions and the layout they form.

DeepSpeed internals read here: ``DeepSpeedZeroOptimizer`` (``bit16_groups``,
``single_partition_of_fp32_groups``, ``real_dp_process_group``; deepspeed/runtime/zero/
stage_1_and_2.py), ``DeepSpeedZeroOptimizer_Stage3`` (``fp16_groups``, sub-groups,
``ds_tensor``; stage3.py) and the ``_hp_mapping`` fragments of deepspeed/utils/tensor_fragment.py.
:func:`layout_of` proves nothing by itself: tests compare it, and :func:`engine_fragments`, with
what the engine really holds.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..errors import DynatrainError, LayoutMismatchError
from ..vps.layout import Fragment, ZeroLayout, param_metas_from_groups


def zero_optimizer_of(engine):
    """The engine's ZeRO optimizer wrapper (stage 1/2 ``DeepSpeedZeroOptimizer`` or stage 3
    ``DeepSpeedZeroOptimizer_Stage3``).

    Raises:
        DynatrainError: the engine does not run ZeRO stage 1, 2 or 3.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if not isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        raise DynatrainError(
            f"online resizing needs ZeRO stage 1, 2 or 3; the engine runs "
            f"{type(opt).__name__} at ZeRO stage {engine.zero_optimization_stage()}"
        )
    return opt


def is_zero3(opt) -> bool:
    """Whether ``opt`` (from :func:`zero_optimizer_of`) is the stage-3 optimizer."""
    return hasattr(opt, "fp32_partitioned_groups_flat")


def fp32_partitions(opt) -> List[torch.Tensor]:
    """This rank's fp32 master partitions, one 1-D tensor per partition (the optimizer's
    parameters): per parameter group at stages 1/2, per sub-group at stage 3."""
    return list(opt.fp32_partitioned_groups_flat if is_zero3(opt) else opt.single_partition_of_fp32_groups)


def working_partitions(opt) -> List[List[torch.nn.Parameter]]:
    """Per partition (see :func:`fp32_partitions`), the model parameters it holds, in its order."""
    return [list(g) for g in (opt.fp16_groups if is_zero3(opt) else opt.bit16_groups)]


def trainable_groups(opt) -> List[List[torch.nn.Parameter]]:
    """Per optimizer parameter group, its trainable parameters in group order."""
    if not is_zero3(opt):
        return [list(g) for g in opt.bit16_groups]
    out: Dict[int, list] = {}
    for i, sub in enumerate(opt.fp16_groups):
        out.setdefault(opt.sub_group_to_group_id[i], []).extend(sub)
    return [out[g] for g in sorted(out)]


def layout_of(engine) -> ZeroLayout:
    """The :class:`ZeroLayout` of a live ZeRO-1/2/3 engine, from its groups and config.

    Raises:
        LayoutMismatchError: (stage 3) DeepSpeed's sub-groups differ from the computed ones.
    """
    opt = zero_optimizer_of(engine)
    zcfg = engine._config.zero_config
    named = list(engine.module.named_parameters())
    if not is_zero3(opt):
        groups = param_metas_from_groups(named, opt.bit16_groups)
        return ZeroLayout(
            world_size=engine.dp_world_size,
            groups=groups,
            round_robin=bool(zcfg.round_robin_gradients),
            parameter_alignment=bool(zcfg.parameter_alignment),
            stage=engine.zero_optimization_stage(),
        )
    groups = param_metas_from_groups(named, trainable_groups(opt))
    layout = ZeroLayout(world_size=engine.dp_world_size, groups=groups, stage=3, sub_group_size=int(opt.sub_group_size))
    names = {id(p): n for n, p in named}
    real = [tuple(names[id(p)] for p in sub) for sub in opt.fp16_groups]
    computed = [layout.partition_keys(b) for b in range(layout.num_partitions)]
    if real != computed or [layout.partition_numel(b) for b in range(layout.num_partitions)] != [
        int(n) for n in opt.fp16_partitioned_groups_flat_numel
    ]:
        raise LayoutMismatchError(f"DeepSpeed's ZeRO-3 sub-groups {real} differ from the computed {computed}")
    return layout


def working_dtype(ds_config: dict, model: torch.nn.Module) -> torch.dtype:
    """The dtype DeepSpeed's engine trains ``model``'s parameters in: bf16 or fp16 where the config
    enables it, else the model's own."""
    if ds_config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return next(model.parameters()).dtype


def zero12_settings(ds_config: dict) -> dict:
    """The ZeRO-1/2 partitioning settings of a DeepSpeed config, as layouts take them
    (``round_robin``, ``parameter_alignment``)."""
    z = ds_config.get("zero_optimization", {})
    return {
        "round_robin": bool(z.get("round_robin_gradients", False)),
        "parameter_alignment": bool(z.get("parameter_alignment", False)),
    }


def layout_for_model(named_params, groups, world_size: int, ds_config: dict, dtype: torch.dtype) -> ZeroLayout:
    """The layout DeepSpeed will build for ``groups`` of a model not yet wrapped by an engine.

    ``dtype`` is the working dtype the engine will cast parameters to (bf16/fp16/fp32).
    """
    metas = param_metas_from_groups(named_params, groups)
    dname = str(dtype).replace("torch.", "")
    metas = tuple(tuple(type(m)(m.key, m.shape, dname) for m in g) for g in metas)
    z = ds_config.get("zero_optimization", {})
    stage = int(z.get("stage", 0))
    if stage == 3:
        return ZeroLayout(world_size, metas, stage=3, sub_group_size=int(z.get("sub_group_size", 10**9)))
    return ZeroLayout(world_size, metas, stage=stage, **zero12_settings(ds_config))


def engine_fragments(engine) -> Tuple[Fragment, ...]:
    """The fragments this rank really holds, read from each parameter's ``_hp_mapping``.

    This is DeepSpeed's own account of the layout; tests compare it with
    :meth:`ZeroLayout.fragments`.
    """
    opt = zero_optimizer_of(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for gi, params in enumerate(opt.bit16_groups):
        for p in params:
            m = getattr(p, "_hp_mapping", None)
            if m is None:
                continue
            out.append(
                Fragment(
                    gi,
                    names[id(p)],
                    m.lp_fragment_address.start,
                    m.lp_fragment_address.numel,
                    m.hp_fragment_address.start,
                )
            )
    return tuple(sorted(out, key=lambda f: (f.group, f.local)))


def engine_storage_fragments(engine) -> Tuple[Fragment, ...]:
    """The fragments this rank holds, read from where each parameter's data really sits in the
    flat low-precision buffer of its group (``bit16_groups_flat``), cut at this rank's partition.

    This is the ground truth the fp32 partition is copied from. It agrees with ``_hp_mapping``
    except under ``round_robin_gradients``, where DeepSpeed 0.19.8 links ``_hp_mapping`` in the
    original parameter order although the flat buffer is in round-robin order.
    """
    opt = zero_optimizer_of(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    if is_zero3(opt):
        # each parameter's piece (ds_tensor) sits in its sub-group's flat partition; rank r's
        # piece starts at r * piece of the parameter (partition_parameters.py ``_partition_param``)
        from deepspeed import comm as dist

        for b, flat in enumerate(opt.fp16_partitioned_groups_flat):
            rank = dist.get_rank(group=opt.sub_group_process_groups[b])
            for p in opt.fp16_groups[b]:
                piece = p.partition_numel()
                lo, hi = rank * piece, min((rank + 1) * piece, p.ds_numel)
                if lo < hi:
                    local = (p.ds_tensor.data_ptr() - flat.data_ptr()) // p.ds_tensor.element_size()
                    out.append(Fragment(b, names[id(p)], lo, hi - lo, local))
        return tuple(sorted(out, key=lambda f: (f.group, f.local)))
    for gi, flat in enumerate(opt.bit16_groups_flat):
        size = opt.single_partition_of_fp32_groups[gi].numel()
        lo_p = _dp_rank(opt, gi) * size
        for p in opt.bit16_groups[gi]:
            off = (p.data.data_ptr() - flat.data_ptr()) // p.element_size()
            lo, hi = max(off, lo_p), min(off + p.numel(), lo_p + size)
            if lo < hi:
                out.append(Fragment(gi, names[id(p)], lo - off, hi - lo, lo - lo_p))
    return tuple(sorted(out, key=lambda f: (f.group, f.local)))


def _dp_rank(opt, group: int) -> int:
    from deepspeed import comm as dist

    return dist.get_rank(group=opt.real_dp_process_group[group])
