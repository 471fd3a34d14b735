"""``dynatrain plan``: the transition plan of a Hugging Face model between two world sizes, from
metadata alone (the model is built on the meta device; no process starts, no memory is used)."""

from __future__ import annotations

import json
import os
import time
from functools import lru_cache
from typing import Tuple

import numpy as np

from ..errors import ConfigError
from ..planner.assignment import assign_members, assign_members_best
from ..planner.plan import Plan, plan_transition
from ..vps.layout import DEFAULT_SUB_GROUP_SIZE, ParamMeta, ZeroLayout

# bytes per element a resize moves: fp32 master + Adam exp_avg + exp_avg_sq in bf16/fp16 training;
# in fp32 training the master is not moved (the rebuild copies it from the working parameters)
STATE_BYTES_PER_ELEMENT = {"bfloat16": 12, "float16": 12, "float32": 8}
MAX_INFLIGHT_BYTES = 256 << 20  # the default bound of bytes in flight (dynatrain.max_inflight_bytes)


def model_layout(
    model_config: str, world_size: int, stage: int, dtype: str, sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
) -> ZeroLayout:
    """The ZeRO layout of the causal LM described by a Hugging Face config file (one group).

    Raises:
        ConfigError: unreadable config, or a ZeRO stage other than 1, 2 or 3.
    """
    if stage not in (1, 2, 3):
        raise ConfigError(f"--zero-stage {stage}: ZeRO stages 1, 2 and 3 have partitions to plan")
    metas = model_metas(os.path.abspath(model_config), dtype)
    return ZeroLayout(world_size, (metas,), stage=stage, sub_group_size=sub_group_size)


@lru_cache(maxsize=4)
def model_metas(model_config: str, dtype: str) -> Tuple[ParamMeta, ...]:
    """The trainable parameters of the causal LM of a Hugging Face config file, built on the
    meta device (no memory; a 405 B model takes seconds to build, so the result is kept).

    Raises:
        ConfigError: transformers missing, or the config file unreadable.
    """
    model = meta_model(os.path.abspath(model_config))
    return tuple(ParamMeta(n, tuple(p.shape), dtype) for n, p in model.named_parameters() if p.requires_grad)


@lru_cache(maxsize=2)
def meta_model(model_config: str):
    """The causal LM of a Hugging Face config file on the meta device (no memory).

    Raises:
        ConfigError: transformers missing, or the config file unreadable.
    """
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:  # pragma: no cover - the examples extra
        raise ConfigError(f"dynatrain plan needs transformers (pip install 'ds_dynatrain[examples]'): {err}") from None
    if not os.path.isfile(model_config):
        raise ConfigError(f"--model-config {model_config!r}: no such file (a Hugging Face config.json)")
    try:
        cfg = AutoConfig.from_pretrained(model_config)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model-config {model_config!r}: {err}") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def plan_report(
    model_config: str, stage: int, old_ws: int, new_ws: int, dtype: str = "bfloat16", assignment: str = "best"
) -> dict:
    """Per-rank and total bytes of the transition: the fp32 master and two Adam moments in
    bf16/fp16 training, the two moments in fp32 training (the master is not moved), bytes.

    ``peak_extra_bytes`` of a rank: its new partitions of the moved state (allocated beside the
    old ones), plus the staging of at most the default ``max_inflight_bytes`` (received bytes
    land in place), plus, at ZeRO stage 3, the working parameters gathered whole for the
    rebuild; 0 when the world size does not change (nothing happens).
    """
    if old_ws < 1 or new_ws < 1:
        raise ConfigError("--from and --to must be >= 1")
    old = model_layout(model_config, old_ws, stage, dtype)
    t0 = time.perf_counter()
    new = old.with_world_size(new_ws)
    members = [f"m{i}" for i in range(old_ws)]
    joiners = [f"j{i}" for i in range(max(0, new_ws - old_ws))]
    if assignment == "best":
        new_members = assign_members_best(old, new, members, joiners)
    else:
        new_members = assign_members(members, new_ws, joiners)
    plan = plan_transition(old, new, members, new_members)
    seconds = time.perf_counter() - t0
    b = STATE_BYTES_PER_ELEMENT[dtype]
    whole = sum(p.numel * p.element_size for g in old.groups for p in g) if stage == 3 else 0
    kept, sent, recv = _per_rank_numels(plan)
    part = sum(new.partition_numel(g) for g in range(new.num_partitions)) * b
    ranks = rank_rows(
        plan.old_members,
        new_members,
        (kept, sent, recv),
        b,
        lambda r, moved: 0 if old_ws == new_ws else part + min(moved, MAX_INFLIGHT_BYTES) + whole,
    )
    return {
        "model_config": model_config,
        "zero_stage": stage,
        "from": old_ws,
        "to": new_ws,
        "assignment": assignment,
        "dtype": dtype,
        "bytes_per_element": b,
        "parameters": sum(p.numel for p in old.groups[0]),
        "bytes_moved": plan.numel_moved * b,
        "bytes_kept": plan.numel_kept * b,
        "plan_seconds": seconds,
        "transfers": len(plan.table),
        "ranks": ranks,
    }


def rank_rows(old_members, new_members, numels, b: int, peak_of) -> list:
    """The report's per-process rows: each new rank's bytes kept, sent and received and its peak
    extra bytes (``peak_of(rank, bytes sent and received)``), then the processes that leave.
    ``numels``: elements kept by new rank, sent by old rank, received by new rank; ``b``: bytes
    per element."""
    kept, sent, recv = numels
    old_rank = {m: i for i, m in enumerate(old_members)}
    rows = []
    for r, m in enumerate(new_members):
        i = old_rank.get(m)
        s_r = int(sent[i]) * b if i is not None else 0
        rows.append(
            {
                "rank": r,
                "member": m,
                "bytes_kept": int(kept[r]) * b,
                "bytes_sent": s_r,
                "bytes_received": int(recv[r]) * b,
                "peak_extra_bytes": peak_of(r, int(recv[r]) * b + s_r),
            }
        )
    for m in [m for m in old_members if m not in set(new_members)]:
        s_m = int(sent[old_rank[m]]) * b
        rows.append(
            {"rank": None, "member": m, "bytes_kept": 0, "bytes_sent": s_m, "bytes_received": 0, "peak_extra_bytes": 0}
        )
    return rows


def _per_rank_numels(plan: Plan) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kept by new rank, sent by old rank, received by new rank)``: elements (int64 arrays),
    summed over the plan's table (kept elements are neither sent nor received)."""
    t, keep = plan.table, plan.keep_mask

    def total_by(col: int, rows: np.ndarray, n: int) -> np.ndarray:
        out = np.zeros(n, dtype=np.int64)
        np.add.at(out, t[rows, col], t[rows, 5])
        return out

    old_ws, new_ws = len(plan.old_members), len(plan.new_members)
    return total_by(1, keep, new_ws), total_by(0, ~keep, old_ws), total_by(1, ~keep, new_ws)


def print_report(rep: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rep))
        return
    gib = 1 << 30
    ranks = f"{rep['from']} -> {rep['to']} ranks"
    if "tensor_parallel_from" in rep:
        a, b = rep["tensor_parallel_from"], rep["tensor_parallel_to"]
        ranks = f"TP {a} x DP {rep['from'] // a} -> TP {b} x DP {rep['to'] // b} ({ranks})"
    if "pipeline_parallel_from" in rep:
        a, b = rep["pipeline_parallel_from"], rep["pipeline_parallel_to"]
        ranks = f"PP {a} x DP {rep['from'] // a} -> PP {b} x DP {rep['to'] // b} ({ranks})"
    print(
        f"{rep['parameters'] / 1e9:.2f} B parameters, ZeRO-{rep['zero_stage']}, {ranks}, "
        f"{rep['assignment']} assignment: planned in {rep['plan_seconds'] * 1e3:.1f} ms, {rep['transfers']} transfers"
    )
    print(f"{'rank':>5} {'member':>7} {'kept GiB':>9} {'sent GiB':>9} {'recv GiB':>9} {'peak extra GiB':>15}")
    for r in rep["ranks"]:
        rank = "leave" if r["rank"] is None else str(r["rank"])
        print(
            f"{rank:>5} {r['member']:>7} {r['bytes_kept'] / gib:>9.2f} {r['bytes_sent'] / gib:>9.2f} "
            f"{r['bytes_received'] / gib:>9.2f} {r['peak_extra_bytes'] / gib:>15.2f}"
        )
    total = rep["bytes_moved"] + rep["bytes_kept"]
    print(
        f"total: {rep['bytes_moved'] / gib:.1f} GiB moved, {rep['bytes_kept'] / gib:.1f} GiB kept in place "
        f"({100 * rep['bytes_kept'] / total:.1f} %)"
    )
    if "bytes_kept_upper_bound" in rep:
        bound = rep["bytes_kept_upper_bound"]
        print(
            f"kept {rep['bytes_kept'] / gib:.2f} GiB against an upper bound of {bound / gib:.2f} GiB "
            f"(each new rank keeps at most its best overlap with one old rank, each old rank with one new rank)"
        )
