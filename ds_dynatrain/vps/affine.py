"""Regions to and from DeepSpeed's affine shard description (``deepspeed.checkpoint.affine``).

DeepSpeed describes a shard of one parameter as ``AffinePiece`` s (``torch.as_strided`` views of
the full tensor and of the shard) in a ``ParamAffineMap``; we describe what a rank holds as a
:class:`~ds_dynatrain.vps.region.Region` (element intervals of the row-major flattening). Both are
exact; converting lets DeepSpeed's own checker (``ParamAffineMap.validate_coverage``,
``rebuild``) and planner (``affine_transfer.plan_transfer``) serve as oracles for ours, and lets a
map written by DeepSpeed be read as regions.

A ZeRO-1/2 fragment is one interval: a 1-D piece of stride 1 whose shard is the fragment itself.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from .layout import ZeroLayout
from .region import Region


def zero_param_affine_map(layout: ZeroLayout, group: int, key: str):
    """The ``ParamAffineMap`` of parameter ``key`` under ``layout``: rank ``r``'s shard is its
    fragment of the parameter (1-D, in parameter order)."""
    from deepspeed.checkpoint.affine import AffinePiece, ParamAffineMap

    shape = next(p.shape for p in layout.groups[group] if p.key == key)
    shard_shapes, pieces = {}, {}
    for rank, f in layout.param_fragments(group, key):
        shard_shapes[rank] = (f.numel,)
        pieces[rank] = [AffinePiece((f.numel,), f.start, (1,), 0, (1,), [rank])]
    return ParamAffineMap(shape, shard_shapes, pieces)


def piece_region(piece) -> Region:
    """The elements of the full tensor an ``AffinePiece`` covers, as a region (vectorised: one
    interval per contiguous run)."""
    shape, strides = list(piece.shape), list(piece.source_strides)
    if any(d == 0 for d in shape):
        return Region()
    if not shape:
        return Region.from_intervals([(piece.source_offset, piece.source_offset + 1)])
    run = 1
    # trailing dimensions that are contiguous in the source merge into one run
    while shape and strides[-1] == run:
        run *= shape.pop()
        strides.pop()
    base = np.array([piece.source_offset], dtype=np.int64)
    for n, s in zip(shape, strides):
        base = (base[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    return Region.from_intervals(np.stack([base, base + run], axis=1))


def affine_map_regions(amap) -> Dict[int, Region]:
    """``rank -> region`` of every rank of a ``ParamAffineMap``."""
    out = {}
    for rank, pieces in amap.pieces_by_rank.items():
        region = Region()
        for piece in pieces:
            region = region.union(piece_region(piece))
        out[rank] = region
    return out
