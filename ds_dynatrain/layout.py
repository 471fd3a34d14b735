"""ZeRO stage 1/2 layouts computed from parameter metadata alone.

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

Padding never belongs to a parameter, so it never appears in a fragment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

from .errors import LayoutMismatchError
from .region import Region

NCCL_START_ALIGNMENT_FACTOR = 2


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
    """The part of one parameter one rank holds in its flat partition of one group.

    Attributes (elements):
        group: parameter-group index.
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


@dataclass(frozen=True)
class _GroupGeometry:
    flat_offsets: Tuple[Tuple[str, int, int], ...]  # (key, offset in flat group, numel), flat order
    padded_numel: int
    partition_numel: int


def round_robin_order(n_params: int, world_size: int) -> List[int]:
    """Indices of a group's parameters in DeepSpeed's ``_round_robin_reorder`` order."""
    buckets: Dict[int, List[int]] = {}
    for i in range(n_params):
        buckets.setdefault(i % world_size, []).append(i)
    return [i for b in buckets for i in buckets[b]]


@dataclass(frozen=True)
class ZeroLayout:
    """The ZeRO-1/2 layout of a model at one data-parallel world size.

    Attributes:
        world_size: data-parallel world size (> 0).
        groups: per optimizer parameter group, its trainable parameters in group order.
        round_robin: DeepSpeed's ``zero_optimization.round_robin_gradients``.
        parameter_alignment: DeepSpeed's ``zero_optimization.parameter_alignment``.
        stage: ZeRO stage, 1 or 2 (same geometry).

    Raises:
        ValueError: world size < 1, an empty group, a stage other than 1 or 2, or a VPS key that
            appears twice (the planner and :meth:`region` find a parameter by its key).
    """

    world_size: int
    groups: Tuple[Tuple[ParamMeta, ...], ...]
    round_robin: bool = False
    parameter_alignment: bool = False
    stage: int = 2
    _geometry: Tuple[_GroupGeometry, ...] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.stage not in (1, 2):
            raise ValueError(f"ZeroLayout covers ZeRO stages 1 and 2, got stage {self.stage}")
        geometry, seen = [], {}
        for gi, params in enumerate(self.groups):
            for p in params:
                if p.key in seen:
                    raise ValueError(f"parameter {p.key} appears twice in the layout (groups {seen[p.key]} "
                                     f"and {gi}); a VPS key names one logical tensor")
                seen[p.key] = gi
            if not params:
                raise ValueError(f"parameter group {gi} has no trainable parameter")
            order = (round_robin_order(len(params), self.world_size) if self.round_robin else range(len(params)))
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
        object.__setattr__(self, "_geometry", tuple(geometry))

    def partition_numel(self, group: int) -> int:
        """Elements in every rank's flat partition of ``group`` (padding included)."""
        return self._geometry[group].partition_numel

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def fragments(self, rank: int) -> Tuple[Fragment, ...]:
        """Every fragment ``rank`` holds, sorted by (group, local offset)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        out = []
        for gi, geo in enumerate(self._geometry):
            lo_p, hi_p = rank * geo.partition_numel, (rank + 1) * geo.partition_numel
            for key, off, numel in geo.flat_offsets:
                lo, hi = max(off, lo_p), min(off + numel, hi_p)
                if lo < hi:
                    out.append(Fragment(gi, key, lo - off, hi - lo, lo - lo_p))
        return tuple(out)

    def param_fragments(self, group: int, key: str) -> Tuple[Tuple[int, Fragment], ...]:
        """``(rank, fragment)`` for every rank holding part of ``key``, in parameter order."""
        geo = self._geometry[group]
        P = geo.partition_numel
        for k, off, numel in geo.flat_offsets:
            if k == key:
                out = []
                for r in range(off // P, min((off + numel - 1) // P, self.world_size - 1) + 1):
                    lo, hi = max(off, r * P), min(off + numel, (r + 1) * P)
                    if lo < hi:
                        out.append((r, Fragment(group, key, lo - off, hi - lo, lo - r * P)))
                return tuple(out)
        raise KeyError(f"parameter {key!r} is not in group {group}")

    def region(self, rank: int, key: str) -> Region:
        """The region of parameter ``key`` that ``rank`` holds."""
        return Region.from_intervals((f.start, f.start + f.numel) for f in self.fragments(rank) if f.key == key)

    def with_world_size(self, world_size: int) -> "ZeroLayout":
        """The same model and settings at another world size."""
        return ZeroLayout(world_size, self.groups, self.round_robin, self.parameter_alignment, self.stage)

    def check_same_model(self, other: "ZeroLayout") -> None:
        """Raise :class:`LayoutMismatchError` naming the first parameter that differs."""
        if self.num_groups != other.num_groups:
            raise LayoutMismatchError(
                f"layouts have {self.num_groups} and {other.num_groups} parameter groups")
        for gi, (a, b) in enumerate(zip(self.groups, other.groups)):
            for pa, pb in zip(a, b):
                if pa != pb:
                    raise LayoutMismatchError(
                        f"parameter group {gi}: {pa.key} {list(pa.shape)} {pa.dtype} differs from "
                        f"{pb.key} {list(pb.shape)} {pb.dtype}")
            if len(a) != len(b):
                longer = a if len(a) > len(b) else b
                first = longer[min(len(a), len(b))]
                raise LayoutMismatchError(f"parameter group {gi}: parameter {first.key} is present in only one layout")
        if (self.round_robin, self.parameter_alignment) != (other.round_robin, other.parameter_alignment):
            raise LayoutMismatchError("layouts differ in round_robin_gradients or parameter_alignment")

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "stage": self.stage,
            "round_robin": self.round_robin,
            "parameter_alignment": self.parameter_alignment,
            "groups": [[p.to_dict() for p in g] for g in self.groups],
        }

    @staticmethod
    def from_dict(d: dict) -> "ZeroLayout":
        return ZeroLayout(int(d["world_size"]), tuple(tuple(ParamMeta.from_dict(p) for p in g) for g in d["groups"]),
                          bool(d["round_robin"]), bool(d["parameter_alignment"]), int(d["stage"]))


def param_metas_from_groups(named_params: Sequence[Tuple[str, torch.nn.Parameter]],
                            groups: Sequence[Sequence[torch.nn.Parameter]]) -> Tuple[Tuple[ParamMeta, ...], ...]:
    """Describe optimizer groups of live parameters as :class:`ParamMeta` tuples.

    Args:
        named_params: ``model.named_parameters()`` (tied parameters appear once).
        groups: per group, the parameters in group order; frozen and empty ones are skipped, as
            DeepSpeed skips them (``deepspeed.runtime.utils.is_optimized_parameter``).

    Raises:
        LayoutMismatchError: a group holds a parameter that is not in the model.
    """
    names = {id(p): n for n, p in named_params}
    out = []
    for gi, params in enumerate(groups):
        metas = []
        for p in params:
            if not p.requires_grad or p.numel() == 0:
                continue
            if id(p) not in names:
                raise LayoutMismatchError(f"parameter group {gi} holds a parameter that is not in the model")
            metas.append(ParamMeta(names[id(p)], tuple(p.shape), str(p.dtype).replace("torch.", "")))
        out.append(tuple(metas))
    return tuple(out)
