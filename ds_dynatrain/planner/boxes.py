"""The intersection of two band layouts as boxes (pure, vectorised with numpy).

A band layout is a tensor-parallel one (:class:`~ds_dynatrain.vps.tensor_parallel.TensorParallelLayout`:
a band is a TP rank's shard) or a pipeline one (:class:`~ds_dynatrain.vps.pipeline.PipelineLayout`:
a band is a stage, holding a parameter whole or not at all). Every rank's part of a parameter is a
few boxes of the parameter's matrix. A transfer is the intersection of an old box and a new box: a
box again, which lies in both flat partitions as a strided run. Method:

1. the pairs ``(parameter, old band, new band)`` whose bands overlap each get a group id;
2. the boxes of each band are repeated into every pair of their band, in the band's flattening
   order, so their rows, shifted by ``group id * (max rows + 1)``, are sorted on one global line
   (start and stop both non-decreasing: the boxes of a band tile it in row order);
3. for every old box, the new boxes of its pair whose rows overlap it are found with two binary
   searches (as :meth:`Region.intersection` does for intervals); their column ranges are
   intersected and empty results dropped.

The cost grows with the number of boxes (about parameters x (DP ranks + TP ranks) at ZeRO-1/2),
never with rows or elements.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..vps.layout import _ragged_arange
from ..vps.tensor_parallel import BoxTable, matrix_shape

# the columns of a box transfer table, in this order: old and new global ranks, the parameter,
# each side's partition, the offset of the box's first element and its row stride there, and the
# box's rows and columns; elements. A DP-only transfer is one row of ``cols`` elements.
TP_COLUMNS = (
    "src",
    "dst",
    "param",
    "group",
    "src_offset",
    "src_stride",
    "dst_group",
    "dst_offset",
    "dst_stride",
    "rows",
    "cols",
)
TP_WIDTH = len(TP_COLUMNS)


def _sorted_boxes(layout):
    """The layout's boxes sorted by (parameter, band, row, column), and where each
    ``(parameter, band)`` starts (``starts[p * bands + t]``, int64, one past the end at the end)."""
    b = layout.boxes()
    order = np.lexsort((b.col, b.row, b.band, b.param))
    b = BoxTable(*(c[order] for c in b))
    key = b.param * layout.num_bands + b.band
    starts = np.searchsorted(key, np.arange(len(layout.params) * layout.num_bands + 1), side="left")
    return b, starts


def _expand(b: BoxTable, starts: np.ndarray, band_key: np.ndarray):
    """Repeat the boxes of band ``band_key[g]`` for every pair ``g``: (box row indices, pair ids)."""
    lo, hi = starts[band_key], starts[band_key + 1]
    counts = hi - lo
    gid = np.repeat(np.arange(band_key.shape[0], dtype=np.int64), counts)
    idx = np.repeat(lo, counts) + _ragged_arange(counts)
    return idx, gid


def box_transfers(old, new, source_band: Optional[np.ndarray] = None) -> np.ndarray:
    """Every non-empty intersection of an old and a new box of the same parameter, as the rows of
    an int64 array of shape ``(n, 11)`` (columns :data:`TP_COLUMNS`, elements), sorted by
    ``(src, dst, param)``.

    A parameter that the old layout replicates (``old.replicated()``: over its TP ranks, or over
    the stages owning a tied key) is held more than once: with ``source_band`` new rank ``j``
    takes such a parameter from one old band's copy only, so the rows into each new rank tile its
    part of every parameter exactly once; without it every copy is intersected (what old rank
    ``i`` could give new rank ``j``: the overlap the rank assignment maximises). ``source_band``:
    int64, one old band per new rank (shape ``(new world size,)``), or one per parameter and new
    rank (``(parameters, new world size)``).

    ``old`` and ``new`` are band layouts of the same model (their ``check_same_model``).
    """
    params = old.params
    bo, bn = old.band_boxes(), new.band_boxes()
    # 1. pairs of overlapping bands
    r_lo = np.maximum(bo[:, :, None, 0], bn[:, None, :, 0])
    r_hi = np.minimum(bo[:, :, None, 0] + bo[:, :, None, 1], bn[:, None, :, 0] + bn[:, None, :, 1])
    c_lo = np.maximum(bo[:, :, None, 2], bn[:, None, :, 2])
    c_hi = np.minimum(bo[:, :, None, 2] + bo[:, :, None, 3], bn[:, None, :, 2] + bn[:, None, :, 3])
    p, t, u = np.nonzero((r_hi > r_lo) & (c_hi > c_lo))
    # 2. the boxes of each band, repeated into its pairs
    ob, ostarts = _sorted_boxes(old)
    nb, nstarts = _sorted_boxes(new)
    oi, ogid = _expand(ob, ostarts, p * old.num_bands + t)
    ni, ngid = _expand(nb, nstarts, p * new.num_bands + u)
    span = max((matrix_shape(q.shape)[0] for q in params), default=0) + 1
    o_lo = ogid * span + ob.row[oi]
    o_hi = o_lo + ob.rows[oi]
    n_lo = ngid * span + nb.row[ni]
    n_hi = n_lo + nb.rows[ni]
    # 3. row overlaps by binary search, then columns
    lo = np.searchsorted(n_hi, o_lo, side="right")
    hi = np.searchsorted(n_lo, o_hi, side="left")
    counts = np.maximum(hi - lo, 0)
    a = np.repeat(oi, counts)
    b = ni[np.repeat(lo, counts) + _ragged_arange(counts)]
    row = np.maximum(ob.row[a], nb.row[b])
    rows = np.minimum(ob.row[a] + ob.rows[a], nb.row[b] + nb.rows[b]) - row
    col = np.maximum(ob.col[a], nb.col[b])
    cols = np.minimum(ob.col[a] + ob.cols[a], nb.col[b] + nb.cols[b]) - col
    keep = (rows > 0) & (cols > 0)
    if source_band is not None:
        source = np.asarray(source_band, dtype=np.int64)
        chosen = source[nb.rank[b]] if source.ndim == 1 else source[ob.param[a], nb.rank[b]]
        keep &= ~old.replicated()[ob.param[a]] | (ob.band[a] == chosen)
    a, b, row, rows, col, cols = a[keep], b[keep], row[keep], rows[keep], col[keep], cols[keep]
    table = np.empty((a.shape[0], TP_WIDTH), dtype=np.int64, order="F")
    table[:, 0] = ob.rank[a]
    table[:, 1] = nb.rank[b]
    table[:, 2] = ob.param[a]
    table[:, 3] = ob.partition[a]
    table[:, 4] = ob.local[a] + (row - ob.row[a]) * ob.stride[a] + (col - ob.col[a])
    table[:, 5] = ob.stride[a]
    table[:, 6] = nb.partition[b]
    table[:, 7] = nb.local[b] + (row - nb.row[b]) * nb.stride[b] + (col - nb.col[b])
    table[:, 8] = nb.stride[b]
    table[:, 9] = rows
    table[:, 10] = cols
    order = np.lexsort((table[:, 4], table[:, 3], table[:, 2], table[:, 1], table[:, 0]))
    return np.asfortranarray(table[order])


def box_overlap_matrix(old, new) -> np.ndarray:
    """``K[i, j]``: elements old rank ``i`` holds that new rank ``j`` needs (int64, shape
    ``(old.world_size, new.world_size)``; a replicated parameter's every copy counts)."""
    t = box_transfers(old, new)
    k = np.zeros(old.world_size * new.world_size, dtype=np.int64)
    np.add.at(k, t[:, 0] * new.world_size + t[:, 1], t[:, 9] * t[:, 10])
    return k.reshape(old.world_size, new.world_size)
