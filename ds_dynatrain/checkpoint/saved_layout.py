"""The layout a checkpoint was saved in, from its model-state metadata alone, and whether its
ranks' fragments hold every element of every parameter exactly once."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

from ..errors import CheckpointIncompleteError
from ..vps.layout import ParamMeta, ZeroLayout
from .saved import SavedCheckpoint


def saved_layout(saved: SavedCheckpoint) -> ZeroLayout:
    """The layout ``saved`` was written in, from its model-state metadata alone.

    The same layout as :meth:`SavedCheckpoint.layout_from_metadata` (a test holds them equal),
    without that method's size check, which opens every rank's optimizer file at once: DeepSpeed's
    files are read whole, so that would hold the whole checkpoint in memory. ``verify`` and
    ``export`` check each partition against the layout as they read it, one file at a time.

    Raises:
        CheckpointIncompleteError: the model-state file has no ``param_shapes``.
    """
    dtype = saved.working_dtype()
    groups = tuple(
        tuple(ParamMeta(str(n), tuple(int(d) for d in shape), dtype) for n, shape in g.items())
        for g in (saved.model_state.get("param_shapes") or [])
        if len(g)
    )
    if not groups:
        raise CheckpointIncompleteError(f"{saved.model_file.path}: no param_shapes (not a ZeRO checkpoint)")
    z = saved.ds_config.get("zero_optimization") or {}
    if saved.stage == 3:
        # each saved group is one sub-group, already cut: no further cut (see layout_from_metadata)
        return ZeroLayout(saved.world_size, groups, stage=3, sub_group_size=2**62)
    # param_shapes lists each group in its flat order, round robin already applied
    return ZeroLayout(saved.world_size, groups, False, bool(z.get("parameter_alignment", False)), saved.stage)


def coverage_problems(layout: ZeroLayout) -> List[str]:
    """Whether the fragments of all ranks tile every parameter exactly once, by tiling (a gap and
    an overlap of the same size would cancel in a sum), and each rank's fragments lie inside its
    partitions without overlapping there. Returns one message per problem (empty: covered).
    """
    problems = []
    spans: Dict[str, List[Tuple[int, int, int]]] = defaultdict(list)  # key -> (start, end, rank)
    for r in range(layout.world_size):
        local: Dict[int, List[Tuple[int, int, str]]] = defaultdict(list)
        for f in layout.fragments(r):
            spans[f.key].append((f.start, f.start + f.numel, r))
            local[f.group].append((f.local, f.local + f.numel, f.key))
        for b, ivs in local.items():
            ivs.sort()
            if ivs and ivs[-1][1] > layout.partition_numel(b):
                problems.append(
                    f"rank {r}: fragment of {ivs[-1][2]} ends at element {ivs[-1][1]} of partition {b}, "
                    f"which has {layout.partition_numel(b)}"
                )
            for (_, a1, ak), (b0, _, bk) in zip(ivs, ivs[1:]):
                if b0 < a1:
                    problems.append(f"rank {r}: fragments of {ak} and {bk} overlap in partition {b}")
    for params in layout.groups:
        for p in params:
            ivs = sorted(spans.get(p.key, []))
            cursor = 0
            for s, e, r in ivs:
                if s > cursor:
                    problems.append(f"parameter {p.key} {list(p.shape)}: elements [{cursor}, {s}) held by no rank")
                elif s < cursor:
                    problems.append(
                        f"parameter {p.key} {list(p.shape)}: elements [{s}, {min(cursor, e)}) held "
                        f"twice (again by rank {r})"
                    )
                cursor = max(cursor, e)
            if cursor < p.numel:
                problems.append(f"parameter {p.key} {list(p.shape)}: elements [{cursor}, {p.numel}) held by no rank")
            elif cursor > p.numel:
                problems.append(
                    f"parameter {p.key} {list(p.shape)}: fragments reach element {cursor}, past its {p.numel} elements"
                )
    return problems


# --- what the file holds ------------------------------------------------------------------------
