"""A plan between two band layouts (pure): every box an old rank sends a new rank, or keeps, as
the rows of one table (:mod:`~ds_dynatrain.planner.boxes`), with its totals and digest; the
rank assignment that keeps the most in place, and a bound of what any assignment keeps."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Sequence, Tuple

import numpy as np

from .assignment import assign_by_overlap
from .boxes import TP_COLUMNS, TP_WIDTH, box_overlap_matrix
from .plan import check_members, scalars_between


@dataclass(frozen=True, eq=False)
class BoxPlan:
    """A deterministic plan of one change of a band layout (TP and DP, or PP and DP, degrees).

    Attributes:
        old_layout, new_layout: the two layouts (same model, same kind:
            :class:`~ds_dynatrain.vps.tensor_parallel.TensorParallelLayout` or
            :class:`~ds_dynatrain.vps.pipeline.PipelineLayout`).
        old_members, new_members: member id of each old and new global rank.
        table: every transfer as a row of an int64 array ``(n, 11)``, columns
            :data:`~ds_dynatrain.planner.boxes.TP_COLUMNS` (a box moving between two strided
            runs; elements), sorted by ``(src, dst, param)``; keeps included.

    Raises:
        ValueError: a member list does not name one process per rank, or names one twice.
    """

    old_layout: Any
    new_layout: Any
    old_members: Tuple[str, ...]
    new_members: Tuple[str, ...]
    table: np.ndarray

    def __post_init__(self):
        check_members(self.old_members, self.new_members, self.old_layout.world_size, self.new_layout.world_size)
        if self.table.ndim != 2 or self.table.shape[1] != TP_WIDTH:
            raise ValueError(f"a box plan's table has {TP_WIDTH} columns {TP_COLUMNS}")
        self.table.flags.writeable = False

    @cached_property
    def keep_mask(self) -> np.ndarray:
        """Per row: both ends are one process."""
        old = np.asarray(self.old_members, dtype=object)[self.table[:, 0]]
        new = np.asarray(self.new_members, dtype=object)[self.table[:, 1]]
        return old == new

    @cached_property
    def _numels(self) -> np.ndarray:
        return self.table[:, 9] * self.table[:, 10]

    @property
    def numel_kept(self) -> int:
        """Elements that stay in place (a local copy at most)."""
        return int(self._numels[self.keep_mask].sum())

    @property
    def numel_moved(self) -> int:
        """Elements sent between processes."""
        return int(self._numels[~self.keep_mask].sum())

    def per_rank(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(kept by new rank, sent by old rank, received by new rank)``: elements (int64)."""
        t, keep, n = self.table, self.keep_mask, self._numels
        kept = np.bincount(t[keep, 1], n[keep], minlength=self.new_layout.world_size).astype(np.int64)
        sent = np.bincount(t[~keep, 0], n[~keep], minlength=self.old_layout.world_size).astype(np.int64)
        recv = np.bincount(t[~keep, 1], n[~keep], minlength=self.new_layout.world_size).astype(np.int64)
        return kept, sent, recv

    def digest(self) -> str:
        """SHA-256 of the layouts' degrees, members and the table's bytes: equal on every rank for the
        same plan."""
        h = hashlib.sha256()
        head = [*self.old_layout.degrees, *self.new_layout.degrees]
        h.update(json.dumps([head, self.old_members, self.new_members]).encode())
        h.update(np.ascontiguousarray(self.table.T).astype("<i8").tobytes())
        return h.hexdigest()


def assign_box_members_best(
    old,
    new,
    old_members: Sequence[str],
    joiner_ids: Sequence[str],
    must_leave: Sequence[str] = (),
) -> Tuple[Tuple[str, ...], np.ndarray]:
    """The processes of the new ranks of band layout ``new`` (TP or pipeline) that keep the most
    elements in place, and the overlap matrix it was chosen on (``K[i, j]``, int64: elements old
    rank ``i`` holds that new rank ``j`` needs; every copy of a replicated parameter counts).

    Raises:
        LayoutMismatchError: the layouts describe different models or ZeRO settings.
        ValueError: the staying processes plus joiners cannot fill the new world exactly.
    """
    old.check_same_model(new)
    k = box_overlap_matrix(old, new)
    return assign_by_overlap(k, old_members, joiner_ids, must_leave), k


def kept_upper_bound(k: np.ndarray, must_leave_rows: Sequence[int] = ()) -> int:
    """An upper bound of the elements any assignment keeps in place, without trying them: each
    new rank keeps at most its best overlap with one old rank, and each old rank at most its
    best overlap with one new rank, so the kept elements are at most the smaller of
    ``sum_j max_i K[i, j]`` and ``sum_i max_j K[i, j]`` (rows of processes that must leave
    dropped)."""
    keep_rows = np.setdiff1d(np.arange(k.shape[0]), np.asarray(must_leave_rows, dtype=np.int64))
    k = k[keep_rows]
    if k.size == 0:
        return 0
    return int(min(k.max(axis=0).sum(), k.max(axis=1).sum()))


def band_scalars(old, old_rank: int, new, new_rank: int, scalars: list) -> list:
    """The non-partition optimizer states (Adam's ``step``) of each partition of global
    ``new_rank`` under band layout ``new``, from ``scalars`` (one per partition of old global
    ``old_rank`` under ``old``; the same objects are returned).

    A pipeline stage's partitions are its optimizer groups that hold some of its parameters
    (ZeRO-1): a new partition takes the states of the old partition of the same optimizer group,
    or the first old partition's where the old stage held none of that group (every group steps
    at every optimizer step). Otherwise (AutoTP: every TP rank has the same groups; ZeRO-3
    sub-groups) :func:`~ds_dynatrain.planner.plan.scalars_between`.

    Raises:
        ValueError: ``scalars`` does not hold one entry per old partition.
    """
    if not hasattr(new, "optimizer_group_ids"):
        return scalars_between(old.zero_of(old_rank), new.zero_of(new_rank), scalars)
    old_ids = old.optimizer_group_ids(old_rank)
    if len(scalars) != len(old_ids):
        raise ValueError(f"{len(scalars)} scalar sets for the {len(old_ids)} partitions of the old stage")
    by_group = dict(zip(old_ids, scalars))
    return [by_group.get(g, scalars[0]) for g in new.optimizer_group_ids(new_rank)]
