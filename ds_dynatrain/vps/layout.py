"""ZeRO stage 1, 2 and 3 layouts computed from parameter metadata alone.

A layout is the function ``rank -> fragments``: for every rank, which element interval of which
parameter it holds in its flat partition, and where (the *local address*). It is computed from
shapes, dtypes, parameter-group membership and the ZeRO settings, with no process group and no
tensors, so the layout of a world that does not exist yet can be planned against.

What DeepSpeed builds (``deepspeed/runtime/zero/stage_1_and_2.py``, ``DeepSpeedZeroOptimizer``
constructor, deepspeed 0.19.8), reproduced here and proven against real engines in
``tests/test_layout_vs_deepspeed.py``:

1. each optimizer parameter group keeps its trainable, non-empty parameters in group order;
   ``round_robin_gradients`` reorders them so parameter ``i`` goes to bucket ``i % world_size``,
   buckets concatenated in bucket order;
2. with ``parameter_alignment`` every parameter but the last is followed by padding up to
   ``16 / gcd(16, element_size)`` elements (no padding otherwise);
3. the flat group is padded at the end to a multiple of ``2 * world_size`` elements
   (``nccl_start_alignment_factor`` is 2) and cut into ``world_size`` equal partitions; rank ``r``
   holds ``[r * P, (r + 1) * P)`` with ``P = padded_numel / world_size``.

ZeRO-3 (``deepspeed/runtime/zero/partition_parameters.py`` ``_aligned_size`` / ``_partition``
and ``stage3.py`` ``_create_fp16_sub_groups``, deepspeed 0.19.8), proven the same way:

1. every parameter is partitioned on its own: padded to a multiple of ``world_size`` elements
   and cut into ``world_size`` equal pieces of ``P = ceil(numel / world_size)``; rank ``r`` holds
   ``[r * P, min((r + 1) * P, numel))`` (the last ranks hold padding, or nothing);
2. each optimizer parameter group's trainable parameters, in group order, are cut into
   *sub-groups*: a sub-group ends after the parameter that brings its running sum of ``P`` to
   ``sub_group_size`` or more, or after the group's last parameter (one sub-group when the
   group's sum of ``P`` is at most ``sub_group_size``);
3. each sub-group has one flat fp32 partition per rank (the optimizer's unit): the parameters'
   pieces of ``P`` elements, concatenated in sub-group order.

So a *partition* (a flat buffer, the ``group`` of a :class:`Fragment`) is a parameter group at
stages 1/2 and a sub-group at stage 3. Sub-groups depend on the world size, so the same
parameter can sit in partition 0 of one layout and partition 1 of another.

Padding never belongs to a parameter, so it never appears in a fragment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import LayoutMismatchError
from .region import Region

NCCL_START_ALIGNMENT_FACTOR = 2
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default


@dataclass(frozen=True)
class ParamMeta:
    """One trainable parameter as a layout sees it.

    Attributes:
        key: VPS key, the parameter's name as ``model.named_parameters()`` gives it (tied
            parameters appear once, under their first name).
        shape: the full (unpartitioned) shape.
        dtype: name of the working (low-precision) dtype, e.g. ``"float32"``, ``"bfloat16"``.
    """

    key: str
    shape: Tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_dict(self) -> dict:
        return {"key": self.key, "shape": list(self.shape), "dtype": self.dtype}

    @staticmethod
    def from_dict(d: dict) -> "ParamMeta":
        return ParamMeta(str(d["key"]), tuple(int(x) for x in d["shape"]), str(d["dtype"]))


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter one rank holds in one of its flat partitions.

    Attributes (elements):
        group: partition index: the parameter group at ZeRO stages 1/2, the sub-group at stage 3.
        key: VPS key of the parameter.
        start: offset of the fragment in the parameter's row-major flattening.
        numel: fragment length.
        local: offset of the fragment in the rank's flat partition of ``group``.
    """

    group: int
    key: str
    start: int
    numel: int
    local: int


class FragmentTable(NamedTuple):
    """Every fragment of a layout as columns (one row per fragment; int64 arrays of one length),
    rows sorted by parameter (in group order) and, within a parameter, by ``start`` (which is
    rank order). The fragments of a parameter tile ``[0, numel)`` exactly: padding is never a
    fragment. At scale (a 405 B-parameter model under ZeRO-3 at 4,096 ranks has 4.7 million
    fragments) the planner works on these columns, not on :class:`Fragment` objects.

    Attributes:
        param: index of the parameter in the layout's group order (group 0 first).
        rank, partition, start, numel, local: as :class:`Fragment` (``partition`` is its
            ``group``), in elements.
    """

    param: np.ndarray
    rank: np.ndarray
    partition: np.ndarray
    start: np.ndarray
    numel: np.ndarray
    local: np.ndarray


def _ragged_arange(counts: np.ndarray) -> np.ndarray:
    """``[0, 1, .., counts[0] - 1, 0, 1, .., counts[1] - 1, ...]`` (int64)."""
    total = int(counts.sum())
    firsts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - firsts


@dataclass(frozen=True)
class _GroupGeometry:
    """Stages 1/2: one flattened parameter group, equally partitioned."""

    flat_offsets: Tuple[Tuple[str, int, int], ...]  # (key, offset in flat group, numel), flat order
    padded_numel: int
    partition_numel: int


@dataclass(frozen=True)
class _SubGroupGeometry:
    """Stage 3: one sub-group; every rank's partition holds ``piece`` elements of each parameter."""

    group: int  # the optimizer parameter group it belongs to
    params: Tuple[Tuple[str, int, int, int], ...]  # (key, numel, piece, offset in the partition)
    partition_numel: int


def zero3_sub_groups(pieces: Sequence[int], sub_group_size: Optional[int]) -> List[Tuple[int, int]]:
    """``[start, end)`` parameter index ranges of the sub-groups of one parameter group whose
    parameters have per-rank pieces ``pieces`` (DeepSpeed's ``_create_fp16_sub_groups``)."""
    n = len(pieces)
    if sub_group_size is None or sub_group_size >= sum(pieces):
        return [(0, n)] if n else []
    out, start, run = [], 0, 0
    for i, k in enumerate(pieces):
        run += k
        if run >= sub_group_size or i == n - 1:
            out.append((start, i + 1))
            start, run = i + 1, 0
    return out


def round_robin_order(n_params: int, world_size: int) -> List[int]:
    """Indices of a group's parameters in DeepSpeed's ``_round_robin_reorder`` order."""
    buckets: Dict[int, List[int]] = {}
    for i in range(n_params):
        buckets.setdefault(i % world_size, []).append(i)
    return [i for b in buckets for i in buckets[b]]


@dataclass(frozen=True)
class ZeroLayout:
    """The ZeRO layout of a model at one data-parallel world size (stages 1, 2 and 3).

    Attributes:
        world_size: data-parallel world size (> 0).
        groups: per optimizer parameter group, its trainable parameters in group order.
        round_robin: DeepSpeed's ``zero_optimization.round_robin_gradients`` (stages 1/2).
        parameter_alignment: DeepSpeed's ``zero_optimization.parameter_alignment`` (stages 1/2).
        stage: ZeRO stage, 1, 2 (same geometry) or 3.
        sub_group_size: DeepSpeed's ``zero_optimization.sub_group_size`` (stage 3; elements).

    Raises:
        ValueError: world size < 1, an empty group, a stage other than 1, 2 or 3, or a VPS key
            that appears twice (the planner and :meth:`region` find a parameter by its key).
    """

    world_size: int
    groups: Tuple[Tuple[ParamMeta, ...], ...]
    round_robin: bool = False
    parameter_alignment: bool = False
    stage: int = 2
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    _geometry: Tuple = field(init=False, repr=False, compare=False, hash=False)
    _where: Dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeroLayout covers ZeRO stages 1, 2 and 3, got stage {self.stage}")
        seen = {}
        for gi, params in enumerate(self.groups):
            for p in params:
                if p.key in seen:
                    raise ValueError(
                        f"parameter {p.key} appears twice in the layout (groups {seen[p.key]} "
                        f"and {gi}); a VPS key names one logical tensor"
                    )
                seen[p.key] = gi
            if not params:
                raise ValueError(f"parameter group {gi} has no trainable parameter")
        geometry = self._zero3_geometry() if self.stage == 3 else self._zero12_geometry()
        object.__setattr__(self, "_geometry", geometry)
        where = {}  # key -> (partition, index of the parameter in it)
        for b, geo in enumerate(geometry):
            items = geo.params if self.stage == 3 else geo.flat_offsets
            for i, item in enumerate(items):
                where[item[0]] = (b, i)
        object.__setattr__(self, "_where", where)

    def _zero12_geometry(self) -> Tuple[_GroupGeometry, ...]:
        geometry = []
        for params in self.groups:
            order = round_robin_order(len(params), self.world_size) if self.round_robin else range(len(params))
            elsize = params[0].element_size
            param_alignment = 16 // math.gcd(16, elsize) if self.parameter_alignment else 1
            offsets, cur = [], 0
            ordered = [params[i] for i in order]
            for idx, p in enumerate(ordered):
                offsets.append((p.key, cur, p.numel))
                cur += p.numel
                if idx != len(ordered) - 1:
                    cur += (-cur) % param_alignment
            alignment = NCCL_START_ALIGNMENT_FACTOR * self.world_size
            padded = int(math.ceil(cur / alignment)) * alignment
            geometry.append(_GroupGeometry(tuple(offsets), padded, padded // self.world_size))
        return tuple(geometry)

    def _zero3_geometry(self) -> Tuple[_SubGroupGeometry, ...]:
        geometry = []
        for gi, params in enumerate(self.groups):
            pieces = [-(-p.numel // self.world_size) for p in params]
            for lo, hi in zero3_sub_groups(pieces, self.sub_group_size):
                entries, pos = [], 0
                for p, k in zip(params[lo:hi], pieces[lo:hi]):
                    entries.append((p.key, p.numel, k, pos))
                    pos += k
                geometry.append(_SubGroupGeometry(gi, tuple(entries), pos))
        return tuple(geometry)

    def partition_numel(self, partition: int) -> int:
        """Elements in every rank's flat partition ``partition`` (padding included)."""
        return self._geometry[partition].partition_numel

    @property
    def num_groups(self) -> int:
        """Optimizer parameter groups."""
        return len(self.groups)

    @property
    def num_partitions(self) -> int:
        """Flat partitions per rank: parameter groups (stages 1/2) or sub-groups (stage 3)."""
        return len(self._geometry)

    def partition_group(self, partition: int) -> int:
        """The optimizer parameter group partition ``partition`` belongs to."""
        return self._geometry[partition].group if self.stage == 3 else partition

    def partition_keys(self, partition: int) -> Tuple[str, ...]:
        """VPS keys of the parameters in ``partition``, in the order they lie in it."""
        geo = self._geometry[partition]
        return tuple(e[0] for e in (geo.params if self.stage == 3 else geo.flat_offsets))

    def fragments(self, rank: int) -> Tuple[Fragment, ...]:
        """Every fragment ``rank`` holds, sorted by (partition, local offset)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out = []
        for b, geo in enumerate(self._geometry):
            if self.stage == 3:
                for key, numel, piece, local in geo.params:
                    lo, hi = rank * piece, min((rank + 1) * piece, numel)
                    if lo < hi:
                        out.append(Fragment(b, key, lo, hi - lo, local))
                continue
            lo_p, hi_p = rank * geo.partition_numel, (rank + 1) * geo.partition_numel
            for key, off, numel in geo.flat_offsets:
                lo, hi = max(off, lo_p), min(off + numel, hi_p)
                if lo < hi:
                    out.append(Fragment(b, key, lo - off, hi - lo, lo - lo_p))
        return tuple(out)

    def param_fragments(self, group: int, key: str) -> Tuple[Tuple[int, Fragment], ...]:
        """``(rank, fragment)`` for every rank holding part of ``key`` (a parameter of optimizer
        parameter group ``group``), in parameter order.

        Raises:
            KeyError: ``key`` is not a parameter of ``group``.
        """
        return tuple((r, Fragment(b, key, start, n, local)) for r, b, start, n, local in self.pieces(group, key))

    def pieces(self, group: int, key: str) -> List[Tuple[int, int, int, int, int]]:
        """:meth:`param_fragments` as plain tuples ``(rank, partition, start, numel, local)``
        (the planner's inner loop; no objects built).

        Raises:
            KeyError: ``key`` is not a parameter of ``group``.
        """
        b, i = self._where.get(key, (None, None))
        if b is None or self.partition_group(b) != group:
            raise KeyError(f"parameter {key!r} is not in group {group}")
        geo = self._geometry[b]
        if self.stage == 3:
            _, numel, piece, local = geo.params[i]
            return [
                (r, b, r * piece, min(piece, numel - r * piece), local)
                for r in range(min(self.world_size, -(-numel // piece)))
            ]
        _, off, numel = geo.flat_offsets[i]
        P = geo.partition_numel
        out = []
        for r in range(off // P, min((off + numel - 1) // P, self.world_size - 1) + 1):
            lo, hi = max(off, r * P), min(off + numel, (r + 1) * P)
            if lo < hi:
                out.append((r, b, lo - off, hi - lo, lo - r * P))
        return out

    def param_numels(self) -> np.ndarray:
        """Elements of every parameter, in group order (int64, one per parameter)."""
        return np.asarray([p.numel for g in self.groups for p in g], dtype=np.int64)

    def param_geometry(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per parameter in group order (int64 arrays, elements): its partition; where it lies
        (stage 3: its offset in every rank's partition; stages 1/2: its offset in the flat
        group); and the cut size (stage 3: its per-rank piece; stages 1/2: the partition size)."""
        n = sum(len(g) for g in self.groups)
        part = np.empty(n, dtype=np.int64)
        where = np.empty(n, dtype=np.int64)
        size = np.empty(n, dtype=np.int64)
        for j, key in enumerate(p.key for g in self.groups for p in g):
            b, i = self._where[key]
            geo = self._geometry[b]
            part[j] = b
            if self.stage == 3:
                _, _, size[j], where[j] = geo.params[i]
            else:
                where[j], size[j] = geo.flat_offsets[i][1], geo.partition_numel
        return part, where, size

    def fragment_table(self) -> FragmentTable:
        """Every fragment of every rank as columns (:class:`FragmentTable`), vectorised: the
        cost is a few numpy passes over the fragments, whose number is about parameters x world
        size at stage 3 and parameters + world size at stages 1/2. The same fragments as
        :meth:`fragments` and :meth:`pieces`, in another order."""
        numel = self.param_numels()
        part, where, size = self.param_geometry()
        param = np.arange(numel.shape[0], dtype=np.int64)
        if self.stage == 3:
            # rank r holds [r * piece, min((r + 1) * piece, numel)) at the parameter's local offset
            counts = np.where(numel > 0, -(-numel // np.maximum(size, 1)), 0)
            rank = _ragged_arange(counts)
            param = np.repeat(param, counts)
            piece = size[param]
            start = rank * piece
            n = np.minimum(piece, numel[param] - start)
            return FragmentTable(param, rank, part[param], start, n, where[param])
        # stages 1/2: rank r holds [max(off, r P), min(off + numel, (r + 1) P)) of the flat group
        cut = np.maximum(size, 1)  # a group of only empty parameters has partitions of 0
        first = where // cut
        counts = np.where(numel > 0, (where + numel - 1) // cut - first + 1, 0)
        param = np.repeat(param, counts)
        rank = first[param] + _ragged_arange(counts)
        off, P = where[param], size[param]
        lo = np.maximum(off, rank * P)
        hi = np.minimum(off + numel[param], (rank + 1) * P)
        return FragmentTable(param, rank, part[param], lo - off, hi - lo, lo - rank * P)

    def region(self, rank: int, key: str) -> Region:
        """The region of parameter ``key`` that ``rank`` holds."""
        return Region.from_intervals((f.start, f.start + f.numel) for f in self.fragments(rank) if f.key == key)

    def with_world_size(self, world_size: int) -> "ZeroLayout":
        """The same model and settings at another world size."""
        return ZeroLayout(
            world_size, self.groups, self.round_robin, self.parameter_alignment, self.stage, self.sub_group_size
        )

    def check_same_model(self, other: "ZeroLayout", settings: bool = True) -> None:
        """Raise :class:`LayoutMismatchError` naming the first parameter that differs; with
        ``settings`` also when the ZeRO settings or working dtypes differ (stage 3 against 1/2,
        round robin, alignment, sub-group size)."""
        if self.num_groups != other.num_groups:
            raise LayoutMismatchError(f"layouts have {self.num_groups} and {other.num_groups} parameter groups")
        for gi, (a, b) in enumerate(zip(self.groups, other.groups)):
            for pa, pb in zip(a, b):
                if (pa != pb) if settings else ((pa.key, pa.shape) != (pb.key, pb.shape)):
                    raise LayoutMismatchError(
                        f"parameter group {gi}: {pa.key} {list(pa.shape)} {pa.dtype} differs from "
                        f"{pb.key} {list(pb.shape)} {pb.dtype}"
                    )
            if len(a) != len(b):
                longer = a if len(a) > len(b) else b
                first = longer[min(len(a), len(b))]
                raise LayoutMismatchError(f"parameter group {gi}: parameter {first.key} is present in only one layout")
        if not settings:
            return
        if self.stage != other.stage and 3 in (self.stage, other.stage):
            raise LayoutMismatchError(
                f"layouts of ZeRO stages {self.stage} and {other.stage}: a stage-3 "
                "partition is not a stage-1/2 partition"
            )
        if (self.round_robin, self.parameter_alignment) != (other.round_robin, other.parameter_alignment):
            raise LayoutMismatchError("layouts differ in round_robin_gradients or parameter_alignment")
        if self.stage == 3 and self.sub_group_size != other.sub_group_size:
            raise LayoutMismatchError(
                f"layouts differ in sub_group_size ({self.sub_group_size} and {other.sub_group_size})"
            )

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "stage": self.stage,
            "round_robin": self.round_robin,
            "parameter_alignment": self.parameter_alignment,
            "sub_group_size": self.sub_group_size,
            "groups": [[p.to_dict() for p in g] for g in self.groups],
        }

    @staticmethod
    def from_dict(d: dict) -> "ZeroLayout":
        return ZeroLayout(
            int(d["world_size"]),
            tuple(tuple(ParamMeta.from_dict(p) for p in g) for g in d["groups"]),
            bool(d["round_robin"]),
            bool(d["parameter_alignment"]),
            int(d["stage"]),
            int(d.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)),
        )


def param_metas_from_groups(
    named_params: Sequence[Tuple[str, torch.nn.Parameter]], groups: Sequence[Sequence[torch.nn.Parameter]]
) -> Tuple[Tuple[ParamMeta, ...], ...]:
    """Describe optimizer groups of live parameters as :class:`ParamMeta` tuples.

    Args:
        named_params: ``model.named_parameters()`` (tied parameters appear once).
        groups: per group, the parameters in group order; frozen and empty ones are skipped, as
            DeepSpeed skips them (``deepspeed.runtime.utils.is_optimized_parameter``). A ZeRO-3
            parameter is described by its full shape (``ds_shape``), not its empty local data.

    Raises:
        LayoutMismatchError: a group holds a parameter that is not in the model.
    """
    names = {id(p): n for n, p in named_params}
    out = []
    for gi, params in enumerate(groups):
        metas = []
        for p in params:
            shape = tuple(getattr(p, "ds_shape", p.shape))
            if not p.requires_grad or math.prod(shape) == 0:
                continue
            if id(p) not in names:
                raise LayoutMismatchError(f"parameter group {gi} holds a parameter that is not in the model")
            metas.append(ParamMeta(names[id(p)], shape, str(p.dtype).replace("torch.", "")))
        out.append(tuple(metas))
    return tuple(out)
