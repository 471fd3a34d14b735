"""``dynatrain plan --tensor-parallel-from A --tensor-parallel-to B``: the plan of a change of TP and
DP degree of a Hugging Face model under DeepSpeed AutoTP + ZeRO, from metadata alone."""

from __future__ import annotations

import os
import time

from ..errors import ConfigError, LayoutMismatchError
from ..planner.assignment import assign_members
from ..planner.box_plan import assign_box_members_best, kept_upper_bound
from ..planner.tp_plan import plan_tp_transition
from ..vps.tensor_parallel import TensorParallelLayout
from .plan import MAX_INFLIGHT_BYTES, meta_model, model_metas, rank_rows

# a TP (or PP) change moves the fp32 master with the two Adam moments whatever the working dtype:
# the new shard's (or stage's) working parameters are not on the new rank, so they are made from
# its master
TP_STATE_BYTES_PER_ELEMENT = 12


def tp_layout(model_config: str, world_size: int, tp: int, stage: int, dtype: str) -> TensorParallelLayout:
    """The AutoTP + ZeRO layout of the causal LM of a Hugging Face config file at ``world_size``
    ranks and TP degree ``tp`` (DP = ``world_size / tp``).

    Raises:
        ConfigError: ``tp`` does not divide ``world_size``, a ZeRO stage other than 1, 2 or 3, AutoTP
            cannot cut the model at ``tp`` (its message), or the config file is unreadable.
    """
    from ..zero.autotp import autotp_splits

    if stage not in (1, 2, 3):
        raise ConfigError(f"--zero-stage {stage}: ZeRO stages 1, 2 and 3 have partitions to plan")
    if tp < 1 or world_size < 1:
        raise ConfigError(f"TP degree {tp} and world size {world_size}: both must be >= 1")
    if world_size % tp:
        raise ConfigError(f"TP degree {tp} does not divide world size {world_size}")
    path = os.path.abspath(model_config)
    try:
        splits = autotp_splits(meta_model(path), tp)
    except (LayoutMismatchError, AssertionError, ValueError) as err:
        raise ConfigError(f"AutoTP cannot cut {os.path.basename(path)} at TP {tp}: {err}") from None
    return TensorParallelLayout(
        tp, world_size // tp, (model_metas(path, dtype),), tuple(sorted(splits.items())), stage=stage
    )


def tp_plan_report(
    model_config: str,
    stage: int,
    old_ws: int,
    new_ws: int,
    tp_from: int,
    tp_to: int,
    dtype: str = "bfloat16",
    assignment: str = "best",
) -> dict:
    """Per-rank and total bytes of the change (fp32 master and two Adam moments, 12 bytes per
    element), the kept bytes beside :func:`~ds_dynatrain.planner.box_plan.kept_upper_bound`, and
    the planning time in seconds (new layout, assignment and plan; the old layout is given).

    ``peak_extra_bytes`` of a rank: its new partitions of that state (allocated beside the old
    ones) plus the staging of at most the default ``max_inflight_bytes``.

    Raises:
        ConfigError: as :func:`tp_layout`.
    """
    old = tp_layout(model_config, old_ws, tp_from, stage, dtype)
    tp_layout(model_config, new_ws, tp_to, stage, dtype)  # warm the caches: the model, its splits
    t0 = time.perf_counter()
    new = tp_layout(model_config, new_ws, tp_to, stage, dtype)
    head = {"model_config": model_config, "zero_stage": stage, "from": old_ws, "to": new_ws}
    head.update(tensor_parallel_from=tp_from, tensor_parallel_to=tp_to, dtype=dtype)
    return box_plan_report(old, new, plan_tp_transition, assignment, t0, head)


def box_plan_report(old, new, plan_of, assignment: str, t0: float, head: dict) -> dict:
    """The report of a change between band layouts ``old`` and ``new`` (TP or pipeline) planned
    by ``plan_of(old, new, old_members, new_members)``: ``head``'s fields, then the bytes (12 per
    element), the kept bytes beside their upper bound, the per-rank rows and the planning time
    since ``t0`` (``time.perf_counter()``, taken before the new layout was built), seconds."""
    members = [f"m{i}" for i in range(old.world_size)]
    joiners = [f"j{i}" for i in range(max(0, new.world_size - old.world_size))]
    new_members, k = assign_box_members_best(old, new, members, joiners)
    if assignment != "best":
        new_members = assign_members(members, new.world_size, joiners)
    plan = plan_of(old, new, members, new_members)
    seconds = time.perf_counter() - t0
    b = TP_STATE_BYTES_PER_ELEMENT

    def peak_of(r: int, moved: int) -> int:
        zl = new.zero_of(r)
        return sum(zl.partition_numel(g) for g in range(zl.num_partitions)) * b + min(moved, MAX_INFLIGHT_BYTES)

    return {
        **head,
        "assignment": assignment,
        "bytes_per_element": b,
        "parameters": sum(p.numel for p in old.params),
        "bytes_moved": plan.numel_moved * b,
        "bytes_kept": plan.numel_kept * b,
        "bytes_kept_upper_bound": kept_upper_bound(k) * b,
        "plan_seconds": seconds,
        "transfers": len(plan.table),
        "ranks": rank_rows(members, new_members, plan.per_rank(), b, peak_of),
    }
