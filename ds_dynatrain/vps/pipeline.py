"""Pipeline-parallel (DeepSpeed ``PipelineModule``) layouts composed with ZeRO-1, from parameter
metadata alone.

A ``PipelineModule`` (``deepspeed/runtime/pipe/module.py``, deepspeed 0.19.8) gives stage ``s`` of
``pp`` the layers ``[parts[s], parts[s + 1])`` and names their parameters independently of the
stage: ``"<layer index>.<sub name>"``, and ``"tied_modules.<key>.<sub name>"`` for a
``TiedLayerSpec`` key, of which every stage holding one of the key's layers builds its own copy.
Each stage's data-parallel group (global ranks ``stage * dp + d``, ``PipeDataParallelTopology``'s
row-major ``['pipe', 'data']`` axes) flattens and partitions the stage's own parameters as plain
ZeRO does (``stage_1_and_2.py``).

A parameter is never cut: a stage holds it whole or not at all. In the box view of
:mod:`~ds_dynatrain.vps.tensor_parallel` a stage is a *band*: its band of a parameter is the whole
matrix where it holds the parameter, an empty box where it does not; a tied parameter is a
replicated one, held by every stage that owns its key (any copy is a source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ..errors import LayoutMismatchError
from .layout import DEFAULT_SUB_GROUP_SIZE, ParamMeta, ZeroLayout
from .tensor_parallel import BOX_FIELDS, BoxTable, fragment_boxes, matrix_shape

TIED_PREFIX = "tied_modules."


@dataclass(frozen=True)
class PipelineLayer:
    """One entry of a pipeline's layer list.

    Attributes:
        params: its trainable parameters, ``ParamMeta`` keyed by their stage-independent names
            (``"<index>.<sub>"``, or ``"tied_modules.<key>.<sub>"`` for a tied layer), in the
            layer's ``named_parameters`` order; empty for a function or a parameterless layer.
        tie: the ``TiedLayerSpec`` key, or ``None``.
    """

    params: Tuple[ParamMeta, ...] = ()
    tie: Optional[str] = None


def held_params(layers: Sequence[PipelineLayer]) -> Tuple[ParamMeta, ...]:
    """The parameters of a stage holding ``layers``, in ``PipelineModule`` order: every tied
    key's parameters (in the order the stage first meets the keys), then its other layers' in
    layer order."""
    tied, own, seen = [], [], set()
    for layer in layers:
        if layer.tie is None:
            own.extend(layer.params)
        elif layer.tie not in seen:
            seen.add(layer.tie)
            tied.extend(layer.params)
    return tuple(tied + own)


@dataclass(frozen=True)
class PipelineLayout:
    """The layout of a pipeline model at ``pp`` stages of ``dp`` ZeRO ranks each.

    Attributes:
        pp, dp: pipeline and data-parallel degrees (world size ``pp * dp``).
        layers: the layer list (:class:`PipelineLayer`), the same at every degree.
        parts: the stage bounds, ``pp + 1`` increasing layer indices from 0 to the number of
            layers (DeepSpeed's ``PipelineModule.parts``, from its partition method).
        stage, round_robin, parameter_alignment, sub_group_size: the ZeRO settings, as
            :class:`~ds_dynatrain.vps.layout.ZeroLayout`.
        optimizer_groups: ``(key, index)`` of the parameters not in the optimizer's group 0 (empty:
            one group). Each stage's ZeRO layout has one group per optimizer parameter group
            that holds some of the stage's parameters (DeepSpeed leaves a stage's empty groups
            out), each the stage's parameters of that group in ``PipelineModule`` order, tied
            modules first.

    Raises:
        LayoutMismatchError: ``parts`` does not bound ``pp`` stages of the layer list, a stage
            holds no layer or no trainable parameter, or two layers give one parameter name
            different shapes.
        ValueError: ``pp`` or ``dp`` below 1 (and as :class:`ZeroLayout`).
    """

    band_name = "stage"  # what a message calls a band

    pp: int
    dp: int
    layers: Tuple[PipelineLayer, ...]
    parts: Tuple[int, ...]
    stage: int = 1
    round_robin: bool = False
    parameter_alignment: bool = False
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    optimizer_groups: Tuple[Tuple[str, int], ...] = ()
    _zero: Tuple[ZeroLayout, ...] = field(init=False, repr=False, compare=False, hash=False)
    _group_ids: Tuple[Tuple[int, ...], ...] = field(init=False, repr=False, compare=False, hash=False)
    _params: Tuple[ParamMeta, ...] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        if self.pp < 1 or self.dp < 1:
            raise ValueError(f"PP and DP degrees must be >= 1, got PP {self.pp} x DP {self.dp}")
        parts = tuple(int(x) for x in self.parts)
        if len(parts) != self.pp + 1 or parts[0] != 0 or parts[-1] != len(self.layers):
            raise LayoutMismatchError(
                f"stage bounds {list(parts)} do not split {len(self.layers)} layers into {self.pp} stages"
            )
        for s, (a, b) in enumerate(zip(parts, parts[1:])):
            if b <= a:
                raise LayoutMismatchError(f"stage bounds {list(parts)}: stage {s} holds no layer")
        object.__setattr__(self, "parts", parts)
        metas: Dict[str, ParamMeta] = {}
        for layer in self.layers:
            for p in layer.params:
                if metas.setdefault(p.key, p) != p:
                    raise LayoutMismatchError(f"{p.key}: two layers give it {metas[p.key]} and {p}")
        object.__setattr__(self, "_params", tuple(metas[k] for k in sorted(metas)))
        for s in range(self.pp):
            if not self.stage_params(s):
                raise LayoutMismatchError(f"stage bounds {list(parts)}: stage {s} holds no trainable parameter")
        index = dict(self.optimizer_groups)
        unknown = sorted(set(index) - set(metas))
        if unknown:
            raise LayoutMismatchError(f"optimizer group of {unknown[0]}, which no layer holds")
        zero, ids = [], []
        for s in range(self.pp):
            by_group: Dict[int, list] = {}
            for p in self.stage_params(s):
                by_group.setdefault(index.get(p.key, 0), []).append(p)
            ids.append(tuple(sorted(by_group)))
            groups = tuple(tuple(by_group[g]) for g in ids[-1])
            zero.append(
                ZeroLayout(self.dp, groups, self.round_robin, self.parameter_alignment, self.stage, self.sub_group_size)
            )
        object.__setattr__(self, "_zero", tuple(zero))
        object.__setattr__(self, "_group_ids", tuple(ids))

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def num_bands(self) -> int:
        """Bands of the box view: one per stage."""
        return self.pp

    @property
    def degrees(self) -> Tuple[str, int, int]:
        """``("pp", pp, dp)``: what a plan's digest names of this layout."""
        return ("pp", self.pp, self.dp)

    def stage_params(self, s: int) -> Tuple[ParamMeta, ...]:
        """Stage ``s``'s parameters in ``PipelineModule`` order (:func:`held_params`)."""
        return held_params(self.layers[self.parts[s] : self.parts[s + 1]])

    def stage_of_rank(self, rank: int) -> int:
        """The stage of global ``rank``."""
        return rank // self.dp

    def dp_rank_of(self, rank: int) -> int:
        """The DP rank of global ``rank`` in its stage's data-parallel group."""
        return rank % self.dp

    def band_of(self, rank: int) -> int:
        """The band (stage) of global ``rank``: DeepSpeed's ``mp_rank`` in its checkpoint files'
        names."""
        return rank // self.dp

    def rank(self, stage: int, dp_rank: int) -> int:
        """The global rank of ``(stage, dp_rank)``: ``stage * dp + dp_rank``."""
        return stage * self.dp + dp_rank

    def zero(self, stage: int) -> ZeroLayout:
        """The ZeRO layout of stage ``stage``'s data-parallel group."""
        return self._zero[stage]

    def zero_of(self, rank: int) -> ZeroLayout:
        """The ZeRO layout of global ``rank``'s data-parallel group (its stage's)."""
        return self._zero[self.stage_of_rank(rank)]

    @property
    def params(self) -> Tuple[ParamMeta, ...]:
        """Every trainable parameter once, sorted by name (the ``param`` index of
        :class:`~ds_dynatrain.vps.tensor_parallel.BoxTable`; the same at every degree)."""
        return self._params

    @property
    def groups(self) -> Tuple[Tuple[ParamMeta, ...], ...]:
        """The model's parameters per optimizer parameter group (by name; empty groups left out;
        each stage's groups are parts of them), as
        :class:`~ds_dynatrain.vps.tensor_parallel.TensorParallelLayout` gives its groups."""
        index = dict(self.optimizer_groups)
        by_group: Dict[int, list] = {}
        for p in self._params:
            by_group.setdefault(index.get(p.key, 0), []).append(p)
        return tuple(tuple(by_group[g]) for g in sorted(by_group))

    def group_of(self, key: str) -> int:
        """The optimizer parameter group of parameter ``key``."""
        return dict(self.optimizer_groups).get(key, 0)

    def optimizer_group_ids(self, rank: int) -> Tuple[int, ...]:
        """The optimizer parameter group of each ZeRO group (partition at ZeRO-1) of global
        ``rank``'s stage."""
        return self._group_ids[self.stage_of_rank(rank)]

    def band(self, p: ParamMeta, stage: int) -> Tuple[int, int, int, int]:
        """``(row, rows, col, cols)`` of stage ``stage``'s part of ``p``: its whole matrix (the
        callers ask only of a stage that holds it)."""
        rows, cols = matrix_shape(p.shape)
        return 0, rows, 0, cols

    def first_holders(self) -> np.ndarray:
        """``(parameters,)`` int64: the lowest stage holding each parameter."""
        return np.argmax(self.holders(), axis=1).astype(np.int64)

    def holders(self) -> np.ndarray:
        """``(parameters, pp)`` bool: stage ``s`` holds parameter ``i``."""
        index = {p.key: i for i, p in enumerate(self._params)}
        out = np.zeros((len(self._params), self.pp), dtype=bool)
        for s in range(self.pp):
            for p in self.stage_params(s):
                out[index[p.key], s] = True
        return out

    def band_boxes(self) -> np.ndarray:
        """``(parameters, pp, 4)`` int64: stage ``s``'s part of parameter ``i`` as ``(row, rows,
        col, cols)`` of its matrix; the whole matrix where the stage holds it, else empty."""
        shapes = np.asarray([matrix_shape(p.shape) for p in self._params], dtype=np.int64).reshape(-1, 2)
        held = self.holders()
        out = np.zeros((len(self._params), self.pp, 4), dtype=np.int64)
        out[:, :, 1] = np.where(held, shapes[:, 0:1], 0)
        out[:, :, 3] = np.where(held, shapes[:, 1:2], 0)
        return out

    def replicated(self) -> np.ndarray:
        """``(parameters,)`` bool: held whole by more than one stage (a tied parameter)."""
        return self.holders().sum(axis=1) > 1

    def boxes(self) -> BoxTable:
        """Every box of every rank (:class:`~ds_dynatrain.vps.tensor_parallel.BoxTable`; ``band``
        is the stage)."""
        index = {p.key: i for i, p in enumerate(self._params)}
        bands = self.band_boxes()
        parts = []
        for s in range(self.pp):
            frag = self._zero[s].fragment_table()  # its param index: the stage's parameters group by group
            keys = [p.key for g in self._zero[s].groups for p in g]
            pidx = np.asarray([index[k] for k in keys], dtype=np.int64)[frag.param]
            ranks = s * self.dp + frag.rank
            parts.append(fragment_boxes(frag, pidx, s, bands[pidx, s], ranks))
        return BoxTable(*(np.concatenate([p[i] for p in parts]) for i in range(len(BOX_FIELDS))))

    def check_same_model(self, other: "PipelineLayout", settings: bool = True) -> None:
        """Raise :class:`LayoutMismatchError` when ``other`` is not the same model (the same
        parameters, full shapes and ties; with ``settings`` also dtypes and ZeRO settings)."""
        if not isinstance(other, PipelineLayout):
            raise LayoutMismatchError("a pipeline layout and a layout of another kind describe different jobs")
        a, b = self._params, other._params
        if [(p.key, p.shape) for p in a] != [(p.key, p.shape) for p in b]:
            raise LayoutMismatchError("the two pipeline layouts describe different parameters")
        if [(len(x.params), x.tie) for x in self.layers] != [(len(x.params), x.tie) for x in other.layers]:
            raise LayoutMismatchError("the two pipeline layouts have different layer lists")
        if not settings:
            return
        if [p.dtype for p in a] != [p.dtype for p in b]:
            raise LayoutMismatchError("the two pipeline layouts describe different parameter dtypes")
        mine = (self.stage, self.round_robin, self.parameter_alignment, self.sub_group_size)
        theirs = (other.stage, other.round_robin, other.parameter_alignment, other.sub_group_size)
        if mine != theirs:
            raise LayoutMismatchError(f"the two pipeline layouts differ in their ZeRO settings: {mine} and {theirs}")
        if self.optimizer_groups != other.optimizer_groups:
            raise LayoutMismatchError("the two pipeline layouts put parameters in different optimizer groups")

    def with_degrees(self, pp: int, dp: int, parts: Sequence[int]) -> "PipelineLayout":
        """The same model and ZeRO settings at ``pp`` stages of ``dp`` ranks, split at ``parts``."""
        return PipelineLayout(
            pp,
            dp,
            self.layers,
            tuple(parts),
            self.stage,
            self.round_robin,
            self.parameter_alignment,
            self.sub_group_size,
            self.optimizer_groups,
        )


def stage_bounds(
    layers: Sequence[PipelineLayer],
    stage_keys: Sequence[Sequence[str]],
    optimizer_groups: Sequence[Tuple[str, int]] = (),
) -> Tuple[int, ...]:
    """The stage bounds (``parts``, :class:`PipelineLayout`) under which stage ``s`` holds exactly
    the parameters ``stage_keys[s]``, in that order (its optimizer groups one after the other, as
    ``optimizer_groups`` assigns them, each in ``PipelineModule`` order): the split of a saved
    pipeline read back from
    the parameter names each stage recorded (DeepSpeed keeps no record of its partition method).
    Parameters without elements are left out of the comparison, as DeepSpeed leaves them out of
    its partitions. Where layers without parameters let several splits fit, the one whose stages
    start earliest is returned: the saved state is the same under each.

    Raises:
        LayoutMismatchError: a recorded name that is no parameter of ``layers``, a parameter no
            stage recorded, or no split giving every stage its names (naming the first stage that
            cannot be matched).
    """
    want = [tuple(stage_keys[s]) for s in range(len(stage_keys))]
    pp, n = len(want), len(layers)
    known = {p.key for layer in layers for p in layer.params}
    for s, keys in enumerate(want):
        for k in keys:
            if k not in known:
                raise LayoutMismatchError(f"stage {s}'s parameter {k} is not a parameter of the model's layers")
    seen = {k for keys in want for k in keys}
    sized = {p.key for layer in layers for p in layer.params if math.prod(p.shape) > 0}
    for k in sorted(sized - seen):
        raise LayoutMismatchError(f"parameter {k} of the model is in no stage")
    if pp < 1 or pp > n:
        raise LayoutMismatchError(f"{pp} stages cannot split {n} layers")

    group_of = dict(optimizer_groups)

    def held(lo: int, hi: int) -> Tuple[str, ...]:
        keys = [p.key for p in held_params(layers[lo:hi]) if math.prod(p.shape) > 0]
        return tuple(sorted(keys, key=lambda k: group_of.get(k, 0)))  # stable: module order in a group

    failed = set()
    deepest = [0]

    def search(s: int, lo: int):
        if s == pp:
            return () if lo == n else None
        if (s, lo) in failed:
            return None
        deepest[0] = max(deepest[0], s)
        for hi in range(lo + 1, n - (pp - s - 1) + 1):
            keys = held(lo, hi)
            if not set(keys) <= set(want[s]):
                break  # a layer of another stage: later bounds only add more
            if keys == want[s]:
                rest = search(s + 1, hi)
                if rest is not None:
                    return (lo, *rest)
        failed.add((s, lo))
        return None

    found = search(0, 0)
    if found is None:
        raise LayoutMismatchError(
            f"no split of the {n} layers into {pp} stages gives stage {deepest[0]} the parameters it recorded "
            f"({', '.join(want[deepest[0]][:3])}{', ...' if len(want[deepest[0]]) > 3 else ''})"
        )
    return (*found, n)
