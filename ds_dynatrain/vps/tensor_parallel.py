"""Tensor-parallel (DeepSpeed AutoTP) layouts composed with ZeRO, from parameter metadata alone.

AutoTP (``deepspeed/module_inject/auto_tp.py`` and ``layers.py``, deepspeed 0.19.8) cuts some
parameters along one dimension into one shard per TP rank (column-parallel linears and a
vocab-parallel head or embedding on dimension 0, row-parallel linears on dimension 1; the sizes
come from ``deepspeed.module_inject.tp_shard.get_shard_size_list``, uneven for GQA) and leaves
the others whole on every TP rank. ZeRO then sees only the TP-local parameters: each TP rank's
data-parallel group flattens and partitions *its* local parameters (``stage_1_and_2.py`` over
``groups._get_data_parallel_group()``). Ranks are numbered as ``groups._init_tp_mesh_device``
does: TP groups are consecutive ranks, so global rank = ``dp_rank * tp + tp_rank``.

Geometry: every parameter is seen as a matrix, ``(shape[0], prod(shape[1:]))``, or ``(numel, 1)``
for a vector. A TP shard is then a band of rows (dimension 0) or of columns (dimension 1): one
*box*. A ZeRO fragment, an interval of the shard's row-major flattening, is at most three boxes
(a partial first row, whole rows, a partial last row). So a rank's part of a parameter is a few
boxes, never one interval per row (a row-parallel shard of an 8192 x 8192 weight would be 8,192
intervals of the full flattening). A box lies in a rank's flat partition as a strided run: row
``k`` of the box starts at ``local + k * stride``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..errors import LayoutMismatchError
from .layout import DEFAULT_SUB_GROUP_SIZE, ParamMeta, ZeroLayout


@dataclass(frozen=True)
class TpSplit:
    """How AutoTP cuts one parameter.

    Attributes:
        dim: the dimension cut (0 or 1), or ``None`` for a parameter every TP rank holds whole.
        sizes: the shard's extent along ``dim`` on each TP rank (elements of that dimension;
            zero allowed, as AutoTP gives when the TP degree exceeds the KV heads); empty when
            ``dim`` is ``None``.
    """

    dim: Optional[int] = None
    sizes: Tuple[int, ...] = ()

    def __post_init__(self):
        if self.dim is None and self.sizes:
            raise ValueError("a replicated parameter has no shard sizes")
        if self.dim is not None and (self.dim not in (0, 1) or not self.sizes or min(self.sizes) < 0):
            raise ValueError(f"a TP split cuts dimension 0 or 1 into non-negative sizes, got {self.dim} {self.sizes}")


REPLICATED = TpSplit()


def matrix_shape(shape: Sequence[int]) -> Tuple[int, int]:
    """The matrix a parameter is seen as: ``(shape[0], prod(shape[1:]))``; ``(numel, 1)`` for a
    vector; ``(1, 1)`` for a scalar."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return int(shape[0]), 1
    return int(shape[0]), int(math.prod(shape[1:]))


class BoxTable(NamedTuple):
    """Boxes of a layout, one row each (int64 arrays of one length). Box ``i`` covers rows
    ``[row[i], row[i] + rows[i])`` and columns ``[col[i], col[i] + cols[i])`` of parameter
    ``param[i]``'s matrix (:func:`matrix_shape`); global ``rank[i]`` holds it in its flat
    partition ``partition[i]``, where element ``(row[i] + k, col[i] + j)`` lies at
    ``local[i] + k * stride[i] + j`` (elements). ``band[i]`` is the TP rank whose shard holds it.
    Within one ``(param, band)`` the rows are in the order of the shard's flattening."""

    param: np.ndarray
    band: np.ndarray
    rank: np.ndarray
    partition: np.ndarray
    row: np.ndarray
    rows: np.ndarray
    col: np.ndarray
    cols: np.ndarray
    local: np.ndarray
    stride: np.ndarray


BOX_FIELDS = BoxTable._fields


@dataclass(frozen=True)
class TensorParallelLayout:
    """The layout of a model under AutoTP at degree ``tp`` and ZeRO over ``dp`` ranks per TP rank.

    Attributes:
        tp, dp: tensor- and data-parallel degrees (world size ``tp * dp``).
        groups: per optimizer parameter group, its trainable parameters in group order, with
            their full (logical) shapes.
        splits: ``(key, TpSplit)`` of the parameters AutoTP cuts; the others are replicated.
        stage, round_robin, parameter_alignment, sub_group_size: the ZeRO settings, as
            :class:`~ds_dynatrain.vps.layout.ZeroLayout`.

    Raises:
        LayoutMismatchError: a split names a parameter the groups lack, its sizes do not tile
            the dimension, it has not ``tp`` sizes, or it cuts a dimension the parameter lacks.
        ValueError: ``tp`` or ``dp`` below 1 (and as :class:`ZeroLayout`).
    """

    band_name = "TP rank"  # what a message calls a band

    tp: int
    dp: int
    groups: Tuple[Tuple[ParamMeta, ...], ...]
    splits: Tuple[Tuple[str, TpSplit], ...] = ()
    stage: int = 2
    round_robin: bool = False
    parameter_alignment: bool = False
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    _zero: Tuple[ZeroLayout, ...] = field(init=False, repr=False, compare=False, hash=False)
    _split: Dict[str, TpSplit] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"TP and DP degrees must be >= 1, got TP {self.tp} x DP {self.dp}")
        metas = {p.key: p for g in self.groups for p in g}
        split = dict(self.splits)
        for key, s in split.items():
            if key not in metas:
                raise LayoutMismatchError(f"TP split of {key!r}: no such trainable parameter")
            if s.dim is None:
                continue
            shape = metas[key].shape
            if s.dim >= max(len(shape), 1) or len(s.sizes) != self.tp:
                raise LayoutMismatchError(
                    f"TP split of {key} {list(shape)}: dimension {s.dim} into {len(s.sizes)} shards at TP {self.tp}"
                )
            if sum(s.sizes) != shape[s.dim]:
                raise LayoutMismatchError(f"TP split of {key}: sizes {list(s.sizes)} do not tile {shape[s.dim]}")
        object.__setattr__(self, "_split", split)
        zero = tuple(
            ZeroLayout(
                self.dp,
                tuple(tuple(ParamMeta(p.key, self.local_shape(p, t), p.dtype) for p in g) for g in self.groups),
                self.round_robin,
                self.parameter_alignment,
                self.stage,
                self.sub_group_size,
            )
            for t in range(self.tp)
        )
        object.__setattr__(self, "_zero", zero)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @property
    def num_bands(self) -> int:
        """Bands of the box view: one per TP rank."""
        return self.tp

    @property
    def degrees(self) -> Tuple[int, int]:
        """``(tp, dp)``: what a plan's digest names of this layout."""
        return (self.tp, self.dp)

    def split(self, key: str) -> TpSplit:
        return self._split.get(key, REPLICATED)

    def band_boxes(self) -> np.ndarray:
        """``(parameters, tp, 4)`` int64: every TP rank's shard of every parameter as a box."""
        params = self.params
        out = np.empty((len(params), self.tp, 4), dtype=np.int64)
        for i, p in enumerate(params):
            for t in range(self.tp):
                out[i, t] = self.band(p, t)
        return out

    def replicated(self) -> np.ndarray:
        """``(parameters,)`` bool: held whole by every TP rank (AutoTP does not cut it)."""
        return np.asarray([self.split(p.key).dim is None for p in self.params], dtype=bool)

    def first_holders(self) -> np.ndarray:
        """``(parameters,)`` int64: the lowest band holding a piece of each parameter (0: every
        TP rank holds a piece or the whole)."""
        return np.zeros(len(self.params), dtype=np.int64)

    def local_shape(self, p: ParamMeta, tp_rank: int) -> Tuple[int, ...]:
        """The shape of TP rank ``tp_rank``'s shard of ``p``."""
        s = self.split(p.key)
        if s.dim is None:
            return tuple(p.shape)
        shape = list(p.shape)
        shape[s.dim] = s.sizes[tp_rank]
        return tuple(shape)

    def band(self, p: ParamMeta, tp_rank: int) -> Tuple[int, int, int, int]:
        """``(row, rows, col, cols)``: TP rank ``tp_rank``'s shard of ``p`` as a box of its matrix."""
        nr, nc = matrix_shape(p.shape)
        s = self.split(p.key)
        if s.dim is None:
            return 0, nr, 0, nc
        lo = sum(s.sizes[:tp_rank])
        if s.dim == 0:
            return lo, s.sizes[tp_rank], 0, nc
        inner = nc // p.shape[1] if p.shape[1] else 0  # elements per index of dimension 1
        return 0, nr, lo * inner, s.sizes[tp_rank] * inner

    def zero(self, tp_rank: int) -> ZeroLayout:
        """The ZeRO layout of TP rank ``tp_rank``'s data-parallel group (its local shapes)."""
        return self._zero[tp_rank]

    def zero_of(self, rank: int) -> ZeroLayout:
        """The ZeRO layout of global ``rank``'s data-parallel group."""
        return self._zero[rank % self.tp]

    def dp_rank_of(self, rank: int) -> int:
        """The DP rank of global ``rank`` in its data-parallel group."""
        return rank // self.tp

    def band_of(self, rank: int) -> int:
        """The band (TP rank) of global ``rank``: DeepSpeed's ``mp_rank`` in its checkpoint files'
        names."""
        return rank % self.tp

    def rank(self, tp_rank: int, dp_rank: int) -> int:
        """The global rank of ``(tp_rank, dp_rank)``: ``dp_rank * tp + tp_rank``."""
        return dp_rank * self.tp + tp_rank

    @property
    def params(self) -> Tuple[ParamMeta, ...]:
        """Every trainable parameter, in group order (the ``param`` index of :class:`BoxTable`)."""
        return tuple(p for g in self.groups for p in g)

    def boxes(self) -> BoxTable:
        """Every box of every rank (:class:`BoxTable`), vectorised over the ZeRO fragments."""
        params = self.params
        index = {p.key: i for i, p in enumerate(params)}
        parts = []
        for t in range(self.tp):
            frag = self._zero[t].fragment_table()
            keys = [p.key for g in self._zero[t].groups for p in g]
            pidx = np.asarray([index[k] for k in keys], dtype=np.int64)[frag.param]
            bands = np.asarray([self.band(p, t) for p in params], dtype=np.int64).reshape(-1, 4)[pidx]
            parts.append(fragment_boxes(frag, pidx, t, bands, frag.rank * self.tp + t))
        return BoxTable(*(np.concatenate([p[i] for p in parts]) for i in range(len(BOX_FIELDS))))

    def check_same_model(self, other: "TensorParallelLayout", settings: bool = True) -> None:
        """Raise :class:`LayoutMismatchError` when ``other`` is not the same model (parameters in
        one order, full shapes; with ``settings`` also dtypes and the ZeRO settings)."""
        a, b = self.params, other.params
        if [(p.key, p.shape) for p in a] != [(p.key, p.shape) for p in b]:
            raise LayoutMismatchError("the two TP layouts describe different parameters")
        if not settings:
            return
        if [p.dtype for p in a] != [p.dtype for p in b]:
            raise LayoutMismatchError("the two TP layouts describe different parameter dtypes")
        mine = (self.stage, self.round_robin, self.parameter_alignment, self.sub_group_size)
        theirs = (other.stage, other.round_robin, other.parameter_alignment, other.sub_group_size)
        if mine != theirs:
            raise LayoutMismatchError(f"the two TP layouts differ in their ZeRO settings: {mine} and {theirs}")

    def with_degrees(self, tp: int, dp: int, splits: Mapping[str, TpSplit]) -> "TensorParallelLayout":
        """The same model and ZeRO settings at another TP and DP degree (``splits``: AutoTP's cut
        at ``tp``)."""
        return TensorParallelLayout(
            tp,
            dp,
            self.groups,
            tuple(sorted(splits.items())),
            self.stage,
            self.round_robin,
            self.parameter_alignment,
            self.sub_group_size,
        )


def fragment_boxes(frag, pidx: np.ndarray, band: int, bands: np.ndarray, ranks: np.ndarray) -> Tuple[np.ndarray, ...]:
    """The at most three boxes of each ZeRO fragment of one band's shards (columns of
    :class:`BoxTable`). ``pidx[i]``: fragment ``i``'s parameter index; ``bands[i]``: its shard
    as ``(row, rows, col, cols)``; ``ranks[i]``: the global rank holding it (int64 arrays)."""
    c = np.maximum(bands[:, 3], 1)
    s, e = frag.start, frag.start + frag.numel
    i_s, j_s, i_e, j_e = s // c, s % c, e // c, e % c
    one_row = i_s == i_e
    # head: the partial first row (or the whole fragment when it stays in one row)
    head_cols = np.where(one_row, j_e - j_s, np.where(j_s > 0, c - j_s, 0))
    head = (i_s, np.where(head_cols > 0, 1, 0), j_s, head_cols, s)
    # body: the whole rows
    body_from = np.where(j_s > 0, i_s + 1, i_s)
    body_rows = np.where(one_row, 0, np.maximum(i_e - body_from, 0))
    body = (body_from, body_rows, np.zeros_like(s), np.where(body_rows > 0, c, 0), body_from * c)
    # tail: the partial last row
    tail_cols = np.where(one_row, 0, j_e)
    tail = (i_e, np.where(tail_cols > 0, 1, 0), np.zeros_like(s), tail_cols, i_e * c)
    cols_out = []
    for row, rows, col, cols, flat in (head, body, tail):
        keep = (rows > 0) & (cols > 0)
        cols_out.append(
            (
                pidx[keep],
                np.full(int(keep.sum()), band, dtype=np.int64),
                ranks[keep],
                frag.partition[keep],
                row[keep] + bands[keep, 0],
                rows[keep],
                col[keep] + bands[keep, 2],
                cols[keep],
                frag.local[keep] + flat[keep] - s[keep],
                c[keep],
            )
        )
    out = tuple(np.concatenate([part[i] for part in cols_out]) for i in range(len(BOX_FIELDS)))
    # the boxes of one shard do not overlap, so (row, column) order is the shard's flattening order
    order = np.lexsort((out[6], out[4], out[0]))
    return tuple(col[order] for col in out)
