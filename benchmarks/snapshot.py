"""Snapshot cost: our asynchronous engine beside DeepSpeed's default engine and PyTorch DCP.

    python -m benchmarks.snapshot [--json] [--hidden 768 --layers 12] [--dir DIR] [--worker-nice N] [--rounds R]
                                  [--unpaired]

One run: a Llama-shaped model (85 M parameters at the defaults; byte vocabulary), ZeRO-2,
2 ranks on this machine, a snapshot every ``--every`` steps, once per engine:

* ``dynatrain``: ds_dynatrain's asynchronous engine (lazy capture, io_uring + O_DIRECT flush);
* ``dynatrain-copy`` (not in the default ``--engines``): the same with
  ``snapshot.write_from_memory: false``, every tensor copied through the host cache;
* ``torch``: DeepSpeed's default ``TorchCheckpointEngine`` (``torch.save``, blocking);
* ``dcp``: ``torch.distributed.checkpoint.async_save`` of each rank's module and optimizer state.

Printed per engine: the stall of the training loop per snapshot (time the loop is held: the
``save`` call plus the wait for its capture at the next optimizer step), the plain step time, the flush
throughput of one snapshot, and the device bound measured in the same run (O_DIRECT sequential
write of the same size into the same directory, ``benchmarks.io_bound``), and the slowdown of the
mean iteration (snapshot steps included, the last snapshot's flush waited for inside the block)
against the mean iteration without snapshots, and the CPU time rank 0 spent per iteration (every
thread, user and system) against that baseline's: on a machine whose cores training fills, the
extra CPU time is what a snapshot takes from training. On a virtual machine the host may take
more: ``host steal`` is the extra CPU time the hypervisor withheld from the machine's CPUs per
iteration (``/proc/stat``'s ``steal``, all CPUs), as a share of the CPU time of a baseline
iteration (CPUs x its seconds). Where the host emulates the disk, its work for the snapshot's
writes lands there, and no change to the writer in the guest can take it back. ``less steal`` is
an estimate of the guest's own share: each round's slowdown less that round's host steal (their
median), which assumes each CPU-second the host stole cost training one second of one CPU.

The baseline is paired: each engine's job runs ``--steps`` iterations without snapshots, then
``--rounds`` times (default 5) ``--steps`` with them and ``--steps`` without again. Each block with
snapshots is compared with the mean of the two blocks without around it, and the slowdown is the
median of those rounds (the machine's speed drifts by more than the effect between separate jobs,
and by several percent between blocks of one job: the drift from the first block without to the
last and each round's slowdown are printed; with five rounds one outlier, often the round of a
job's first snapshot, leaves the median alone). ``--unpaired`` runs the blocks
with snapshots alone and compares them with a job of engine ``none``. ``--json`` prints one object
per engine with ``engine, stall_s, step_s, iter_s, baseline_iter_s, slowdown, cpu_s, cpu_overhead,
steal_s, steal_overhead, slowdown_less_steal, paired_drift, round_slowdowns, round_steal_overheads, flush_gbps,
bound_gbps, from_source_share`` (the share of rank 0's snapshot bytes written straight from the
tensors' memory; None for the other engines), and for ``dynatrain`` ``writer_cpu_s, writer_user_s,
writer_system_s, writer_wall_s, writer_first_cpu_s, writer_cpu_share``: the CPU seconds one rank's
optimizer-state file (the snapshot's share of a rank) costs our writer, written alone after the
jobs as ``dynatrain`` writes it (``benchmarks.io_bound.writer_cpu``: CRC-32C and the kernel's
O_DIRECT writes; the user/system split is the kernel's tick estimate, and system time misses
deferred kernel work), and every rank's such file as a share of the machine's CPU time over the
``--every`` baseline iterations between two snapshots: what the writing takes from training at
least, where training fills the CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY = "dynatrain-copy"  # ours with ``snapshot.write_from_memory: false``
RANKS = 2  # processes of each engine's job


def run_engine(engine: str, a, workdir: str) -> dict:
    snapshot = {"host_cache_mib": 256, **({} if a.worker_nice is None else {"worker_nice": a.worker_nice})}
    if engine == COPY:  # ours, every tensor copied through the host cache
        snapshot["write_from_memory"] = False
    cfg = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        "dynatrain": {
            "snapshot": snapshot,
            "log_interval_steps": 10**6,
        },
    }
    cfg_path = os.path.join(workdir, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    out = os.path.join(workdir, f"{engine}.json")
    cmd = [
        sys.executable,
        "-m",
        "ds_dynatrain.cli",
        "launch",
        "--nproc",
        str(RANKS),
        "--config",
        cfg_path,
        os.path.join(ROOT, "benchmarks", "snapshot_worker.py"),
        "--engine",
        "dynatrain" if engine == COPY else engine,
        "--hidden",
        str(a.hidden),
        "--layers",
        str(a.layers),
        "--steps",
        str(a.steps),
        "--every",
        str(a.every),
        "--dir",
        a.dir,
        "--out",
        out,
        *(["--paired", "--rounds", str(a.rounds)] if a.paired else []),
    ]
    env = dict(
        os.environ,
        DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"benchmark job for {engine} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(out) as f:
        return {**json.load(f), "engine": engine}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "dynatrain-snapshot-bench"))
    ap.add_argument(
        "--engines", default="dynatrain,torch,dcp", help="'none': a job without snapshots (the unpaired baseline)"
    )
    ap.add_argument(
        "--unpaired",
        dest="paired",
        action="store_false",
        help="no baseline blocks inside each engine's job: slowdowns against the 'none' job's",
    )
    ap.add_argument(
        "--rounds", type=int, default=5, help="paired: blocks with snapshots per engine, each between two without"
    )
    ap.add_argument("--worker-nice", type=int, default=None, help="snapshot.worker_nice (default: the config's)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as work:
        for e in a.engines.split(","):
            results.append(run_engine(e, a, work))
    from benchmarks.io_bound import run as io_run
    from benchmarks.io_bound import writer_cpu

    base = next((r for r in results if r["engine"] == "none"), None)
    results = [r for r in results if r["engine"] != "none"]
    if not results:  # only the job without snapshots: its figures are all there is
        print(
            json.dumps(base)
            if a.json
            else f"no snapshots: {base['iter_s']:.2f} s per iteration, {base['cpu_s']:.2f} CPU s on rank 0"
        )
        return 0
    size_mib = max(8, results[0]["snapshot_bytes"] >> 20)
    bound = io_run(size_mib, a.dir, 1, 32, 8, 64)["results"]["device_bound_odirect_uring"]["gib_per_s"] * 1.073741824
    # the CPU our writer costs one rank per snapshot apart from training (its largest file: the
    # optimizer state, half the snapshot), written from the tensors' memory as `dynatrain` writes it
    ours = next((r for r in results if r["engine"] == "dynatrain"), None)
    own = writer_cpu(max(1 << 20, ours["snapshot_bytes"] // RANKS), a.dir) if ours else None
    torch_stall = next((r["stall_s"] for r in results if r["engine"] == "torch"), None)
    for r in results:
        r["bound_gbps"] = bound
        r["stall_vs_torch"] = r["stall_s"] / torch_stall if torch_stall else None
        r["flush_vs_bound"] = r["flush_gbps"] / bound if bound else None
        if r.get("paired_base_iter_s"):  # the same job's blocks without snapshots, before and after
            r["baseline_iter_s"] = r["paired_base_iter_s"]
            r["slowdown"] = statistics.median(r["round_slowdowns"])
            r["cpu_overhead"] = r["cpu_s"] / r["paired_base_cpu_s"] - 1
            base_steal = r["paired_base_steal_s"]
        else:
            r["baseline_iter_s"] = base["iter_s"] if base else None
            r["slowdown"] = r["iter_s"] / base["iter_s"] - 1 if base else None
            r["cpu_overhead"] = r["cpu_s"] / base["cpu_s"] - 1 if base else None
            base_steal = base["steal_s"] if base else None
        if r is ours:
            # every rank writes one such file per snapshot: their CPU over the machine's CPU time in
            # the baseline iterations between two snapshots, what they take from training at least
            # where training fills the CPUs (system time misses the kernel's deferred work: a bound)
            r.update({f"writer_{k}": v for k, v in own.items() if k.endswith("_s")})
            base_iter = r["baseline_iter_s"]
            r["writer_cpu_share"] = RANKS * own["cpu_s"] / (r["cpus"] * a.every * base_iter) if base_iter else None
        # the host's extra steal per iteration, as a share of the machine's CPU time in a baseline
        # iteration: what the snapshot cost training outside every process of this machine
        r["steal_overhead"] = (
            (r["steal_s"] - base_steal) / (r["cpus"] * r["baseline_iter_s"]) if base_steal is not None else None
        )
        # an estimate of the slowdown the guest caused, each CPU-second the host stole counted as a
        # second of one CPU lost to training: per round where the blocks are paired
        if r.get("round_steal_overheads"):
            pairs = zip(r["round_slowdowns"], r["round_steal_overheads"])
            r["slowdown_less_steal"] = statistics.median(x - st for x, st in pairs)
        elif r["slowdown"] is not None and r["steal_overhead"] is not None:
            r["slowdown_less_steal"] = r["slowdown"] - r["steal_overhead"]
        else:
            r["slowdown_less_steal"] = None
    if a.json:
        for r in results:
            print(json.dumps({k: v for k, v in r.items() if k != "stalls"}))
        return 0
    print(
        f"model: {results[0]['params'] / 1e6:.0f} M parameters, ZeRO-2, 2 ranks, snapshot every {a.every} steps, "
        f"{results[0]['snapshot_bytes'] / 2**20:.0f} MiB per snapshot, dir {a.dir}"
    )
    if base:
        print(f"baseline (no snapshots): {base['iter_s']:.2f} s per iteration, {base['cpu_s']:.2f} CPU s on rank 0")
    for r in results:
        if r.get("from_source_share") is not None:
            print(
                f"{r['engine']}: {100 * r['from_source_share']:.0f} % of rank 0's snapshot bytes written straight "
                "from the tensors' memory, the rest copied through the host cache"
            )
        if r.get("paired_base_iter_s"):
            print(
                f"{r['engine']}: {r['paired_base_iter_s']:.2f} s per iteration without snapshots in the same job "
                f"(drift from the first block to the last: {100 * r['paired_drift']:+.1f} %); slowdown of each "
                f"round: {', '.join(f'{100 * x:.1f} %' for x in r['round_slowdowns'])}"
            )
    if ours and ours["writer_cpu_share"] is not None:
        print(
            f"our writer alone: {own['cpu_s']:.3f} CPU s per rank's file of {own['size_bytes'] / 2**20:.0f} MiB "
            f"(about {own['user_s']:.3f} user, {own['system_s']:.3f} system; {own['wall_s']:.3f} s wall; the "
            f"first write {own['first_cpu_s']:.3f}); {RANKS} ranks' files: {100 * ours['writer_cpu_share']:.1f} % "
            f"of the {ours['cpus']} CPUs' time over the {a.every} steps between snapshots"
        )
    print(
        f"{'engine':<14} {'stall/snapshot':>15} {'iteration':>10} {'slowdown':>9} {'flush':>11} {'bound':>11} "
        f"{'stall/torch':>12} {'flush/bound':>12} {'extra CPU':>10} {'host steal':>11} {'less steal':>11}"
    )
    for r in results:
        slow = f"{100 * r['slowdown']:>8.1f}%" if r["slowdown"] is not None else f"{'-':>9}"
        cpu = f"{100 * r['cpu_overhead']:>9.1f}%" if r["cpu_overhead"] is not None else f"{'-':>10}"
        vs_torch = f"{r['stall_vs_torch']:>12.3f}" if r["stall_vs_torch"] is not None else f"{'-':>12}"
        steal = f"{100 * r['steal_overhead']:>10.1f}%" if r["steal_overhead"] is not None else f"{'-':>11}"
        less = f"{100 * r['slowdown_less_steal']:>10.1f}%" if r["slowdown_less_steal"] is not None else f"{'-':>11}"
        print(
            f"{r['engine']:<14} {r['stall_s']:>13.3f} s {r['iter_s']:>8.2f} s {slow} "
            f"{r['flush_gbps']:>7.2f} GB/s {r['bound_gbps']:>7.2f} GB/s {vs_torch} "
            f"{r['flush_vs_bound']:>12.2f} {cpu} {steal} {less}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
