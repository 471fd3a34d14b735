"""Planning time at 70 B and 405 B scale: ``python -m benchmarks.plan [--json]``.

Two sets of rows, each printed beside its target with the ratio:

* Llama-2-70B-shaped (``configs/models/llama2_70b.json``), ZeRO-2 and ZeRO-3, 64 -> 48 ranks, with
  the byte-maximising rank assignment and with ranks kept in place: the plan's time against
  1 s (DynaTrain reports whole 70 B re-layouts in under 2 s) and the share of the state that
  stays in place.
* the same 70 B model under DeepSpeed AutoTP, TP 8 x DP 8 -> TP 4 x DP 12 (64 -> 48 ranks), ZeRO-1,
  2 and 3: the plan's time against 1 s, and the kept bytes against the upper bound of
  ``ds_dynatrain.planner.tp_plan.kept_upper_bound`` (no assignment can keep more).
* Llama-3-405B-shaped (``configs/models/llama3_405b.json``), ZeRO-2 and ZeRO-3, 1,024 -> 960
  ranks (target 1 s) and 4,096 -> 3,072 ranks (target 5 s): what one process of a real resize
  computes before any byte moves, timed from the old layout: the new layout, the
  byte-maximising assignment, the plan, its digest (compared across ranks) and its totals;
  then the transition engine's schedule of the busiest process (the most rows of the plan
  sent, received or kept): its XOR exchanges, the chunks of every stream, its keeps and the
  ranges its new partitions receive. The peak memory of that work is measured in a second,
  identical run under ``tracemalloc`` (Python objects and numpy buffers; the timed run is not
  traced).

ZeRO-2 partitions the flattened model (one fragment per rank boundary); ZeRO-3 partitions every
parameter over every rank (fragments: parameters x ranks, 4.7 million for 405 B at 4,096 ranks),
so it is the harder case for the planner. Figures are wall-clock seconds on this machine; the
CPU seconds beside them show how much a busy machine stretched them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "configs", "models")
STATE_KINDS = 3  # fp32 master, exp_avg, exp_avg_sq (bf16 training)
CHUNK_ELEMENTS = (256 << 20) // (2 * 4)  # the default max_inflight_bytes, per direction, fp32
SCALE_ROWS = ((2, 1024, 960, 1.0), (3, 1024, 960, 1.0), (2, 4096, 3072, 5.0), (3, 4096, 3072, 5.0))


def resize_planning(old, members):
    """One process's planning of a resize from layout ``old`` (members in old-rank order) to
    ``new_ws`` ranks; returns ``(plan, digest)``."""
    from ds_dynatrain.planner.assignment import assign_members_best
    from ds_dynatrain.planner.plan import plan_transition

    new = old.with_world_size(members[1])
    joiners = [f"j{i}" for i in range(max(0, new.world_size - old.world_size))]
    new_members = assign_members_best(old, new, members[0], joiners)
    plan = plan_transition(old, new, members[0], new_members)
    digest = plan.digest()
    plan.numel_moved, plan.numel_kept  # noqa: B018 (the resize record's totals)
    return plan, digest


def member_schedule(plan, member: str) -> int:
    """The transition engine's work for ``member`` before it moves a byte; returns its chunks."""
    from ds_dynatrain.transition.schedule import chunk_ranges, exchanges, stream_sizes, transition_ranks

    chunks = 0
    for ex in exchanges(plan, member, transition_ranks(plan)):
        for side in (ex.sends, ex.receives):
            chunks += len(chunk_ranges(stream_sizes(side, STATE_KINDS), CHUNK_ELEMENTS))
    plan.keeps_of(member)
    plan.rows_into(member)  # the ranges of its new partitions that receive (the rest is zeroed)
    return chunks


def busiest_member(plan) -> str:
    """The process with the most rows of the plan to send, receive or keep."""
    t = plan.table
    rows = np.zeros(len(plan.old_members) + len(plan.new_members), dtype=np.int64)
    np.add.at(rows, t[:, 0], 1)
    np.add.at(rows, len(plan.old_members) + t[:, 1], 1)
    i = int(np.argmax(rows))
    return plan.old_members[i] if i < len(plan.old_members) else plan.new_members[i - len(plan.old_members)]


def scale_row(stage: int, old_ws: int, new_ws: int, target: float, model_config: str) -> dict:
    from ds_dynatrain.cli.plan import model_layout
    from ds_dynatrain.planner.intersect import shared_transfer_table

    old = model_layout(model_config, old_ws, stage, "bfloat16")
    members = ([f"m{i}" for i in range(old_ws)], new_ws)
    shared_transfer_table.cache_clear()  # every run plans from nothing
    t0, c0 = time.perf_counter(), time.process_time()
    plan, _ = resize_planning(old, members)
    t1, c1 = time.perf_counter(), time.process_time()
    member = busiest_member(plan)
    t2, c2 = time.perf_counter(), time.process_time()
    chunks = member_schedule(plan, member)
    t3, c3 = time.perf_counter(), time.process_time()
    row = {
        "model": os.path.basename(model_config),
        "parameters": int(old.param_numels().sum()),
        "zero_stage": stage,
        "from": old_ws,
        "to": new_ws,
        "assignment": "best",
        "plan_seconds": t1 - t0,
        "schedule_seconds": t3 - t2,
        "seconds": (t1 - t0) + (t3 - t2),
        "cpu_seconds": (c1 - c0) + (c3 - c2),
        "target_seconds": target,
        "ratio_to_target": ((t1 - t0) + (t3 - t2)) / target,
        "fragments_old": len(old.fragment_table().rank),
        "fragments_new": len(plan.new_layout.fragment_table().rank),
        "transfers": len(plan.table),
        "kept_fraction": plan.numel_kept / (plan.numel_kept + plan.numel_moved),
        "busiest_member": member,
        "busiest_member_chunks": chunks,
    }
    del plan
    shared_transfer_table.cache_clear()
    tracemalloc.start()
    plan, _ = resize_planning(old, members)
    member_schedule(plan, member)
    row["peak_planner_bytes"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del plan
    shared_transfer_table.cache_clear()
    return row


def seventy_b_rows(model_config: str, from_ws: int, to_ws: int) -> list:
    from ds_dynatrain.cli.plan import plan_report

    out = []
    for stage in (2, 3):
        for assignment in ("best", "keep"):
            rep = plan_report(model_config, stage, from_ws, to_ws, "bfloat16", assignment)
            total = rep["bytes_moved"] + rep["bytes_kept"]
            out.append(
                {
                    "model": os.path.basename(model_config),
                    "zero_stage": stage,
                    "from": from_ws,
                    "to": to_ws,
                    "assignment": assignment,
                    "plan_seconds": rep["plan_seconds"],
                    "target_seconds": 1.0,
                    "ratio_to_target": rep["plan_seconds"] / 1.0,
                    "kept_fraction": rep["bytes_kept"] / total,
                    "bytes_moved": rep["bytes_moved"],
                    "transfers": rep["transfers"],
                    "parameters": rep["parameters"],
                }
            )
    return out


def tp_rows(model_config: str, from_ws: int = 64, to_ws: int = 48, tp_from: int = 8, tp_to: int = 4) -> list:
    from ds_dynatrain.cli.plan_tp import tp_plan_report

    out = []
    for stage in (1, 2, 3):
        rep = tp_plan_report(model_config, stage, from_ws, to_ws, tp_from, tp_to, "bfloat16")
        total = rep["bytes_moved"] + rep["bytes_kept"]
        out.append(
            {
                "model": os.path.basename(model_config),
                "zero_stage": stage,
                "from": from_ws,
                "to": to_ws,
                "tensor_parallel_from": tp_from,
                "tensor_parallel_to": tp_to,
                "plan_seconds": rep["plan_seconds"],
                "target_seconds": 1.0,
                "ratio_to_target": rep["plan_seconds"] / 1.0,
                "kept_fraction": rep["bytes_kept"] / total,
                "bytes_kept": rep["bytes_kept"],
                "bytes_kept_upper_bound": rep["bytes_kept_upper_bound"],
                "bytes_moved": rep["bytes_moved"],
                "transfers": rep["transfers"],
            }
        )
    return out


def print_tp_rows(rows: list) -> None:
    for r in rows:
        a, b = r["tensor_parallel_from"], r["tensor_parallel_to"]
        print(
            f"AutoTP ZeRO-{r['zero_stage']} TP {a} x DP {r['from'] // a} -> TP {b} x DP {r['to'] // b}: planned in "
            f"{r['plan_seconds'] * 1e3:6.1f} ms (target 1000 ms, ratio {r['ratio_to_target']:.3f}); kept "
            f"{r['bytes_kept'] / 2**30:.1f} GiB, upper bound {r['bytes_kept_upper_bound'] / 2**30:.1f} GiB "
            f"({100 * r['kept_fraction']:.1f} % stays), {r['bytes_moved'] / 2**30:.0f} GiB move, "
            f"{r['transfers']} transfers"
        )


def print_small(small: list) -> None:
    r0 = small[0]
    print(f"{r0['parameters'] / 1e9:.1f} B parameters, {r0['from']} -> {r0['to']} ranks")
    for r in small:
        print(
            f"ZeRO-{r['zero_stage']} {r['assignment']:>5} assignment: planned in {r['plan_seconds'] * 1e3:6.1f} ms "
            f"(target 1000 ms, ratio {r['ratio_to_target']:.3f}); {100 * r['kept_fraction']:.1f} % of the state "
            f"stays in place, {r['bytes_moved'] / 2**30:.0f} GiB move, {r['transfers']} transfers"
        )


def print_large(large: list) -> None:
    if large:
        print(f"{large[0]['parameters'] / 1e9:.1f} B parameters: plan + XOR schedule of one process, best assignment")
    for r in large:
        print(
            f"ZeRO-{r['zero_stage']} {r['from']:>5} -> {r['to']:>5}: {r['seconds']:6.2f} s "
            f"(plan {r['plan_seconds']:.2f} s + schedule {r['schedule_seconds']:.3f} s; {r['cpu_seconds']:.2f} CPU s; "
            f"target {r['target_seconds']:.0f} s, ratio {r['ratio_to_target']:.2f}); peak planner memory "
            f"{r['peak_planner_bytes'] / 2**20:.0f} MiB; {r['transfers']} transfers from "
            f"{r['fragments_old']} -> {r['fragments_new']} fragments; {100 * r['kept_fraction']:.1f} % stays"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default=os.path.join(MODELS, "llama2_70b.json"))
    ap.add_argument("--from", dest="from_ws", type=int, default=64)
    ap.add_argument("--to", dest="to_ws", type=int, default=48)
    ap.add_argument("--scale-model-config", default=os.path.join(MODELS, "llama3_405b.json"))
    ap.add_argument("--no-scale", action="store_true", help="only the 70 B rows")
    ap.add_argument("--no-tp", action="store_true", help="without the AutoTP rows")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    small = seventy_b_rows(a.model_config, a.from_ws, a.to_ws)
    tp = [] if a.no_tp else tp_rows(a.model_config)
    large = [] if a.no_scale else [scale_row(*r, a.scale_model_config) for r in SCALE_ROWS]
    if a.json:
        for r in small + tp + large:
            print(json.dumps(r))
        return 0
    print_small(small)
    print_tp_rows(tp)
    print_large(large)
    return 0


if __name__ == "__main__":
    sys.exit(main())
