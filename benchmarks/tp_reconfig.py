"""TP switch downtime: our online switch of an AutoTP job beside DeepSpeed's universal-checkpoint route.

    python -m benchmarks.tp_reconfig [--params 100M] [--switches 2:1,1:2] [--world 2] [--json] [--dir DIR]

One run, on this machine, ``--world`` processes (2), a Llama-shaped model (vocabulary 8192, hidden
768, MLP 2048, 12 query heads and ``--kv-heads`` 4 key/value heads 64 wide, untied embeddings,
sequence length 64, micro-batch 1; ``--params`` picks the number of layers, 14 for about 101 M
parameters; ``--hidden``/``--layers`` override), AutoTP + ZeRO-2, fp32, AdamW (``torch_adam``
with ``fused``), the same global batch (``--global-batch`` sequences) and the same tokens at every
step in every job. Per switch A->B of the TP degree (DP goes from world/A to world/B):

* ``ours``: ``ds_dynatrain.initialize`` at TP A (``tensor_parallel.autotp_size``; 1: not cut yet
  but switchable), K steps (``--steps-before``), ``engine.resize(world, tensor_parallel=B)``,
  ``--steps-after`` steps at TP B. ``ours_s`` = the record's ``seconds`` + ``first_step_excess_s``
  (how much longer the first iteration at TP B takes than the median of the later ones): the
  downtime between the last step at A and the first normal step at B. Split: ``plan_s``,
  ``transfer_s`` (the point-to-point exchange of the fp32 master and both moments),
  ``rebuild_s`` (the model cut again by AutoTP, the engine rebuilt, the state installed).
* ``deepspeed``: plain ``deepspeed.initialize`` ranks at TP A train K steps and
  ``save_checkpoint`` (``save_s``); ``python -m deepspeed.checkpoint.ds_to_universal
  --inject_missing_state`` (``convert_s``, the whole command; the flag gives a TP-1 checkpoint,
  which carries no ``universal_checkpoint_info``, the version-only one the converter requires; a
  TP-2 checkpoint carries AutoTP's own); fresh ranks at TP B with ``checkpoint.load_universal``
  load it and train one step (``relaunch_s``: from starting the processes to the end of their
  load, plus how much longer their first step takes than a normal iteration at B, ``new_iter_s``,
  measured in our run: the same end point as ours). ``deepspeed_route_s`` = the sum; ``ratio`` =
  ``deepspeed_route_s / ours_s``. ``same_loss``: the first step after the switch has bitwise the
  same loss on both routes.
* a load across TP degrees: fresh ranks at TP B with ``ds_dynatrain.initialize`` load the route's
  saved (unconverted) TP-A checkpoint with ``engine.load_checkpoint`` (``ours_load_s``) and train
  one step; against ``load_route_s`` = ``convert_s`` + ``relaunch_load_s`` (``load_ratio``), and
  ``same_loss_after_load``: their first losses are bitwise equal.
* memory, per rank: ``peak_extra_bytes`` = the peak resident set during ``engine.resize``
  (``VmHWM`` of ``/proc/self/status``, reset to the resident set by writing 5 to
  ``/proc/self/clear_refs`` right before the call) minus the resident set right before it: what
  the switch needed on top of the job as it stood (the largest over the ranks);
  ``transient_bytes``: the peak above both the resident set before and after (the part that is
  gone once the switch returned). ``largest_shard_bytes``: the largest ZeRO partition of one rank
  of the fp32 master and both Adam moments, over the ranks and both layouts; ``peak_ratio`` =
  ``peak_extra_bytes / largest_shard_bytes`` (aim: at most 1.25). The resident set counts what
  the process holds from the OS, torch's CPU tensors and everything else.

Times in seconds, sizes in bytes. ``--json`` prints one JSON object per switch; otherwise a table,
one line per switch. Checkpoints and logs go to a temporary directory under ``--dir`` that is
removed at the end. A failed job stops the run with the tail of its log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import List, Tuple

from benchmarks.reconfig import (
    VOCAB,
    JobFailed,
    fmt,
    layers_for,
    parse_count,
    parse_transitions,
    read_json,
    run_job,
    run_plain,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "tp_reconfig_worker.py")


def parse_switches(text: str) -> List[Tuple[int, int]]:
    """``A:B,...`` TP degrees (``benchmarks.reconfig``'s transitions: A != B, both >= 1)."""
    return parse_transitions(text)


def model_args(a) -> List[str]:
    return [
        *("--hidden", str(a.hidden), "--layers", str(a.layers), "--kv-heads", str(a.kv_heads)),
        *("--seq-len", str(a.seq_len), "--global-batch", str(a.global_batch)),
    ]


def run_ours(tp_from: int, tp_to: int, a, work: str) -> dict:
    """Our switch A -> B in one job of ``--world`` processes. Returns rank 0's result."""
    name = f"ours_tp{tp_from}to{tp_to}"
    out = os.path.join(work, f"{name}.json")
    args = [
        *("--mode", "ours", *model_args(a), "--tp-from", str(tp_from), "--tp-to", str(tp_to)),
        *("--steps-before", str(a.steps_before), "--steps-after", str(a.steps_after), "--out", out),
    ]
    run_plain(a.world, args, work, name, a.timeout, worker=WORKER)
    return read_json(out, os.path.join(work, f"{name}_rank0.log"))


def run_deepspeed(tp_from: int, tp_to: int, a, work: str) -> dict:
    """DeepSpeed's route A -> B: save at A, ds_to_universal, relaunch at B. Times in seconds."""
    name = f"ds_tp{tp_from}to{tp_to}"
    k = a.steps_before
    ckpt = os.path.join(work, f"{name}_ckpt")
    tag = f"global_step{k}"
    common = [*model_args(a), "--tp-from", str(tp_from), "--tp-to", str(tp_to), "--dir", ckpt]
    save_out = os.path.join(work, f"{name}_save.json")
    args = ["--mode", "ds-save", *common, "--tag", tag, "--steps", str(k), "--out", save_out]
    run_plain(a.world, args, work, f"{name}_save", a.timeout, worker=WORKER)
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
        f"ds_to_universal TP {tp_from}->{tp_to}",
    )
    load_out = os.path.join(work, f"{name}_load.json")
    args = ["--mode", "ds-load", *common, "--tag", uni_tag, "--steps", "1", "--first-step", str(k), "--out", load_out]
    t_start = run_plain(a.world, args, work, f"{name}_load", a.timeout, worker=WORKER)
    load = read_json(load_out, os.path.join(work, f"{name}_load_rank0.log"))
    ours_out = os.path.join(work, f"{name}_ours_load.json")
    args = ["--mode", "ours-load", *common, "--tag", tag, "--steps", "1", "--first-step", str(k), "--out", ours_out]
    run_plain(a.world, args, work, f"{name}_ours_load", a.timeout, worker=WORKER)
    ours_load = read_json(ours_out, os.path.join(work, f"{name}_ours_load_rank0.log"))
    shutil.rmtree(ckpt, ignore_errors=True)
    return {
        "ours_load_s": ours_load["t_load"] - ours_load["t_init"],
        "ours_load_first_loss": ours_load["iterations"][0][1],
        "save_s": save["save_s"],
        "convert_s": convert_s,
        "relaunch_startup_s": load["t_init"] - t_start,
        "relaunch_load_s": load["t_load"] - load["t_init"],
        "relaunch_first_step_s": load["t_first_step"] - load["t_load"],
        "checkpoint_bytes": save["checkpoint_bytes"],
        "first_loss": load["iterations"][0][1],
    }


def switch(tp_from: int, tp_to: int, a, work: str) -> dict:
    """Both routes for TP A -> B and the figures derived from them (seconds, bytes)."""
    ours = run_ours(tp_from, tp_to, a, work)
    ds = run_deepspeed(tp_from, tp_to, a, work)
    rec = ours["record"]
    excess = ours["first_step_excess_s"]
    ours_s = rec["seconds"] + excess
    # as for ours, the route's downtime ends at the first *normal* step at B: its first step counts
    # only by its excess over a normal iteration at B
    ds["relaunch_first_step_excess_s"] = max(0.0, ds["relaunch_first_step_s"] - ours["new_iter_s"])
    ds["relaunch_s"] = ds["relaunch_startup_s"] + ds["relaunch_load_s"] + ds["relaunch_first_step_excess_s"]
    route = ds["save_s"] + ds["convert_s"] + ds["relaunch_s"]
    ranks = ours["ranks"]
    peak = max(r["hwm"] - r["rss_before"] for r in ranks)
    transient = max(r["hwm"] - max(r["rss_before"], r["rss_after"]) for r in ranks)
    shard = max(max(r["state_bytes_before"], r["state_bytes_after"]) for r in ranks)
    first_loss_ours = ours["iterations_after"][0][1]
    return {
        "switch": f"TP {tp_from}->{tp_to}",
        "world_size": a.world,
        "tensor_parallel_from": tp_from,
        "tensor_parallel_to": tp_to,
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
        "old_iter_s": ours["old_iter_s"],
        "new_iter_s": ours["new_iter_s"],
        "deepspeed_route_s": route,
        **{k: v for k, v in ds.items() if k != "first_loss"},
        "ratio": route / ours_s if ours_s > 0 else None,
        "peak_extra_bytes": peak,
        "transient_bytes": transient,
        "largest_shard_bytes": shard,
        "peak_ratio": peak / shard,
        "ranks": ranks,
        "first_loss_ours": first_loss_ours,
        "first_loss_deepspeed": ds["first_loss"],
        "same_loss": first_loss_ours == ds["first_loss"],
        "load_route_s": ds["convert_s"] + ds["relaunch_load_s"],
        "load_ratio": (ds["convert_s"] + ds["relaunch_load_s"]) / ds["ours_load_s"] if ds["ours_load_s"] > 0 else None,
        "same_loss_after_load": ds["ours_load_first_loss"] == ds["first_loss"],
        "record": rec,
    }


def print_table(results: List[dict], a) -> None:
    r0 = results[0]
    print(
        f"model: {r0['params'] / 1e6:.1f} M parameters (hidden {a.hidden}, {a.layers} layers, "
        f"{a.hidden // 64} heads / {a.kv_heads} KV heads, vocabulary {VOCAB}, sequence {a.seq_len}), AutoTP + ZeRO-2 "
        f"fp32 AdamW, {a.world} processes, global batch {a.global_batch}, micro-batch 1; switch after step "
        f"{a.steps_before}"
    )
    mib = 2**20
    print(
        f"\n{'switch':<9} {'ours':>7} {'plan':>6} {'xfer':>6} {'rebuild':>7} {'excess':>6} | "
        f"{'route':>7} {'save':>6} {'convert':>7} {'relaunch':>8} | {'ratio':>6} | "
        f"{'peak+ MiB':>9} {'shard MiB':>9} {'peak/shard':>10} | {'same loss':>9}"
    )
    for r in results:
        print(
            f"{r['switch']:<9} {r['ours_s']:>7.3f} {r['plan_s']:>6.3f} {r['transfer_s']:>6.3f} {r['rebuild_s']:>7.3f} "
            f"{r['first_step_excess_s']:>6.3f} | {r['deepspeed_route_s']:>7.2f} {r['save_s']:>6.2f} "
            f"{r['convert_s']:>7.2f} {r['relaunch_s']:>8.2f} | {fmt(r['ratio'], '.1f', 6)} | "
            f"{r['peak_extra_bytes'] / mib:>9.1f} {r['largest_shard_bytes'] / mib:>9.1f} {r['peak_ratio']:>10.2f} | "
            f"{'yes' if r['same_loss'] else 'no':>9}"
        )
    print(
        "\nseconds; ours = switch record + first step's excess; route = save + ds_to_universal + relaunch (start, "
        "load, first step's excess over ours at the new TP); ratio = route / ours; peak+ = largest rise of a "
        "rank's peak resident set during the switch over its resident set before; shard = largest fp32 master + "
        "2 moments of one rank; same loss = the first step after the switch has bitwise the same loss on both routes"
    )
    print(f"\n{'load':<9} {'ours':>7} | {'route':>7} {'convert':>7} {'load':>6} | {'ratio':>6} | {'same loss':>9}")
    for r in results:
        print(
            f"{r['switch']:<9} {r['ours_load_s']:>7.3f} | {r['load_route_s']:>7.2f} {r['convert_s']:>7.2f} "
            f"{r['relaunch_load_s']:>6.2f} | {fmt(r['load_ratio'], '.1f', 6)} | "
            f"{'yes' if r['same_loss_after_load'] else 'no':>9}"
        )
    print(
        "\nloading the route's saved checkpoint at the new TP in fresh processes, seconds: ours = "
        "engine.load_checkpoint of the unconverted DeepSpeed checkpoint (a load across TP degrees); route = "
        "ds_to_universal + load_checkpoint with load_universal; same loss = the first step after both loads"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("100M"), help="model size to aim at")
    ap.add_argument("--hidden", type=int, default=768, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (overrides --params)")
    ap.add_argument("--kv-heads", type=int, default=4, help="key/value heads (dividing hidden / 64)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--world", type=int, default=2, help="processes (unchanged by the switch)")
    ap.add_argument("--switches", type=parse_switches, default=parse_switches("2:1,1:2"), help="A:B,... TP degrees")
    ap.add_argument("--global-batch", type=int, default=4, help="global batch, sequences (a multiple of every DP size)")
    ap.add_argument("--steps-before", type=int, default=3, help="optimizer steps at the old TP before the switch (K)")
    ap.add_argument("--steps-after", type=int, default=4, help="optimizer steps at the new TP")
    ap.add_argument("--convert-workers", type=int, default=2, help="ds_to_universal extract and merge workers")
    ap.add_argument("--timeout", type=float, default=1800.0, help="limit of each job, seconds")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint directory goes")
    ap.add_argument("--json", action="store_true", help="one JSON object per switch")
    a = ap.parse_args(argv)
    if a.hidden % 64 or (a.hidden // 64) % a.kv_heads:
        ap.error("--hidden must be a multiple of 64 and its 64-wide heads a multiple of --kv-heads")
    if a.steps_before < 1 or a.steps_after < 2:
        ap.error("--steps-before must be >= 1 and --steps-after >= 2")
    for tp_from, tp_to in a.switches:
        for tp in (tp_from, tp_to):
            if a.world % tp or a.global_batch % (a.world // tp):
                ap.error(f"TP {tp} must divide --world {a.world} and its DP size the --global-batch {a.global_batch}")
    if a.layers is None:
        a.layers = layers_for(a.params, a.hidden, a.kv_heads)
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="dynatrain-tp-reconfig-", dir=a.dir)
    results = []
    try:
        for tp_from, tp_to in a.switches:
            r = switch(tp_from, tp_to, a, work)
            results.append(r)
            if a.json:
                print(json.dumps(r), flush=True)
    except JobFailed as err:
        print(f"benchmarks.tp_reconfig: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not a.json:
        print_table(results, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
