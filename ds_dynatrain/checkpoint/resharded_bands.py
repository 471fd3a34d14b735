"""The reads of a load across band layouts: an AutoTP checkpoint onto another TP and DP degree (or
a checkpoint without TP onto an AutoTP job, or the reverse), a pipeline checkpoint onto another PP
and DP degree; DeepSpeed's files or this project's.

The saved layout (a :class:`~ds_dynatrain.vps.tensor_parallel.TensorParallelLayout`,
:func:`~ds_dynatrain.checkpoint.saved_tp.saved_tp_layout`, or a
:class:`~ds_dynatrain.vps.pipeline.PipelineLayout`,
:func:`~ds_dynatrain.checkpoint.saved_pp.saved_pp_layout`) is checked against every saved band's
``param_shapes`` (names, their order in the partitions, the shard shapes) and every saved
partition's size before anything is read. The box planner (saved ranks as sources) then says which
box of which saved partition lands where in this rank's new partitions; each box is read as runs
of its rows straight into those partitions (one run when the box is whole rows on both sides), so
no rank holds more than its own new partitions and nothing is converted on disk (DeepSpeed's route
is ``ds_to_universal.py`` and ``load_universal``, which rewrites every byte).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Sequence

import numpy as np
import torch

from ..errors import CheckpointIncompleteError
from ..planner.box_plan import BoxPlan, band_scalars
from ..planner.pp_plan import plan_pp_transition
from ..planner.tp_plan import plan_tp_transition
from ..vps.pipeline import PipelineLayout
from .saved import SavedCheckpoint, partitions_of


def plan_reads(old, live) -> BoxPlan:
    """The box plan from the saved ranks (``saved<r>``) to the live ones (``rank<r>``) of two TP
    or two pipeline layouts.

    Raises:
        LayoutMismatchError: the two describe different models.
    """
    src = tuple(f"saved{r}" for r in range(old.world_size))
    dst = tuple(f"rank{r}" for r in range(live.world_size))
    if isinstance(live, PipelineLayout):
        return plan_pp_transition(old, live, src, dst, same_settings=False)
    return plan_tp_transition(old, live, src, dst, same_settings=False)


def new_partitions(live, rank: int, kinds: Sequence[str], device) -> List[Dict[str, torch.Tensor]]:
    """Zeroed fp32 partitions of global ``rank`` under band layout ``live``: one ``{kind: 1-D
    tensor}`` each."""
    zl = live.zero_of(rank)
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
        dp_rank, mp_rank = plan.old_layout.dp_rank_of(src), plan.old_layout.band_of(src)
        file = saved.optim(dp_rank, mp_rank)
        parts = partitions_of(file.tree, saved.stage)
        requests = []
        for _, _, _, g, so, ss, dg, do, ds, r, c in (row.tolist() for row in by_src[src]):
            for k in kinds:
                if k not in parts.tensors[g]:
                    name = saved.optim_name(dp_rank, mp_rank)
                    raise CheckpointIncompleteError(f"{name}: partition {g} has no {k}")
                ref, flat = parts.tensors[g][k], dests[dg][k]
                if ss == c and ds == c:  # whole rows on both sides: one run
                    requests.append((ref, so, flat.narrow(0, do, r * c)))
                else:
                    requests += [(ref, so + i * ss, flat.narrow(0, do + i * ds, c)) for i in range(r)]
        nbytes += file.read_into(requests)
    return nbytes


def new_scalars(saved: SavedCheckpoint, old, live, rank: int) -> list:
    """Adam's ``step`` (and the other non-partition states) of each of global ``rank``'s new
    partitions under band layout ``live``, from saved rank 0's partitions of the same optimizer
    parameter group."""
    scalars = partitions_of(saved.optim(0, 0).tree, saved.stage).scalars
    return band_scalars(old, 0, live, rank, scalars)
