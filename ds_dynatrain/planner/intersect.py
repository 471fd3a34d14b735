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
from typing import NamedTuple

import numpy as np

from ..vps.layout import FragmentTable, ZeroLayout

# the columns of a transfer table, in this order (``Transfer``'s fields)
COLUMNS = ("src", "dst", "group", "src_offset", "dst_offset", "numel", "dst_group")
WIDTH = len(COLUMNS)


class _Segments(NamedTuple):
    """The segments of two layouts: segment ``k`` starts at global element ``start[k]``, has
    ``numel[k]`` elements and lies in old fragment ``old_index[k]`` of ``old`` (a fragment table,
    whose fragments start at ``old_start`` globally) and new fragment ``new_index[k]`` of ``new``."""

    start: np.ndarray
    numel: np.ndarray
    old: FragmentTable
    old_start: np.ndarray
    old_index: np.ndarray
    new: FragmentTable
    new_start: np.ndarray
    new_index: np.ndarray


def _segments(old: ZeroLayout, new: ZeroLayout) -> _Segments:
    numel = old.param_numels()
    base = np.zeros(numel.shape[0] + 1, dtype=np.int64)
    np.cumsum(numel, out=base[1:])
    a, b = old.fragment_table(), new.fragment_table()
    ga, gb = base[a.param] + a.start, base[b.param] + b.start
    # both runs are sorted: a stable sort of the two end to end is one linear merge (timsort);
    # each cut then knows how many old and new fragments start at or before it
    cuts = np.concatenate([ga, gb])
    perm = np.argsort(cuts, kind="stable")
    from_old = perm < ga.shape[0]
    ia = np.cumsum(from_old) - 1
    ib = np.cumsum(~from_old) - 1
    cuts = cuts[perm]
    del perm, from_old
    last = np.empty(cuts.shape[0], dtype=bool)  # the last of equal cuts: both counts are final
    if cuts.shape[0]:
        last[-1] = True
        np.not_equal(cuts[1:], cuts[:-1], out=last[:-1])
    start = cuts[last]
    return _Segments(start, np.diff(start, append=base[-1]), a, ga, ia[last], b, gb, ib[last])


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
    (:meth:`ZeroLayout.check_same_model`, not checked here). Memory: about 2 x 56 bytes per
    row at the peak, plus the two fragment tables (48 bytes per fragment).
    """
    s = _segments(old, new)
    ia, ib = s.old_index, s.new_index
    cols = [
        s.old.rank[ia],
        s.new.rank[ib],
        s.old.partition[ia],
        s.old.local[ia] + (s.start - s.old_start[ia]),
        s.new.local[ib] + (s.start - s.new_start[ib]),
        s.numel,
        s.new.partition[ib],
    ]
    del s, ia, ib
    order = _order(cols[0], cols[1], cols[2], cols[3], new.world_size, old.num_partitions)
    table = np.empty((order.shape[0], WIDTH), dtype=np.int64, order="F")
    for j in range(WIDTH):
        np.take(cols[j], order, out=table[:, j])
        cols[j] = None
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
