"""The intersection of two layouts as columns of numbers (pure, vectorised with numpy).

Why columns: a plan of a 405 B-parameter model under ZeRO-3 between 4,096 and 3,072 ranks has
about 7.7 million transfers (every parameter is cut at every rank boundary of both worlds).
Built as Python tuples they took over a minute and several GiB; as int64 columns the same
work is one merge, one sort and a few gathers over arrays.

Method: every parameter gets a base offset in one *global* coordinate (the parameters end to
end in group order). The fragments of a parameter tile it exactly in both layouts (padding is
never a fragment), so the old fragments tile ``[0, total)``, and so do the new ones. The union
of the two sets of fragment starts cuts that line into *segments*; each segment lies in exactly
one old fragment and one new fragment, and is one raw transfer. A segment never crosses a
parameter boundary, because both layouts start a fragment at every parameter's first element.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Tuple

import numpy as np

from ..vps.layout import ZeroLayout

# the columns of a transfer table, in this order (``Transfer``'s fields)
COLUMNS = ("src", "dst", "group", "src_offset", "dst_offset", "numel", "dst_group")
WIDTH = len(COLUMNS)


class _Side(NamedTuple):
    """One layout's per-parameter constants (int64, one per parameter): a segment of parameter
    ``p`` starting at global element ``x`` held by rank ``r`` lies at offset
    ``x + shift[p] - r * size[p]`` of ``r``'s partition ``part[p]``."""

    part: np.ndarray
    shift: np.ndarray
    size: np.ndarray


class _Segments(NamedTuple):
    """The segments of two layouts: segment ``k`` of parameter ``param[k]`` (intp) starts at
    global element ``start[k]``, has ``numel[k]`` elements (int64), and is held by old rank
    ``src[k]`` and new rank ``dst[k]`` (int32)."""

    start: np.ndarray
    numel: np.ndarray
    param: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    old: _Side
    new: _Side


def _cuts(layout: ZeroLayout, base: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray, _Side]:
    """Where ``layout``'s fragments start on the global line (int64, sorted), their ranks (int32) and
    parameters (intp), and the layout's :class:`_Side`. Rank ``r`` holds elements
    ``[r * size - off, (r + 1) * size - off)`` of a parameter (``off``: its offset in the flat
    group at stages 1/2, 0 at stage 3), clipped to the parameter: :meth:`ZeroLayout.fragment_table`
    reduced to what the planner needs."""
    part, where, size = layout.param_geometry()
    numel = np.diff(base)
    off = np.zeros_like(where) if layout.stage == 3 else where
    cut = np.maximum(size, 1)  # a stage-3 piece is 0 only for an empty parameter (no fragment)
    first = off // cut
    counts = np.where(numel > 0, (off + numel - 1) // cut - first + 1, 0)
    param = np.repeat(np.arange(numel.shape[0], dtype=np.intp), counts)
    rank = np.arange(param.shape[0], dtype=np.int32)
    rank -= np.repeat((np.cumsum(counts) - counts - first).astype(np.int32), counts)
    g = size[param]
    g *= rank
    tmp = off[param]
    g -= tmp
    np.maximum(g, 0, out=g)
    np.take(base, param, out=tmp, mode="clip")
    g += tmp
    return g, rank, param, _Side(part, where - base[:-1], size)


def _segments(old: ZeroLayout, new: ZeroLayout) -> _Segments:
    numel = old.param_numels()
    base = np.zeros(numel.shape[0] + 1, dtype=np.int64)
    np.cumsum(numel, out=base[1:])
    ga, ra, pa, side_a = _cuts(old, base)
    gb, rb, _, side_b = _cuts(new, base)
    # both runs are sorted: a stable sort of the two end to end is one linear merge (timsort);
    # each cut then knows how many old and new fragments start at or before it
    cuts = np.concatenate([ga, gb])
    del ga, gb
    perm = np.argsort(cuts, kind="stable")
    from_old = perm < ra.shape[0]
    cuts = cuts[perm]
    del perm
    ia = np.cumsum(from_old, dtype=np.int32)
    np.logical_not(from_old, out=from_old)
    ib = np.cumsum(from_old, dtype=np.int32)
    del from_old
    last = np.empty(cuts.shape[0], dtype=bool)  # the last of equal cuts: both counts are final
    if cuts.shape[0]:
        last[-1] = True
        np.not_equal(cuts[1:], cuts[:-1], out=last[:-1])
    start = cuts[last]
    del cuts
    ia, ib = ia[last], ib[last]
    ia -= 1
    ib -= 1
    return _Segments(start, np.diff(start, append=base[-1]), pa[ia], ra[ia], rb[ib], side_a, side_b)


def _partition_ordered(layout: ZeroLayout) -> bool:
    """Whether a rank's fragments lie in its partitions in parameter order (by partition, then
    offset): true at stage 3 and at stages 1/2 unless round robin reorders a group."""
    part, where, _ = layout.param_geometry()
    return bool(np.all((part[1:] > part[:-1]) | ((part[1:] == part[:-1]) & (where[1:] >= where[:-1]))))


def _offsets(start, rank, param, side: _Side, out: np.ndarray, tmp: np.ndarray) -> None:
    """``out = start + side.shift[param] - rank * side.size[param]`` (int64, in place)."""
    np.take(side.size, param, out=out, mode="clip")
    out *= rank
    np.take(side.shift, param, out=tmp, mode="clip")
    tmp -= out
    np.add(tmp, start, out=out)


def _table_by_rank_pairs(s: _Segments, new_ws: int, bits: int) -> np.ndarray:
    """The table sorted by ``(src, dst)`` alone, stably: one ``np.sort`` of packed int64 keys
    ``(src * new_ws + dst) << bits | segment``. Valid when the old layout is partition-ordered
    (:func:`_partition_ordered`): a rank holds one fragment per parameter in each layout, so a
    pair of ranks shares at most one segment per parameter, and segments come in parameter
    order, which is then ``(group, src_offset)`` order for a fixed ``src``."""
    n = s.start.shape[0]
    packed = s.src.astype(np.int64)
    packed *= new_ws
    packed += s.dst
    packed <<= bits
    packed |= np.arange(n, dtype=np.int64)
    packed.sort()
    order = packed & ((1 << bits) - 1)
    packed >>= bits
    table = np.empty((n, WIDTH), dtype=np.int64, order="F")
    src, dst = table[:, 0], table[:, 1]
    np.floor_divide(packed, new_ws, out=src)
    np.multiply(src, new_ws, out=dst)
    np.subtract(packed, dst, out=dst)
    start = np.take(s.start, order, out=packed, mode="clip")
    param = s.param[order]
    np.take(s.numel, order, out=table[:, 5], mode="clip")
    del order
    np.take(s.old.part, param, out=table[:, 2], mode="clip")
    np.take(s.new.part, param, out=table[:, 6], mode="clip")
    tmp = np.empty(n, dtype=np.int64)
    _offsets(start, src, param, s.old, table[:, 3], tmp)
    _offsets(start, dst, param, s.new, table[:, 4], tmp)
    return table


def _table_lexsorted(s: _Segments, new_ws: int, old_parts: int) -> np.ndarray:
    """The table sorted by ``(src, dst, group, src_offset)`` in general (round robin)."""
    n = s.start.shape[0]
    cols = [s.src.astype(np.int64), s.dst.astype(np.int64), s.old.part[s.param]]
    cols += [np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64), s.numel, s.new.part[s.param]]
    tmp = np.empty(n, dtype=np.int64)
    _offsets(s.start, s.src, s.param, s.old, cols[3], tmp)
    _offsets(s.start, s.dst, s.param, s.new, cols[4], tmp)
    order = _order(cols[0], cols[1], cols[2], cols[3], new_ws, old_parts)
    table = np.empty((n, WIDTH), dtype=np.int64, order="F")
    for j in range(WIDTH):
        np.take(cols[j], order, out=table[:, j], mode="clip")
        cols[j] = None
    return table


def _order(src, dst, group, src_offset, new_ws: int, old_parts: int) -> np.ndarray:
    """Row order sorting by ``(src, dst, group, src_offset)``: unique per row (two rows of one
    old partition never start at the same offset), so the order is total. One int64 key when the
    ranges fit in 63 bits (the rows come as sorted runs, one per parameter, which the stable
    sort merges), else a lexicographic sort."""
    if src.shape[0] == 0:
        return np.empty(0, dtype=np.int64)
    span = int(src_offset.max()) + 1
    if (int(src.max()) + 1) * new_ws * old_parts * span < 2**63:
        key = src * new_ws
        key += dst
        key *= old_parts
        key += group
        key *= span
        key += src_offset
        return np.argsort(key, kind="stable")
    return np.lexsort((src_offset, group, dst, src))


def transfer_table(old: ZeroLayout, new: ZeroLayout) -> np.ndarray:
    """Every non-empty intersection of an old and a new fragment of the same parameter, as the
    rows of an int64 array of shape ``(n, 7)`` (columns :data:`COLUMNS`, elements; Fortran
    order, so each column is contiguous), sorted by ``(src, dst, group, src_offset)``, with the
    rows that continue each other (same ranks and partitions, adjacent on both sides) merged.

    ``old`` and ``new`` hold the same parameters in the same group order
    (:meth:`ZeroLayout.check_same_model`, not checked here). The order comes from one sort of
    packed ``(src, dst)`` keys when the old layout is partition-ordered (stage 3; stages 1/2
    without round robin), else from a sort on all four columns. Memory: about 2 x 56 bytes per
    row at the peak, plus 20 bytes per fragment of either layout (its start, rank and parameter).
    """
    s = _segments(old, new)
    n = s.start.shape[0]
    bits = max(n - 1, 1).bit_length()
    if _partition_ordered(old) and (old.world_size * new.world_size) << bits < 2**63:
        table = _table_by_rank_pairs(s, new.world_size, bits)
    else:
        table = _table_lexsorted(s, new.world_size, old.num_partitions)
    del s
    return _merge_sorted(table)


@lru_cache(maxsize=1)
def shared_transfer_table(old: ZeroLayout, new: ZeroLayout) -> np.ndarray:
    """:func:`transfer_table`, remembered for the last pair of layouts (equal layouts hit; the
    result is made read-only): a resize asks for it twice, once to choose the rank assignment
    (:func:`~ds_dynatrain.planner.assignment.overlap_matrix`) and once for the plan of that
    assignment, and at scale each computation costs seconds. Holds one table alive."""
    table = transfer_table(old, new)
    table.flags.writeable = False
    return table


def _merge_sorted(t: np.ndarray) -> np.ndarray:
    """Merge the rows of a sorted table that continue the row before them."""
    n = t.shape[0]
    if n < 2:
        return t
    cont = np.ones(n - 1, dtype=bool)
    for j in (0, 1, 2, 6):
        cont &= t[1:, j] == t[:-1, j]
    cont &= t[:-1, 3] + t[:-1, 5] == t[1:, 3]
    cont &= t[:-1, 4] + t[:-1, 5] == t[1:, 4]
    if not cont.any():
        return t
    heads = np.flatnonzero(np.concatenate([[True], ~cont]))
    out = np.asfortranarray(t[heads])
    out[:, 5] = np.add.reduceat(t[:, 5], heads)
    return out
