"""The routing planner: what every rank keeps, sends and receives when a ZeRO layout changes.

Pure metadata work (DynaTrain §"Virtual Parameter Space"): for each parameter, the fragments of
the old layout and of the new one are intersected along the parameter's flattening; each
non-empty intersection is one *transfer* from an old rank's partition to a new rank's partition.
A transfer whose two ends are the same process is a *keep* (a local copy). Adjacent transfers
between the same pair of ranks are merged, so the plan's size grows with the number of
fragments, not of elements. The intersection is computed over numpy columns
(:mod:`~ds_dynatrain.planner.intersect`), and the plan keeps its transfers as one table. The
planner knows nothing of tensors, process groups or bytes; the transition engine executes a plan
without interpreting it.

Processes are named by *member ids* (stable across generations): ``old_members[r]`` is the
process that was old rank ``r``, ``new_members[r]`` the one that becomes new rank ``r``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..vps.layout import ZeroLayout
from .intersect import COLUMNS, WIDTH, shared_transfer_table

PLAN_FORMAT_VERSION = 2


class _TransferFields(NamedTuple):
    src: int
    dst: int
    group: int
    src_offset: int
    dst_offset: int
    numel: int
    dst_group: int


class Transfer(_TransferFields):
    """Elements moving from one old rank's partition to one new rank's partition (elements).

    An immutable, ordered tuple: one row of a :class:`Plan`'s table, built only where a process
    asks for its own rows (a plan of a 405B-parameter ZeRO-3 model holds millions of rows).

    Attributes:
        src: old rank.  dst: new rank.
        group: partition index in the old layout (parameter group at ZeRO stages 1/2, sub-group
            at stage 3).
        src_offset: offset in ``src``'s old flat partition ``group``.
        dst_offset: offset in ``dst``'s new flat partition ``dst_group``.
        numel: number of elements.
        dst_group: partition index in the new layout; defaults to ``group`` (stages 1/2, where
            partitions are parameter groups; stage-3 sub-groups depend on the world size).
    """

    __slots__ = ()

    def __new__(
        cls,
        src: int,
        dst: int,
        group: int,
        src_offset: int,
        dst_offset: int,
        numel: int,
        dst_group: Optional[int] = None,
    ):
        return super().__new__(
            cls, src, dst, group, src_offset, dst_offset, numel, group if dst_group is None else dst_group
        )


def check_members(old_members, new_members, old_world_size: int, new_world_size: int) -> None:
    """Raise ``ValueError`` unless each member list names one process per rank, none twice."""
    if len(old_members) != old_world_size:
        raise ValueError("old_members must name one process per old rank")
    if len(new_members) != new_world_size:
        raise ValueError("new_members must name one process per new rank")
    if len(set(new_members)) != len(new_members) or len(set(old_members)) != len(old_members):
        raise ValueError("a process can hold only one rank per generation")


@dataclass(frozen=True, eq=False)
class Plan:
    """A deterministic, serialisable plan of one transition.

    Attributes:
        old_layout, new_layout: the two layouts (same model).
        old_members, new_members: member id of each old and new rank.
        table: every transfer as one row of an int64 array of shape ``(n, 7)``, columns as
            :class:`Transfer`'s fields, rows sorted by ``(src, dst, group, src_offset)``; keeps
            included. Read-only, each column contiguous (Fortran order). Given as an array or a
            sequence of transfers.

    A plan of a large model holds millions of transfers (Llama-3-405B under ZeRO-3, 4,096 to
    3,072 ranks: about 7 million), so they are kept as one array: the statistics and the
    per-member views (:meth:`sends_of`, ...) are array operations, and :class:`Transfer`
    objects are built only for the rows a member asks for. :attr:`transfers` builds them all
    (for small plans and tests).

    Raises:
        ValueError: a member list does not name one process per rank, a process holds two
            ranks of one generation, or ``table`` is not ``(n, 7)``.
    """

    old_layout: ZeroLayout
    new_layout: ZeroLayout
    old_members: Tuple[str, ...]
    new_members: Tuple[str, ...]
    table: np.ndarray

    def __post_init__(self):
        check_members(self.old_members, self.new_members, self.old_layout.world_size, self.new_layout.world_size)
        table = np.asarray(self.table, dtype=np.int64)
        if table.size == 0:
            table = table.reshape(0, WIDTH)
        if table.ndim != 2 or table.shape[1] != WIDTH:
            raise ValueError(f"a plan's table has {WIDTH} columns {COLUMNS}, got shape {table.shape}")
        table = np.asfortranarray(table).view()  # columns contiguous (no copy when they are)
        table.flags.writeable = False
        object.__setattr__(self, "table", table)
        # for each old rank, its process's new rank (or -1): a transfer is a keep when its
        # destination is that rank
        new_rank = {m: r for r, m in enumerate(self.new_members)}
        stay = np.asarray([new_rank.get(m, -1) for m in self.old_members], dtype=np.int64)
        keep = stay[table[:, 0]] == table[:, 1]
        keep.flags.writeable = False
        object.__setattr__(self, "_keep", keep)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (
            (self.old_layout, self.new_layout, self.old_members, self.new_members)
            == (other.old_layout, other.new_layout, other.old_members, other.new_members)
        ) and np.array_equal(self.table, other.table)

    def __hash__(self) -> int:
        return hash((self.old_layout, self.new_layout, self.old_members, self.new_members, len(self.table)))

    @cached_property
    def transfers(self) -> Tuple[Transfer, ...]:
        """Every transfer as a :class:`Transfer`, in table order (one Python object per row:
        for small plans; large ones are read through :attr:`table` and the member views)."""
        return tuple(map(Transfer._make, self.table.tolist()))

    @property
    def keep_mask(self) -> np.ndarray:
        """Per row of :attr:`table`, whether it is a keep (bool, read-only)."""
        return self._keep

    def is_keep(self, t: Transfer) -> bool:
        return self.old_members[t.src] == self.new_members[t.dst]

    @property
    def numel_kept(self) -> int:
        return int(self.table[self._keep, 5].sum())

    @property
    def numel_moved(self) -> int:
        return int(self.table[~self._keep, 5].sum())

    @property
    def joiners(self) -> Tuple[str, ...]:
        old = set(self.old_members)
        return tuple(m for m in self.new_members if m not in old)

    @property
    def survivor_ranks(self) -> Tuple[int, ...]:
        """New ranks of the processes that were in the old world too, in old-rank order."""
        new = {m: r for r, m in enumerate(self.new_members)}
        return tuple(new[m] for m in self.old_members if m in new)

    @property
    def leavers(self) -> Tuple[str, ...]:
        new = set(self.new_members)
        return tuple(m for m in self.old_members if m not in new)

    def _src_rows(self, member: str) -> slice:
        """The rows sent by ``member``'s old rank (contiguous: the table is sorted by ``src``)."""
        if member not in self.old_members:
            return slice(0, 0)
        r = self.old_members.index(member)
        src = self.table[:, 0]
        return slice(int(np.searchsorted(src, r, "left")), int(np.searchsorted(src, r, "right")))

    @staticmethod
    def _by_peer(rows: np.ndarray, peer_col: int, names: Tuple[str, ...]) -> Dict[str, List[Transfer]]:
        out: Dict[str, List[Transfer]] = {}
        for row in rows.tolist():
            out.setdefault(names[row[peer_col]], []).append(Transfer._make(row))
        return out

    def sends_of(self, member: str) -> Dict[str, List[Transfer]]:
        """Transfers ``member`` sends to other processes, by receiving member, in plan order."""
        rows = self._src_rows(member)
        return self._by_peer(self.table[rows][~self._keep[rows]], 1, self.new_members)

    def receives_of(self, member: str) -> Dict[str, List[Transfer]]:
        """Transfers ``member`` receives from other processes, by sending member, in plan order."""
        if member not in self.new_members:
            return {}
        mask = (self.table[:, 1] == self.new_members.index(member)) & ~self._keep
        return self._by_peer(self.table[mask], 0, self.old_members)

    def keeps_of(self, member: str) -> List[Transfer]:
        rows = self._src_rows(member)
        return list(map(Transfer._make, self.table[rows][self._keep[rows]].tolist()))

    def rows_into(self, member: str) -> np.ndarray:
        """The rows of :attr:`table` whose destination is ``member``'s new rank (keeps and
        receives; a copy, in plan order); empty when ``member`` is not in the new world."""
        if member not in self.new_members:
            return np.empty((0, WIDTH), dtype=np.int64)
        return self.table[self.table[:, 1] == self.new_members.index(member)]

    def _header(self) -> dict:
        return {
            "version": PLAN_FORMAT_VERSION,
            "old_layout": self.old_layout.to_dict(),
            "new_layout": self.new_layout.to_dict(),
            "old_members": list(self.old_members),
            "new_members": list(self.new_members),
        }

    def to_dict(self) -> dict:
        return {**self._header(), "transfers": self.table.tolist()}

    @staticmethod
    def from_dict(d: dict) -> "Plan":
        if d.get("version") != PLAN_FORMAT_VERSION:
            raise ValueError(f"plan format version {d.get('version')!r} is not {PLAN_FORMAT_VERSION}")
        return Plan(
            ZeroLayout.from_dict(d["old_layout"]),
            ZeroLayout.from_dict(d["new_layout"]),
            tuple(d["old_members"]),
            tuple(d["new_members"]),
            np.asarray(d["transfers"], dtype=np.int64).reshape(-1, WIDTH),
        )

    def digest(self) -> str:
        """SHA-256 of the canonical JSON form of everything but the transfers, then of the
        transfer table's bytes (int64, little-endian, column after column); equal on every rank for the
        same plan. (The table's bytes rather than its JSON text: a fraction of a second for a
        plan of millions of transfers, where the text took over a minute.)"""
        h = hashlib.sha256(json.dumps(self._header(), sort_keys=True, separators=(",", ":")).encode())
        h.update(np.ascontiguousarray(self.table.T, dtype="<i8").data)
        return h.hexdigest()


def plan_transition(
    old: ZeroLayout, new: ZeroLayout, old_members: Sequence[str], new_members: Sequence[str], same_settings: bool = True
) -> Plan:
    """Intersect two layouts of the same model into a :class:`Plan`.

    Args:
        old, new: layouts of the same parameters (any world sizes).
        old_members, new_members: member id per old / new rank.
        same_settings: also require the same ZeRO stage family and settings (a resize of a
            running job); False for loading a checkpoint into another ZeRO configuration.

    Raises:
        LayoutMismatchError: the layouts describe different parameters (names the first one).
    """
    old.check_same_model(new, settings=same_settings)
    return Plan(old, new, tuple(old_members), tuple(new_members), shared_transfer_table(old, new))


def scalars_for(plan: Plan, scalars: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The non-partition optimizer states (Adam's ``step``) of each new partition of ``plan``
    (:func:`scalars_between` its two layouts)."""
    return scalars_between(plan.old_layout, plan.new_layout, scalars)


def scalars_between(old: ZeroLayout, new: ZeroLayout, scalars: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The non-partition optimizer states (Adam's ``step``) of each partition of ``new``, from
    those of ``old``'s partitions (``scalars[b]`` for old partition ``b``): a new partition takes
    those of the first old partition of its parameter group. At stages 1/2 partitions are the
    parameter groups; at stage 3 the sub-groups change with the world size (and with the TP
    shards' shapes).

    Returns:
        One dict per partition of ``new`` (the same objects, not copies).

    Raises:
        ValueError: ``scalars`` does not hold one entry per old partition.
    """
    if len(scalars) != old.num_partitions:
        raise ValueError(f"{len(scalars)} scalar sets for the {old.num_partitions} partitions of the old layout")
    first: Dict[int, Dict[str, Any]] = {}
    for b in range(old.num_partitions):
        first.setdefault(old.partition_group(b), scalars[b])
    return [first[new.partition_group(b)] for b in range(new.num_partitions)]
