"""The demo: the main job resized online 2 -> 3 -> 1 -> 2, beside the same job run statically.

    python examples/demo.py --compare-static --out runs/demo

runs ``dynatrain launch --nproc 2 --slots 3 --config configs/zero2_elastic.json examples/train_lm.py``,
then (with ``--compare-static``) the same job with the resize schedule removed, and writes
``OUT/metrics.jsonl``, ``OUT/static.jsonl`` and ``OUT/loss.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def slots_for(config: str, nproc: int) -> int:
    """The workers this host must hold: the largest world size of the config's resize schedule."""
    with open(config) as f:
        schedule = json.load(f).get("dynatrain", {}).get("resize_schedule", [])
    return max([nproc] + [int(e["world_size"]) for e in schedule])


def run_job(config: str, out: str, metrics: str, steps: int, nproc: int, extra=()) -> float:
    cmd = [
        sys.executable,
        "-m",
        "ds_dynatrain.cli",
        "launch",
        "--nproc",
        str(nproc),
        "--slots",
        str(slots_for(config, nproc)),
        "--config",
        config,
        os.path.join(HERE, "train_lm.py"),
        "--steps",
        str(steps),
        "--metrics",
        metrics,
        "--snapshot-dir",
        os.path.join(out, "snapshots" if not extra else "snapshots-static"),
        *extra,
    ]
    print("$ dynatrain " + " ".join(cmd[3:]), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd)
    if rc != 0:
        sys.exit(f"demo: the job failed with status {rc}")
    return time.time() - t0


def losses(path: str) -> dict:
    with open(path) as f:
        return {r["step"]: r for r in map(json.loads, f) if r["event"] == "step"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "zero2_elastic.json"))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "demo"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--compare-static", action="store_true", help="also run the job without resizes and compare")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    metrics, static = os.path.join(a.out, "metrics.jsonl"), os.path.join(a.out, "static.jsonl")
    for f in (metrics, static):
        if os.path.exists(f):
            os.remove(f)

    t_elastic = run_job(a.config, a.out, metrics, a.steps, a.nproc)
    t_static = run_job(a.config, a.out, static, a.steps, a.nproc, ["--static"]) if a.compare_static else None

    from ds_dynatrain.cli.plot import plot_losses, read_metrics

    png = os.path.join(a.out, "loss.png")
    plot_losses(metrics, png, static_path=static if a.compare_static else None)

    print("\n=== demo summary ===")
    for r in read_metrics(metrics):
        if r["event"] == "resize":
            print(
                f"resize {r['from']} -> {r['to']} after step {r['step']}: {r['bytes_moved'] / 2**20:.1f} MiB moved "
                f"in {r['seconds']:.2f} s (plan {r['plan_s']:.3f}, group {r['group_s']:.2f}, "
                f"transfer {r['transfer_s']:.3f}, rebuild {r['rebuild_s']:.2f} s)"
            )
    el = losses(metrics)
    print(f"elastic run: {len(el)} steps in {t_elastic:.0f} s, final loss {el[max(el)]['loss']:.4f}")
    for ws in sorted({r["world_size"] for r in el.values()}):
        rates = sorted(r["samples_per_s"] for r in el.values() if r["world_size"] == ws)
        print(f"  world size {ws}: {len(rates)} steps, median {rates[len(rates) // 2]:.1f} samples/s")
    if a.compare_static:
        st = losses(static)
        diff = max(abs(el[s]["loss"] - st[s]["loss"]) for s in el if s in st)
        print(f"static run:  {len(st)} steps in {t_static:.0f} s, final loss {st[max(st)]['loss']:.4f}")
        print(f"largest |elastic - static| loss difference over all steps: {diff:.2e}")
    print(f"metrics: {metrics}\nplot:    {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
