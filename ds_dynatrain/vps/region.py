"""Regions of the Virtual Parameter Space.

Convention (used everywhere in ds_dynatrain): a logical tensor is addressed by its *row-major
flattening*; positions and lengths are in **elements**, never bytes (bytes appear only where bytes
move: the transition engine and ``io_engine``). A region is the part of one logical tensor a rank
holds: a set of half-open intervals ``[start, stop)`` over that flattening. A ZeRO partition of a
parameter is one interval; a tensor-parallel shard (a box) is a set of intervals.

Regions are values: sorted, non-overlapping, adjacent intervals merged, stored as a tuple so they
hash and compare; every operation returns a new region. The set operations are vectorised with
numpy, so their cost grows with the number of intervals, not elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, Tuple

import numpy as np

Interval = Tuple[int, int]


def _normalise(intervals: np.ndarray) -> np.ndarray:
    """Sort, drop empty, merge overlapping and adjacent intervals. ``intervals``: int64 (n, 2)."""
    if intervals.size == 0:
        return np.empty((0, 2), dtype=np.int64)
    iv = intervals[intervals[:, 1] > intervals[:, 0]]
    if iv.shape[0] == 0:
        return np.empty((0, 2), dtype=np.int64)
    iv = iv[np.argsort(iv[:, 0], kind="stable")]
    # an interval starts a new run when its start is past every stop seen so far
    running_stop = np.maximum.accumulate(iv[:, 1])
    new_run = np.empty(iv.shape[0], dtype=bool)
    new_run[0] = True
    new_run[1:] = iv[1:, 0] > running_stop[:-1]
    run_id = np.cumsum(new_run) - 1
    starts = iv[new_run, 0]
    stops = np.zeros(starts.shape[0], dtype=np.int64)
    np.maximum.at(stops, run_id, iv[:, 1])
    return np.stack([starts, stops], axis=1)


@dataclass(frozen=True)
class Region:
    """A set of half-open element intervals over one tensor's row-major flattening.

    Attributes:
        intervals: sorted, disjoint, non-adjacent ``(start, stop)`` pairs, in elements.

    Raises:
        ValueError: on construction from intervals that are not normalised (use
            :meth:`from_intervals` for arbitrary input).
    """

    intervals: Tuple[Interval, ...] = ()

    def __post_init__(self):
        prev_stop = None
        for start, stop in self.intervals:
            if not (0 <= start < stop):
                raise ValueError(f"invalid interval [{start}, {stop}) in region")
            if prev_stop is not None and start <= prev_stop:
                raise ValueError("region intervals must be sorted, disjoint and non-adjacent")
            prev_stop = stop

    @staticmethod
    def from_intervals(intervals: Iterable[Sequence[int]]) -> "Region":
        """Build a region from any intervals (unsorted, overlapping, empty ones allowed)."""
        arr = np.asarray(list(intervals), dtype=np.int64).reshape(-1, 2)
        if arr.size and (arr < 0).any():
            raise ValueError("region intervals must be non-negative")
        return Region._from_array(_normalise(arr))

    @staticmethod
    def _from_array(arr: np.ndarray) -> "Region":
        return Region(tuple((int(a), int(b)) for a, b in arr))

    @staticmethod
    def full(numel: int) -> "Region":
        return Region(((0, int(numel)),) if numel > 0 else ())

    @staticmethod
    def box(shape: Sequence[int], starts: Sequence[int], sizes: Sequence[int]) -> "Region":
        """The elements of the box ``[starts, starts + sizes)`` of a tensor of ``shape`` (row-major).

        A box is one interval per combination of its leading indices; the trailing dimensions that
        the box covers whole are merged into one run.
        """
        shape, starts, sizes = list(shape), list(starts), list(sizes)
        if not (len(shape) == len(starts) == len(sizes)):
            raise ValueError("box: shape, starts and sizes must have the same rank")
        for d, (n, s, k) in enumerate(zip(shape, starts, sizes)):
            if s < 0 or k < 0 or s + k > n:
                raise ValueError(f"box: dimension {d}: [{s}, {s + k}) outside [0, {n})")
        if not shape:
            return Region.full(1)
        if any(k == 0 for k in sizes):
            return Region()
        strides = np.cumprod([1] + shape[::-1])[:-1][::-1]
        # the innermost contiguous run: trailing dims covered whole, plus the first partial one
        d = len(shape) - 1
        while d > 0 and starts[d] == 0 and sizes[d] == shape[d]:
            d -= 1
        run = int(sizes[d] * strides[d])
        base = np.zeros(1, dtype=np.int64)
        for axis in range(d):
            idx = np.arange(starts[axis], starts[axis] + sizes[axis], dtype=np.int64) * strides[axis]
            base = (base[:, None] + idx[None, :]).reshape(-1)
        base = base + starts[d] * strides[d]
        return Region._from_array(_normalise(np.stack([base, base + run], axis=1)))

    def as_array(self) -> np.ndarray:
        return np.asarray(self.intervals, dtype=np.int64).reshape(-1, 2)

    @property
    def size(self) -> int:
        """Number of elements covered."""
        return sum(b - a for a, b in self.intervals)

    def __bool__(self) -> bool:
        return bool(self.intervals)

    def union(self, other: "Region") -> "Region":
        return Region._from_array(_normalise(np.concatenate([self.as_array(), other.as_array()])))

    def intersection(self, other: "Region") -> "Region":
        a, b = self.as_array(), other.as_array()
        if a.shape[0] == 0 or b.shape[0] == 0:
            return Region()
        # candidate pairs: for each interval of a, the intervals of b that can overlap it
        lo = np.searchsorted(b[:, 1], a[:, 0], side="right")
        hi = np.searchsorted(b[:, 0], a[:, 1], side="left")
        counts = np.maximum(hi - lo, 0)
        if counts.sum() == 0:
            return Region()
        ai = np.repeat(np.arange(a.shape[0]), counts)
        offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        bi = np.repeat(lo, counts) + offsets
        starts = np.maximum(a[ai, 0], b[bi, 0])
        stops = np.minimum(a[ai, 1], b[bi, 1])
        return Region._from_array(_normalise(np.stack([starts, stops], axis=1)))

    def difference(self, other: "Region") -> "Region":
        a, b = self.as_array(), other.as_array()
        if a.shape[0] == 0 or b.shape[0] == 0:
            return self
        # complement of b within [0, max stop of a), then intersect
        end = int(max(a[-1, 1], b[-1, 1]))
        gaps_start = np.concatenate([[0], b[:, 1]])
        gaps_stop = np.concatenate([b[:, 0], [end]])
        complement = Region._from_array(_normalise(np.stack([gaps_start, gaps_stop], axis=1)))
        return self.intersection(complement)

    def to_dict(self) -> list:
        return [list(iv) for iv in self.intervals]

    @staticmethod
    def from_dict(data: list) -> "Region":
        return Region(tuple((int(a), int(b)) for a, b in data))
