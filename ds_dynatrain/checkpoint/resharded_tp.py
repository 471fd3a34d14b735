"""The reads of a load across TP degrees: an AutoTP checkpoint (DeepSpeed's files or this project's)
onto another TP and DP degree, or a checkpoint without TP onto an AutoTP job, or the reverse.

The saved layout is a :class:`~ds_dynatrain.vps.tensor_parallel.TensorParallelLayout` of the live
model's parameters at the saved TP and DP degree, with AutoTP's cut at the saved degree (computed by
the caller from the model, :mod:`~ds_dynatrain.zero.autotp`) and the saved ZeRO settings. It is
checked against every saved TP rank's ``param_shapes`` (names, their order in the partitions, the
shard shapes) and every saved partition's size before anything is read. The box planner
(:func:`~ds_dynatrain.planner.tp_plan.plan_tp_transition`, saved ranks as sources) then says which
box of which saved partition lands where in this rank's new partitions; each box is read as runs
of its rows straight into those partitions (one run when the box is whole rows on both sides), so
no rank holds more than its own new partitions and nothing is converted on disk (DeepSpeed's route
is ``ds_to_universal.py`` and ``load_universal``, which rewrites every byte).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np
import torch

from ..errors import CheckpointIncompleteError, LayoutMismatchError
from ..planner.box_plan import BoxPlan
from ..planner.plan import scalars_between
from ..planner.tp_plan import plan_tp_transition
from ..vps.layout import ParamMeta
from ..vps.tensor_parallel import TensorParallelLayout, TpSplit
from .saved import SavedCheckpoint, partitions_of
from .saved_tp import check_shards


def saved_tp_layout(
    saved: SavedCheckpoint, live: TensorParallelLayout, splits: Mapping[str, TpSplit]
) -> TensorParallelLayout:
    """The layout ``saved`` was written in: ``live``'s parameters (full shapes, the saved working
    dtype) at the saved TP degree (``saved.tp``, cut as ``splits`` say) and DP degree, with the
    saved ZeRO settings.

    Raises:
        LayoutMismatchError: AutoTP's cut at the saved degree does not fit the model, or a saved TP
            rank's parameters, their order or shard shapes, or a partition's size differ from the
            layout's (naming the TP rank, the first parameter or the file).
    """
    dtype = saved.working_dtype()
    groups = tuple(tuple(ParamMeta(p.key, p.shape, dtype) for p in g) for g in live.groups)
    keys = {p.key for p in live.params}
    cut = tuple(sorted((k, s) for k, s in splits.items() if k in keys))
    try:
        old = TensorParallelLayout(saved.tp, saved.world_size, groups, cut, *_settings(saved))
    except (LayoutMismatchError, ValueError) as err:
        raise LayoutMismatchError(f"{saved.dir}: AutoTP's cut at TP {saved.tp} does not fit the model: {err}") from None
    for t in range(saved.tp):
        check_shards(saved, old, t)
        saved.check_sizes(old.zero(t), t)
    return old


def _settings(saved: SavedCheckpoint) -> Tuple[int, bool, bool, int]:
    """``(stage, round_robin, parameter_alignment, sub_group_size)`` of the saving config, in
    :class:`TensorParallelLayout`'s order."""
    rr, align, stage, sub_group_size = saved.zero_settings()
    return stage, rr, align, sub_group_size


def plan_reads(old: TensorParallelLayout, live: TensorParallelLayout) -> BoxPlan:
    """The box plan from the saved ranks (``saved<r>``) to the live ones (``rank<r>``)."""
    src = tuple(f"saved{r}" for r in range(old.world_size))
    dst = tuple(f"rank{r}" for r in range(live.world_size))
    return plan_tp_transition(old, live, src, dst, same_settings=False)


def new_partitions(
    live: TensorParallelLayout, rank: int, kinds: Sequence[str], device
) -> List[Dict[str, torch.Tensor]]:
    """Zeroed fp32 partitions of global ``rank`` under ``live``: one ``{kind: 1-D tensor}`` each."""
    zl = live.zero(rank % live.tp)
    return [
        {k: torch.zeros(zl.partition_numel(b), dtype=torch.float32, device=device) for k in kinds}
        for b in range(zl.num_partitions)
    ]


def read_boxes(
    saved: SavedCheckpoint, plan: BoxPlan, rank: int, kinds: Sequence[str], dests: List[Dict[str, torch.Tensor]]
) -> int:
    """Read every box the plan puts into global ``rank``'s new partitions (``dests``), one batch
    per saved file. Returns the bytes read.

    Raises:
        CheckpointIncompleteError: a damaged file, or a saved partition without a state kind
            (the caller has every rank agree).
    """
    rows = plan.table[plan.table[:, 1] == rank]
    by_src: Dict[int, List[np.ndarray]] = defaultdict(list)
    for row in rows:
        by_src[int(row[0])].append(row)
    nbytes = 0
    for src in sorted(by_src):
        dp_rank, tp_rank = divmod(src, plan.old_layout.tp)  # global rank = dp_rank * tp + tp_rank
        file = saved.optim(dp_rank, tp_rank)
        parts = partitions_of(file.tree, saved.stage)
        requests = []
        for _, _, _, g, so, ss, dg, do, ds, r, c in (row.tolist() for row in by_src[src]):
            for k in kinds:
                if k not in parts.tensors[g]:
                    name = saved.optim_name(dp_rank, tp_rank)
                    raise CheckpointIncompleteError(f"{name}: partition {g} has no {k}")
                ref, flat = parts.tensors[g][k], dests[dg][k]
                if ss == c and ds == c:  # whole rows on both sides: one run
                    requests.append((ref, so, flat.narrow(0, do, r * c)))
                else:
                    requests += [(ref, so + i * ss, flat.narrow(0, do + i * ds, c)) for i in range(r)]
        nbytes += file.read_into(requests)
    return nbytes


def new_scalars(saved: SavedCheckpoint, old: TensorParallelLayout, live: TensorParallelLayout, rank: int) -> list:
    """Adam's ``step`` (and the other non-partition states) of each of global ``rank``'s new
    partitions, from saved rank 0's partitions of the same optimizer parameter group."""
    scalars = partitions_of(saved.optim(0, 0).tree, saved.stage).scalars
    return scalars_between(old.zero(0), live.zero(rank % live.tp), scalars)
