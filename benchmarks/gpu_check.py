"""The GPU check: the plugin's CUDA path on one GPU, in one short run with its own time limit.

    python -m benchmarks.gpu_check [--device auto|cuda|cpu] [--timeout 480] [--dir runs/gpu_check]

Three jobs of :mod:`benchmarks.gpu_check_worker`, ZeRO-2, fp32, on CUDA tensors:

* ``resize``: ``dynatrain launch --nproc 2`` over gloo (``dynatrain.dist_backend: "gloo"``: both
  processes on the one device, which NCCL refuses), resized 2 -> 1 after step 2 and 1 -> 2 after
  step 4 through ``engine.resize``, 6 steps; ``static``: the same job without resizes. Checked:
  the state gathered right before each resize equals, bitwise, the state right after it on the new
  world (fp32 master, Adam moments and step, working parameters); the state before the first
  resize equals, bitwise, the static run's at that step; every step's loss follows the static run's
  within 1e-4 relative, and the final state equals the static run's bitwise: the micro-batch is
  the same at both world sizes, and halving a gradient (``1/world`` before the reduction, or the
  loss over two accumulation steps) is exact in binary floating point.
* snapshots of the static job's device state after steps 3 and 5 with the plugin's snapshot
  engine: ``stall_s`` (what the training loop waited: ``save_checkpoint`` plus the capture wait
  before the next optimizer step), ``capture_gbps`` (bytes of one rank's files over the slowest
  rank's capture, device to pinned host memory) beside ``pinned_gbps``, torch's device-to-host
  copy into pinned memory measured in the same process right after (best of 4 copies of 256 MiB);
  the first snapshot's figures, and under ``"again"`` the second's (the first allocates the
  pinned staging memory, the second reuses it); ``from_source_share``: the share of rank 0's
  snapshot bytes written straight from the pinned stage, without a copy into the host cache.
* ``reload``: a process of its own, no launcher, so the accelerator's backend (NCCL on CUDA):
  a snapshot after step 2, two more steps, the snapshot loaded back; checked: the state after the
  load equals, bitwise, the state at the snapshot, and the steps between had changed it.

Prints one JSON line of figures (seconds, bytes, GB/s = 1e9 bytes/s) with ``"ok"``; exit status 0
when every check held, 1 otherwise (the JSON says which; the jobs' logs stay under ``--dir``).
Without a GPU (torch missing, a CPU build of torch, or no device visible) it prints one line,
``gpu-check: skipped: <why>``, and exits 0. ``--device cpu`` runs the same steps on the CPU
(gloo everywhere, no pinned copies) with a tiny model: how the flow is tested without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "gpu_check_worker.py")
# modules the jobs import besides torch (the packages a machine with a CUDA torch may lack)
NEEDED = ("deepspeed", "pydantic", "hostlist", "numpy", "scipy")
RESIZE = {2: 1, 4: 2}  # after step: world size
STEPS, SNAPSHOTS_AT, RELOAD_AT, RELOAD_STEPS = 6, (3, 5), 2, 4
LOSS_RTOL = 1e-4
# model sizes (vocabulary, hidden, layers): ~34 M parameters on a GPU, a few thousand on a CPU
SIZES = {"cuda": (4096, 1024, 3), "cpu": (64, 16, 1)}


# what a machine with a CUDA torch (and numpy, scipy, einops, msgpack, ninja, psutil, py-cpuinfo,
# tqdm, packaging) still needs, as wheels (``make gpu-wheels``): published binary wheels, and
# packages published as source only, built where the wheels are made. liburing is left out: no
# wheel of 2024.5.3 for every Python, and without it the snapshot writer falls back to pwrite
WHEELS = {
    "binary": (
        "pydantic",
        "pydantic-core",
        "annotated-types",
        "typing-inspection",
        "typing-extensions",
        "hjson",
        "crc32c",
        "google-crc32c",
    ),
    "source": ("deepspeed", "python-hostlist"),
}


def pins(kind: str) -> List[str]:
    """``name==version`` of each distribution of ``WHEELS[kind]`` as installed in this interpreter.

    Raises:
        ValueError: one is not installed (names it).
    """
    from importlib import metadata

    out = []
    for dist in WHEELS[kind]:
        try:
            out.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            raise ValueError(f"{dist} is not installed in {sys.executable}: its version cannot be pinned") from None
    return out


class CheckFailed(RuntimeError):
    """A job exited non-zero or ran past the check's time limit (the message holds its log's tail)."""


def cuda_probe() -> Tuple[bool, str]:
    """``(usable, why)``: whether this interpreter's torch can run CUDA; ``why`` says what it
    found (the skip reason when not usable). Imports torch, nothing else."""
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - any import failure is a reason to skip
        return False, f"torch is not importable in {sys.executable} ({type(err).__name__}: {err})"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} in {sys.executable} is a build without CUDA"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return True, f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"


def missing_modules(names: Sequence[str] = NEEDED) -> List[str]:
    """The modules of ``names`` this interpreter cannot find."""
    return [n for n in names if importlib.util.find_spec(n) is None]


def ds_config(device: str, metrics: str, world: int, gloo: bool) -> dict:
    """The jobs' DeepSpeed config: micro-batch 4, the global batch of ``world`` ranks, ZeRO-2."""
    cfg = {
        "train_batch_size": 4 * world,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True, "fused": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        "dynatrain": {
            "metrics_path": metrics,
            "collective_timeout_s": 120,
            "join_timeout_s": 240,
            "max_world_size": 2,
            "snapshot": {"host_cache_mib": 1024 if device == "cuda" else 64},
        },
    }
    if gloo:
        cfg["dynatrain"]["dist_backend"] = "gloo"
    return cfg


def child_env(device: str) -> dict:
    """The jobs' environment: DeepSpeed's accelerator, this tree on the path, no launcher's
    variables (the reload job is a process of its own)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DYNATRAIN_", "SLURM_", "MASTER_", "TORCHELASTIC_", "OMPI_", "PMI_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "JOB_COMPLETION_INDEX")
    }
    env["DS_ACCELERATOR"] = device
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1" if device == "cpu" else "4")
    env["PYTHONUNBUFFERED"] = "1"
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # cuBLAS's deterministic mode (the worker asks torch for it)
    return env


def run_job(cmd: Sequence[str], log_path: str, env: dict, deadline: float) -> None:
    """Run ``cmd`` in a session of its own, its output to ``log_path``; kill the whole session at
    ``deadline`` (``time.monotonic()``) or when it ends.

    Raises:
        CheckFailed: it exited non-zero or ran past the deadline (names the job, the log's tail).
    """
    name = os.path.basename(log_path)
    left = deadline - time.monotonic()
    if left <= 0:
        raise CheckFailed(f"{name}: no time left for it within the check's limit")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if rc != 0:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-1500:]
        what = "ran past the check's time limit" if rc is None else f"exited with status {rc}"
        raise CheckFailed(f"{name} {what}; log {log_path}, its end:\n{tail}")


def launch_train(work: str, name: str, device: str, deadline: float, extra: Sequence[str]) -> str:
    """One ``dynatrain launch --nproc 2`` job of the worker's ``train`` part; returns its out dir."""
    out = os.path.join(work, name)
    os.makedirs(out)
    cfg = os.path.join(work, f"{name}.json")
    with open(cfg, "w") as f:
        json.dump(ds_config(device, os.path.join(out, "metrics.jsonl"), 2, gloo=True), f)
    vocab, hidden, layers = SIZES[device]
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--allow-oversubscribe"]
    cmd += ["--config", cfg, WORKER, "--part", "train", "--out", out, "--steps", str(STEPS)]
    cmd += ["--vocab", str(vocab), "--hidden", str(hidden), "--layers", str(layers), *extra]
    run_job(cmd, os.path.join(work, f"{name}.log"), child_env(device), deadline)
    return out


def run_reload(work: str, device: str, deadline: float) -> str:
    """The worker's ``reload`` part in a process of its own; returns its out dir."""
    out = os.path.join(work, "reload")
    os.makedirs(out)
    cfg = os.path.join(work, "reload.json")
    with open(cfg, "w") as f:
        json.dump(ds_config(device, os.path.join(out, "metrics.jsonl"), 1, gloo=False), f)
    vocab, hidden, layers = SIZES[device]
    cmd = [sys.executable, WORKER, "--part", "reload", "--out", out, "--deepspeed_config", cfg]
    cmd += ["--steps", str(RELOAD_STEPS), "--snapshot-at", str(RELOAD_AT)]
    cmd += ["--vocab", str(vocab), "--hidden", str(hidden), "--layers", str(layers)]
    run_job(cmd, os.path.join(work, "reload.log"), child_env(device), deadline)
    return out


def differences(a: dict, b: dict) -> List[str]:
    """What differs between two gathered states, bitwise (empty: identical)."""
    out = [f"{k}: only in one" for k in sorted(set(a) ^ set(b))]
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, dict):
            import torch

            out += [
                f"{k}.{kind}"
                for kind in sorted(x)
                if not (x[kind].shape == y[kind].shape and torch.equal(x[kind], y[kind]))
            ]
        elif x != y:
            out.append(f"{k}: {x} != {y}")
    return out


def _load(path: str) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def read_jsonl(path: str) -> List[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def resize_figures(el: str, st: str) -> dict:
    """The resize part's checks and figures from the two jobs' out dirs."""
    first = min(RESIZE)
    bitwise = {str(s): differences(_load(f"{el}/before_{s}.pt"), _load(f"{el}/after_{s}.pt")) for s in RESIZE}
    same_start = differences(_load(f"{el}/before_{first}.pt"), _load(f"{st}/at_{first}.pt"))
    steps_el = {r["step"]: r for r in read_jsonl(f"{el}/metrics.jsonl") if r["event"] == "step"}
    steps_st = {r["step"]: r for r in read_jsonl(f"{st}/metrics.jsonl") if r["event"] == "step"}
    rel = [abs(steps_el[s]["loss"] - steps_st[s]["loss"]) / max(1.0, abs(steps_st[s]["loss"])) for s in steps_st]
    final_el, final_st = _load(f"{el}/final.pt"), _load(f"{st}/final.pt")
    diff = max(
        float((final_el[k]["fp32"] - final_st[k]["fp32"]).abs().max()) for k in final_st if not k.startswith("__")
    )
    resizes = [r for r in read_jsonl(f"{el}/metrics.jsonl") if r["event"] == "resize"]
    keys = ("from", "to", "step", "seconds", "bytes_moved", "plan_s", "group_s", "rebuild_s")
    return {
        "transitions": [{k: r.get(k) for k in keys} for r in resizes],
        "bitwise_across_resizes": all(not d for d in bitwise.values()),
        "differing": {s: d[:5] for s, d in bitwise.items() if d},
        "bitwise_with_static_before_resize": not same_start,
        "steps": sorted(steps_el) == sorted(steps_st) == list(range(1, STEPS + 1)) and len(resizes) == len(RESIZE),
        "max_loss_rel_diff": max(rel) if rel else None,
        "losses_follow_static": bool(rel) and max(rel) <= LOSS_RTOL,
        "final_fp32_max_abs_diff": diff,
        "bitwise_with_static_at_end": not differences(final_el, final_st),
    }


def snapshot_figures(st: str) -> dict:
    """The snapshot part's figures from the static job (its ``train.json`` and snapshot records):
    the first snapshot's at the top level, and under ``"again"`` the last one's (the pinned staging
    memory allocated by the first, reused)."""
    with open(f"{st}/train.json") as f:
        tr = json.load(f)
    recs = {r["tag"]: r for r in read_jsonl(f"{st}/metrics.jsonl") if r["event"] == "snapshot"}
    pinned = tr.get("pinned_gbps")

    def one(step: int) -> dict:
        rec, timed = recs.get(f"global_step{step}", {}), tr["snapshots"].get(str(step), {})
        capture = rec.get("capture_s") or 0.0
        gbps = rec.get("bytes", 0) / 2 / capture / 1e9 if capture else None  # one rank's bytes
        stall = timed.get("stall_s")
        return {
            "committed": bool(rec.get("ok")),
            "bytes": rec.get("bytes"),
            "save_s": timed.get("save_s"),
            "stall_s": stall,
            "stall_of_step": stall / tr["median_step_s"] if stall is not None else None,
            "capture_s": capture,
            "flush_s": rec.get("flush_s"),
            "capture_gbps": gbps,
            "capture_of_pinned": gbps / pinned if gbps and pinned else None,
        }

    first, *_, last = SNAPSHOTS_AT
    return {
        **one(first),
        "median_step_s": tr.get("median_step_s"),
        "pinned_gbps": pinned,
        "from_source_share": tr.get("snapshot_from_source_share"),
        "device": tr.get("device"),
        "backend": tr.get("backend"),
        "params": tr.get("params"),
        "again": {"step": last, **one(last)},
    }


def reload_figures(out: str) -> dict:
    """The reload part's checks and figures."""
    with open(f"{out}/reload.json") as f:
        fig = json.load(f)
    saved = _load(f"{out}/saved.pt")
    fig["bitwise"] = not differences(saved, _load(f"{out}/loaded.pt"))
    fig["state_moved_before_load"] = bool(differences(saved, _load(f"{out}/moved.pt")))
    return fig


def run_check(device: str, work: str, deadline: float) -> dict:
    """The three jobs and their figures (raises :class:`CheckFailed` when a job fails)."""
    gather = ",".join(map(str, RESIZE))
    resize = ",".join(f"{s}:{w}" for s, w in RESIZE.items())
    el = launch_train(work, "resize", device, deadline, ["--resize", resize, "--pinned-mib", "0"])
    snaps = ",".join(map(str, SNAPSHOTS_AT))
    st = launch_train(work, "static", device, deadline, ["--gather-at", gather, "--snapshot-at", snaps])
    rl = run_reload(work, device, deadline)
    fig = {"resize": resize_figures(el, st), "snapshot": snapshot_figures(st), "reload": reload_figures(rl)}
    r, s, rl_fig = fig["resize"], fig["snapshot"], fig["reload"]
    checks = {
        "resize_bitwise": r["bitwise_across_resizes"],
        "static_bitwise_before_resize": r["bitwise_with_static_before_resize"],
        "static_bitwise_at_end": r["bitwise_with_static_at_end"],
        "steps_and_resizes": r["steps"],
        "losses_follow_static": r["losses_follow_static"],
        "snapshot_committed": s["committed"] and s["again"]["committed"],
        "snapshot_stall_measured": s["stall_s"] is not None and s["again"]["stall_s"] is not None,
        "reload_bitwise": rl_fig["bitwise"],
        "state_moved_before_reload": rl_fig["state_moved_before_load"],
    }
    fig["failed"] = [name for name, held in checks.items() if not held]
    fig["ok"] = not fig["failed"]
    return fig


def versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("torch", "deepspeed"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda, or skip without a GPU"
    )
    p.add_argument("--timeout", type=float, default=480.0, help="limit of the whole check, seconds")
    p.add_argument("--dir", default=os.path.join(ROOT, "runs", "gpu_check"), help="jobs' configs, logs and states")
    p.add_argument("--pins", choices=sorted(WHEELS), help="print name==version of those wheels (make gpu-wheels)")
    a = p.parse_args(argv)
    if a.pins:
        print(" ".join(pins(a.pins)))
        return 0
    deadline = time.monotonic() + a.timeout
    device, found = "cpu", "the CPU (--device cpu)"
    if a.device != "cpu":
        usable, found = cuda_probe()
        if not usable:
            print(f"gpu-check: skipped: {found}", flush=True)
            return 0
        device = "cuda"
    missing = missing_modules()
    if missing:
        print(
            f"gpu-check: failed: {found}, but {sys.executable} cannot import {', '.join(missing)} "
            "(make gpu-wheels on a machine with the package index, then carry .gpu-wheels)",
            flush=True,
        )
        return 2
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    t0 = time.monotonic()
    fig = {"check": "gpu", "device": found, "python": sys.version.split()[0], **versions()}
    try:
        fig.update(run_check(device, a.dir, deadline))
    except (CheckFailed, OSError, KeyError, ValueError) as err:
        fig.update(ok=False, error=f"{type(err).__name__}: {err}")
    fig["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(fig), flush=True)
    return 0 if fig["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
