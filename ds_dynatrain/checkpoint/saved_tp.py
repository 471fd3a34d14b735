"""An AutoTP checkpoint's TP layout: from its metadata alone, where AutoTP cut each parameter, read
from the affine maps DeepSpeed writes into every model-state file
(``universal_checkpoint_info.affine_map``, ``deepspeed/checkpoint/affine.py``, deepspeed 0.19.8),
checked against every TP rank's ``param_shapes`` (what ``verify``, ``inspect`` and ``export`` use
without a model); for a load, the live model's parameters cut as AutoTP cuts them at the saved
degree (:func:`saved_tp_layout`, read by :mod:`~ds_dynatrain.checkpoint.resharded_bands`)."""

from __future__ import annotations

import math
import re
from typing import Dict, Mapping, Tuple

from ..errors import CheckpointIncompleteError, LayoutMismatchError
from ..vps.layout import ParamMeta
from ..vps.tensor_parallel import TensorParallelLayout, TpSplit, matrix_shape
from .saved import SavedCheckpoint
from .saved_layout import saved_layout


def saved_splits(saved: SavedCheckpoint) -> Dict[str, TpSplit]:
    """``{parameter name: TpSplit}`` of the parameters AutoTP cut in ``saved`` (empty at TP 1),
    from TP rank 0's affine maps: a parameter whose shards all have its logical shape is
    replicated; otherwise exactly one dimension differs, and each TP rank holds one piece, the
    band of that dimension that follows the previous ranks' (what :class:`TpSplit` describes).

    Raises:
        CheckpointIncompleteError: a TP checkpoint without affine maps (saved by a DeepSpeed
            without them, or with a ``client_state`` that replaced ``universal_checkpoint_info``).
        LayoutMismatchError: a cut these layouts do not describe (several pieces per rank: fused
            sub-parameters; a band out of order), naming the parameter.
    """
    if saved.tp == 1:
        return {}
    info = saved.model_state.get("universal_checkpoint_info") or {}
    params = ((info.get("affine_map") if isinstance(info, dict) else None) or {}).get("params")
    if not params:
        raise CheckpointIncompleteError(
            f"{saved.dir}: saved at TP {saved.tp} without AutoTP's affine maps (universal_checkpoint_info): "
            "its TP shards cannot be joined"
        )
    out = {}
    for pattern, entry in params.items():
        name = re.sub(r"\\(.)", r"\1", pattern.removeprefix("^").removesuffix("$"))
        split = _split_of(name, entry, saved.tp)
        if split is not None:
            out[name] = split
    return out


def _split_of(name: str, entry: dict, tp: int):
    logical = tuple(int(d) for d in entry["logical_shape"])
    ranks = {int(t): v for t, v in entry["ranks"].items()}
    if sorted(ranks) != list(range(tp)):
        raise LayoutMismatchError(f"{name}: affine map for TP ranks {sorted(ranks)}, the checkpoint has {tp}")
    shards = [tuple(int(d) for d in ranks[t]["shard_shape"]) for t in range(tp)]
    if all(s == logical for s in shards):
        return None
    dims = {d for s in shards for d in range(len(logical)) if s[d] != logical[d]}
    if len(dims) != 1 or dims - {0, 1}:
        raise LayoutMismatchError(f"{name}: AutoTP cut dimensions {sorted(dims)}; only one of 0 and 1 is described")
    dim = dims.pop()
    sizes = tuple(s[dim] for s in shards)
    inner = math.prod(logical[dim + 1 :])  # elements per index of the cut dimension
    for t in range(tp):
        pieces = ranks[t]["pieces"]
        want = sum(sizes[:t]) * inner
        if len(pieces) != 1 or int(pieces[0]["source"][0]) != want:
            raise LayoutMismatchError(
                f"{name}: TP rank {t}'s shard is {len(pieces)} piece(s) from element "
                f"{pieces[0]['source'][0] if pieces else '-'}, not the band from element {want} (fused sub-parameters "
                "are not described)"
            )
    return TpSplit(dim, sizes)


def tp_layout_from_metadata(saved: SavedCheckpoint) -> TensorParallelLayout:
    """The :class:`TensorParallelLayout` ``saved`` was written in, from its metadata alone: TP rank
    0's ``param_shapes`` (as :func:`~ds_dynatrain.checkpoint.saved_layout.saved_layout`) with the
    cut dimensions made whole again (:func:`saved_splits`). Not checked against the other TP ranks'
    files: :func:`check_shards` does that.

    Raises:
        CheckpointIncompleteError, LayoutMismatchError: as :func:`saved_splits`; the affine maps
            do not fit ``param_shapes``.
    """
    base = saved_layout(saved)
    splits = saved_splits(saved)
    groups = tuple(tuple(ParamMeta(p.key, _logical(p, splits.get(p.key)), p.dtype) for p in g) for g in base.groups)
    keys = {p.key for g in groups for p in g}
    cut = tuple(sorted((k, s) for k, s in splits.items() if k in keys))
    try:
        return TensorParallelLayout(
            saved.tp,
            saved.world_size,
            groups,
            cut,
            base.stage,
            base.round_robin,
            base.parameter_alignment,
            base.sub_group_size,
        )
    except ValueError as err:
        raise LayoutMismatchError(f"{saved.dir}: the affine maps do not fit param_shapes: {err}") from None


def _logical(p: ParamMeta, split) -> Tuple[int, ...]:
    if split is None:
        return tuple(p.shape)
    shape = list(p.shape)
    if split.dim >= len(shape):
        raise LayoutMismatchError(f"{p.key} {list(p.shape)}: the affine map cuts dimension {split.dim}")
    shape[split.dim] = sum(split.sizes)
    return tuple(shape)


def saved_tp_layout(
    saved: SavedCheckpoint, live: TensorParallelLayout, splits: Mapping[str, TpSplit]
) -> TensorParallelLayout:
    """The layout ``saved`` was written in: ``live``'s parameters (full shapes, the saved working
    dtype) at the saved TP degree (``saved.tp``, cut as ``splits`` say) and DP degree, with the
    saved ZeRO settings.

    Raises:
        LayoutMismatchError: AutoTP's cut at the saved degree does not fit the model, or a saved TP
            rank's parameters, their order or shard shapes, or a partition's size differ from the
            layout's (naming the TP rank, the first parameter or the file).
    """
    dtype = saved.working_dtype()
    groups = tuple(tuple(ParamMeta(p.key, p.shape, dtype) for p in g) for g in live.groups)
    keys = {p.key for p in live.params}
    cut = tuple(sorted((k, s) for k, s in splits.items() if k in keys))
    try:
        old = TensorParallelLayout(saved.tp, saved.world_size, groups, cut, *_settings(saved))
    except (LayoutMismatchError, ValueError) as err:
        raise LayoutMismatchError(f"{saved.dir}: AutoTP's cut at TP {saved.tp} does not fit the model: {err}") from None
    for t in range(saved.tp):
        check_shards(saved, old, t)
        saved.check_sizes(old.zero(t), t)
    return old


def _settings(saved: SavedCheckpoint) -> Tuple[int, bool, bool, int]:
    """``(stage, round_robin, parameter_alignment, sub_group_size)`` of the saving config, in
    :class:`TensorParallelLayout`'s order."""
    rr, align, stage, sub_group_size = saved.zero_settings()
    return stage, rr, align, sub_group_size


def check_shards(saved: SavedCheckpoint, layout, tp_rank: int) -> None:
    """Band ``tp_rank``'s model-state file (a TP rank's, or a pipeline stage's) lists the band
    layout's parameters of that band, in the order they lie in its partitions, with its shards'
    shapes (``param_shapes``; parameters without elements left out, as DeepSpeed keeps them out of
    its partitions).

    Raises:
        LayoutMismatchError: naming the band and the first parameter that differs.
    """
    zl = layout.zero(tp_rank)
    shapes = {p.key: tuple(p.shape) for g in zl.groups for p in g}
    want = [(k, shapes[k]) for b in range(zl.num_partitions) for k in zl.partition_keys(b) if math.prod(shapes[k]) > 0]
    got = [
        (str(n), tuple(int(d) for d in s))
        for g in (saved.model_state_of(tp_rank).get("param_shapes") or [])
        for n, s in g.items()
        if math.prod(int(d) for d in s) > 0
    ]
    for i in range(max(len(got), len(want))):
        here, there = (got[i] if i < len(got) else None), (want[i] if i < len(want) else None)
        if here != there:
            raise LayoutMismatchError(
                f"{saved.dir}: {layout.band_name} {tp_rank} of {saved.degrees()}: parameter {i} of the saved "
                f"partitions is {_named(here)} in the checkpoint and {_named(there)} in the model's layout"
            )


def _named(x) -> str:
    return "missing" if x is None else f"{x[0]} {list(x[1])}"


def full_runs(layout: TensorParallelLayout, p: ParamMeta, tp_rank: int, start: int, numel: int):
    """Where elements ``[start, start + numel)`` of TP rank ``tp_rank``'s shard of ``p`` (its
    row-major flattening) lie in the whole parameter: ``[(offset in the shard's range, offset in
    the whole flattening, elements)]``, one run per row of the shard (one in all when the shard
    is whole rows)."""
    r0, _rows, c0, cols = layout.band(p, tp_rank)
    _, width = matrix_shape(p.shape)
    if cols == width:  # whole rows: one run
        return [(0, r0 * width + start, numel)]
    out, pos, end = [], start, start + numel
    while pos < end:
        i, j = divmod(pos, cols)
        n = min(cols - j, end - pos)
        out.append((pos - start, (r0 + i) * width + c0 + j, n))
        pos += n
    return out
