"""What ``benchmarks.tp_reconfig`` and ``benchmarks.pp_reconfig`` share: one layout switch A -> B
run both ways (ours in one job; DeepSpeed's route: save at A, ``ds_to_universal``, relaunch at B
with ``load_universal``) and the figures derived from them. Times in seconds, sizes in bytes."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, List

from benchmarks.reconfig import JobFailed, parse_transitions, read_json, run_job, run_plain
from benchmarks.switch_worker import PREPARE_AHEAD


@dataclass(frozen=True)
class SwitchKind:
    """Which degree a benchmark switches.

    Attributes:
        worker: the worker script (modes ``ours``, ``ds-save``, ``ds-load`` and, with
            ``ours_load``, ``ours-load``).
        flag: the worker's degree flags are ``--<flag>-from``/``--<flag>-to`` (``tp``, ``pp``).
        label: the degree's name in tables (``TP``, ``PP``).
        key: the result's keys ``<key>_from``/``<key>_to`` (``tensor_parallel``, ``pipeline_parallel``).
        ours_load: also load the route's unconverted checkpoint at B with ``ds_dynatrain``.
    """

    worker: str
    flag: str
    label: str
    key: str
    ours_load: bool = False


def run_ours(kind: SwitchKind, a_from: int, b_to: int, a, work: str, model_args: List[str], prepare: bool) -> dict:
    """Our switch A -> B in one job of ``--world`` processes; ``prepare``: announced
    :data:`~benchmarks.switch_worker.PREPARE_AHEAD` steps ahead with ``engine.prepare_resize``.
    Returns rank 0's result."""
    name = f"ours_{kind.flag}{a_from}to{b_to}{'_prepared' if prepare else ''}"
    out = os.path.join(work, f"{name}.json")
    args = [
        *("--mode", "ours", *model_args, f"--{kind.flag}-from", str(a_from), f"--{kind.flag}-to", str(b_to)),
        *("--steps-before", str(a.steps_before), "--steps-after", str(a.steps_after), "--out", out),
        *(("--prepare",) if prepare else ()),
    ]
    run_plain(a.world, args, work, name, a.timeout, worker=kind.worker)
    return read_json(out, os.path.join(work, f"{name}_rank0.log"))


def run_deepspeed(kind: SwitchKind, a_from: int, b_to: int, a, work: str, model_args: List[str]) -> dict:
    """DeepSpeed's route A -> B: save at A, ds_to_universal, relaunch at B (and, with
    ``kind.ours_load``, our load of the unconverted checkpoint at B)."""
    name = f"ds_{kind.flag}{a_from}to{b_to}"
    k = a.steps_before
    ckpt = os.path.join(work, f"{name}_ckpt")
    tag = f"global_step{k}"
    common = [*model_args, f"--{kind.flag}-from", str(a_from), f"--{kind.flag}-to", str(b_to), "--dir", ckpt]
    save_out = os.path.join(work, f"{name}_save.json")
    args = ["--mode", "ds-save", *common, "--tag", tag, "--steps", str(k), "--out", save_out]
    run_plain(a.world, args, work, f"{name}_save", a.timeout, worker=kind.worker)
    save = read_json(save_out, os.path.join(work, f"{name}_save_rank0.log"))
    uni_tag = f"{tag}_universal"
    convert_s = run_job(
        [
            *(sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state"),
            *("--input_folder", os.path.join(ckpt, tag), "--output_folder", os.path.join(ckpt, uni_tag)),
            *("--num_extract_workers", str(a.convert_workers), "--num_merge_workers", str(a.convert_workers)),
        ],
        os.path.join(work, f"{name}_convert.log"),
        a.timeout,
        f"ds_to_universal {kind.label} {a_from}->{b_to}",
    )

    def load(mode: str, load_tag: str) -> tuple:
        out = os.path.join(work, f"{name}_{mode}.json")
        args = ["--mode", mode, *common, "--tag", load_tag, "--steps", "1", "--first-step", str(k), "--out", out]
        t_start = run_plain(a.world, args, work, f"{name}_{mode}", a.timeout, worker=kind.worker)
        return t_start, read_json(out, os.path.join(work, f"{name}_{mode}_rank0.log"))

    t_start, loaded = load("ds-load", uni_tag)
    out = {
        "save_s": save["save_s"],
        "convert_s": convert_s,
        "relaunch_startup_s": loaded["t_init"] - t_start,
        "relaunch_load_s": loaded["t_load"] - loaded["t_init"],
        "relaunch_first_step_s": loaded["t_first_step"] - loaded["t_load"],
        "checkpoint_bytes": save["checkpoint_bytes"],
        "first_loss": loaded["iterations"][0][1],
    }
    if kind.ours_load:
        _, ours = load("ours-load", tag)
        out.update(ours_load_s=ours["t_load"] - ours["t_init"], ours_load_first_loss=ours["iterations"][0][1])
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


def switch(kind: SwitchKind, a_from: int, b_to: int, a, work: str, model_args: List[str]) -> dict:
    """Both routes for A -> B and the figures derived from them (seconds, bytes): ours announced
    (the headline) and cold.

    Announced: ``engine.prepare_resize`` (with the degree B) before step K - 1 (``--steps-before``
    K, 5 by default), whose background thread (at nice 19) touches the memory the new layout will
    need while the last two steps train, as a scheduled switch is by itself: ``prepared_bytes``,
    ``prepared_touch_s``; ``prepare_call_s``, the call itself on the training thread;
    ``prepared_steps_s``, those steps' times beside ``unprepared_iter_s``, the median of the ones
    before (the first left out). Cold (``cold_*``): the same job with ``engine.resize`` alone;
    ``cold_ratio`` = ``deepspeed_route_s / cold_s``."""
    ours = run_ours(kind, a_from, b_to, a, work, model_args, prepare=True)
    cold = run_ours(kind, a_from, b_to, a, work, model_args, prepare=False)
    ds = run_deepspeed(kind, a_from, b_to, a, work, model_args)
    rec = ours["record"]
    excess = ours["first_step_excess_s"]
    ours_s = rec["seconds"] + excess
    cold_s = cold["record"]["seconds"] + cold["first_step_excess_s"]
    # as for ours, the route's downtime ends at the first *normal* step at B: its first step counts
    # only by its excess over a normal iteration at B
    ds["relaunch_first_step_excess_s"] = max(0.0, ds["relaunch_first_step_s"] - ours["new_iter_s"])
    ds["relaunch_s"] = ds["relaunch_startup_s"] + ds["relaunch_load_s"] + ds["relaunch_first_step_excess_s"]
    route = ds["save_s"] + ds["convert_s"] + ds["relaunch_s"]
    ranks = ours["ranks"]
    # what the switch itself needs: the cold run's (the announced one frees its held memory at the
    # start of the switch and takes it back, so its resident set before already holds it)
    peak = max(r["hwm"] - r["rss_before"] for r in cold["ranks"])
    transient = max(r["hwm"] - max(r["rss_before"], r["rss_after"]) for r in cold["ranks"])
    shard = max(max(r["state_bytes_before"], r["state_bytes_after"]) for r in ranks)
    first_loss_ours = ours["iterations_after"][0][1]
    out = {
        "switch": f"{kind.label} {a_from}->{b_to}",
        "world_size": a.world,
        f"{kind.key}_from": a_from,
        f"{kind.key}_to": b_to,
        "params": ours["params"],
        "train_batch_size": a.global_batch,
        "ours_s": ours_s,
        "resize_seconds": rec["seconds"],
        "plan_s": rec["plan_s"],
        "transfer_s": rec["transfer_s"],
        "keep_s": rec.get("keep_s"),
        "rebuild_s": rec["rebuild_s"],
        "first_step_excess_s": excess,
        "bytes_moved": rec["bytes_moved"],
        "bytes_kept": rec["bytes_kept"],
        "bytes_sent": rec["bytes_sent"],
        "bytes_received": rec["bytes_received"],
        "prepared_bytes": max(r.get("prepared_bytes", 0) for r in ranks),
        "prepare_call_s": ours["prepare_call_s"],
        "prepared_touch_s": max(r.get("prepared_touch_s", 0.0) for r in ranks),
        "prepared_steps_s": [t for t, _ in ours["iterations_before"][-PREPARE_AHEAD:]],
        "unprepared_iter_s": statistics.median(t for t, _ in ours["iterations_before"][1:-PREPARE_AHEAD]),
        "cold_s": cold_s,
        "cold_resize_s": cold["record"]["seconds"],
        "cold_keep_s": cold["record"].get("keep_s"),
        "cold_rebuild_s": cold["record"]["rebuild_s"],
        "cold_first_step_excess_s": cold["first_step_excess_s"],
        "prepared_peak_extra_bytes": max(r["hwm"] - r["rss_before"] + r.get("prepared_bytes", 0) for r in ranks),
        "old_iter_s": ours["old_iter_s"],
        "new_iter_s": ours["new_iter_s"],
        "deepspeed_route_s": route,
        **{k: v for k, v in ds.items() if k != "first_loss"},
        "ratio": route / ours_s if ours_s > 0 else None,
        "cold_ratio": route / cold_s if cold_s > 0 else None,
        "peak_extra_bytes": peak,
        "transient_bytes": transient,
        "largest_shard_bytes": shard,
        "peak_ratio": peak / shard,
        "ranks": ranks,
        "first_loss_ours": first_loss_ours,
        "first_loss_deepspeed": ds["first_loss"],
        "same_loss": first_loss_ours == ds["first_loss"] == cold["iterations_after"][0][1],
        "record": rec,
    }
    if kind.ours_load:
        load_route_s = ds["convert_s"] + ds["relaunch_load_s"]
        out["load_route_s"] = load_route_s
        out["load_ratio"] = load_route_s / ds["ours_load_s"] if ds["ours_load_s"] > 0 else None
        out["same_loss_after_load"] = ds["ours_load_first_loss"] == ds["first_loss"]
    return out


def print_switches(results: List[dict], label: str, fmt: Callable) -> None:
    """The table of switches, one line each, and its legend."""
    mib = 2**20
    print(
        f"\n{'switch':<9} {'ours':>7} {'plan':>6} {'xfer':>6} {'keep':>6} {'rebuild':>7} {'excess':>6} "
        f"{'held MiB':>8} {'touch':>6} | "
        f"{'cold':>6} {'excess':>6} | {'route':>7} {'save':>6} {'convert':>7} {'relaunch':>8} | {'ratio':>6} "
        f"{'cold':>6} | "
        f"{'peak+ MiB':>9} {'shard MiB':>9} {'peak/shard':>10} | {'same loss':>9}"
    )
    for r in results:
        print(
            f"{r['switch']:<9} {r['ours_s']:>7.3f} {r['plan_s']:>6.3f} {r['transfer_s']:>6.3f} "
            f"{fmt(r['keep_s'], '.3f', 6)} {r['rebuild_s']:>7.3f} {r['first_step_excess_s']:>6.3f} "
            f"{r['prepared_bytes'] / mib:>8.0f} {r['prepared_touch_s']:>6.2f} | {r['cold_s']:>6.3f} "
            f"{r['cold_first_step_excess_s']:>6.3f} | {r['deepspeed_route_s']:>7.2f} {r['save_s']:>6.2f} "
            f"{r['convert_s']:>7.2f} {r['relaunch_s']:>8.2f} | {fmt(r['ratio'], '.1f', 6)} "
            f"{fmt(r['cold_ratio'], '.1f', 6)} | "
            f"{r['peak_extra_bytes'] / mib:>9.1f} {r['largest_shard_bytes'] / mib:>9.1f} {r['peak_ratio']:>10.2f} | "
            f"{'yes' if r['same_loss'] else 'no':>9}"
        )
    print(
        "\nseconds; ours = switch record + first step's excess, the switch announced two steps ahead "
        "(engine.prepare_resize: held = memory touched in the background during those steps and freed at the "
        "switch, touch = seconds the touching took; keep = copies into the new partitions); cold = the same with "
        "engine.resize alone; route = save + ds_to_universal + relaunch (start, "
        f"load, first step's excess over ours at the new {label}); ratio = route / ours; peak+ = largest rise of a "
        "rank's peak resident set during the cold switch over its resident set before; shard = largest fp32 master + "
        "2 moments of one rank; same loss = the first step after the switch has bitwise the same loss on both routes"
    )


def print_loads(results: List[dict], label: str, fmt: Callable) -> None:
    """The table of loads of the route's unconverted checkpoint at the new degree (``ours_load``),
    one line per switch, and its legend."""
    print(f"\n{'load':<9} {'ours':>7} | {'route':>7} {'convert':>7} {'load':>6} | {'ratio':>6} | {'same loss':>9}")
    for r in results:
        print(
            f"{r['switch']:<9} {r['ours_load_s']:>7.3f} | {r['load_route_s']:>7.2f} {r['convert_s']:>7.2f} "
            f"{r['relaunch_load_s']:>6.2f} | {fmt(r['load_ratio'], '.1f', 6)} | "
            f"{'yes' if r['same_loss_after_load'] else 'no':>9}"
        )
    print(
        f"\nloading the route's saved checkpoint at the new {label} in fresh processes, seconds: ours = "
        f"engine.load_checkpoint of the unconverted DeepSpeed checkpoint (a load across {label} degrees); route = "
        "ds_to_universal + load_checkpoint with load_universal; same loss = the first step after both loads"
    )


def common_arguments(ap: argparse.ArgumentParser, label: str) -> None:
    """The arguments both benchmarks take (the model's own are each benchmark's)."""
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--world", type=int, default=2, help="processes (unchanged by the switch)")
    ap.add_argument(
        "--switches", type=parse_transitions, default=parse_transitions("2:1,1:2"), help=f"A:B,... {label} degrees"
    )
    ap.add_argument("--global-batch", type=int, default=4, help="global batch, sequences (a multiple of every DP size)")
    ap.add_argument(
        "--steps-before",
        type=int,
        default=5,
        help=f"optimizer steps at the old {label} before the switch (K; the switch is announced before the last 2)",
    )
    ap.add_argument("--steps-after", type=int, default=4, help=f"optimizer steps at the new {label}")
    ap.add_argument("--convert-workers", type=int, default=2, help="ds_to_universal extract and merge workers")
    ap.add_argument("--timeout", type=float, default=1800.0, help="limit of each job, seconds")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint directory goes")
    ap.add_argument("--json", action="store_true", help="one JSON object per switch")


def check_arguments(ap: argparse.ArgumentParser, a, label: str) -> None:
    """Refuse step counts and degrees the benchmark cannot run (``ap.error``)."""
    if a.steps_before < PREPARE_AHEAD + 2 or a.steps_after < 2:
        ap.error(f"--steps-before must be >= {PREPARE_AHEAD + 2} and --steps-after >= 2")
    for pair in a.switches:
        for d in pair:
            if a.world % d or a.global_batch % (a.world // d):
                ap.error(
                    f"{label} {d} must divide --world {a.world} and its DP size the --global-batch {a.global_batch}"
                )


def run_switches(kind: SwitchKind, a, model_args: List[str], print_table: Callable) -> int:
    """Every switch of ``--switches`` both ways, in a temporary directory under ``--dir``; one JSON
    object per switch with ``--json``, else ``print_table(results, a)``. Returns the exit status
    (1: a job failed, the tail of its log printed)."""
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"dynatrain-{kind.flag}-reconfig-", dir=a.dir)
    results = []
    try:
        for a_from, b_to in a.switches:
            r = switch(kind, a_from, b_to, a, work, model_args)
            results.append(r)
            if a.json:
                print(json.dumps(r), flush=True)
    except JobFailed as err:
        print(f"benchmarks.{kind.flag}_reconfig: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not a.json:
        print_table(results, a)
    return 0
