"""The Trainer demo (``make demo-trainer``): fine-tune with Hugging Face Trainer on 2 processes with
snapshots, resume on 3 from a snapshot, and compare the losses with the run that went on.

1. ``torchrun --nproc-per-node 2 examples/finetune_trainer.py`` trains 24 steps, a snapshot every
   8 (``configs/trainer_zero2.json``: ZeRO-2 and a ``"dynatrain"`` section), 4 samples per process
   and 3 accumulation steps: 24 samples a step;
2. ``torchrun --nproc-per-node 3`` resumes from its ``checkpoint-8`` with 2 accumulation steps (the
   same 24 samples a step) and trains to step 24;
3. the losses of steps 9-24 of both runs are printed side by side with the largest relative
   difference; the demo fails if it exceeds ``--tolerance`` (floating-point reduction order only).

Output in ``--out`` (default ``runs/demo-trainer``): each run's output directory and log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "finetune_trainer.py")
CONFIG = os.path.join(ROOT, "configs", "trainer_zero2.json")


def run(nproc: int, out: str, name: str, gas: int, steps: int, extra=()) -> dict:
    """One torchrun job of the fine-tuning script; returns rank 0's timings file (losses in it)."""
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), SCRIPT,
        "--deepspeed", CONFIG, "--output_dir", os.path.join(out, name), "--max_steps", str(steps),
        "--save_steps", "8", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", str(gas),
        "--learning_rate", "1e-3", "--warmup_steps", "4", "--logging_steps", "1", "--report_to", "none",
        "--disable_tqdm", "true", "--timings", os.path.join(out, f"{name}.json"), *extra,
    ]  # fmt: skip
    if env["DS_ACCELERATOR"] == "cpu":
        cmd.append("--use_cpu")
    log = os.path.join(out, f"{name}.log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, timeout=900).returncode
    if rc != 0:
        with open(log) as f:
            sys.exit(f"{name} failed (status {rc}); the end of {log}:\n{f.read()[-3000:]}")
    with open(os.path.join(out, f"{name}.json")) as f:
        times = json.load(f)
    print(f"{name}: {nproc} processes, engine {times['engine']}, {time.perf_counter() - t0:.0f} s", flush=True)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo-trainer")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest relative loss difference allowed")
    a = p.parse_args(argv)
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    two = run(2, a.out, "two", gas=3, steps=a.steps)
    checkpoint = os.path.join(a.out, "two", "checkpoint-8")
    three = run(3, a.out, "three", gas=2, steps=a.steps, extra=["--resume_from_checkpoint", checkpoint])
    print(f"\nresumed on 3 processes from {checkpoint} (saved on 2); loss by step:")
    print(" step   2 processes throughout   resumed on 3   relative difference")
    worst = 0.0
    for step in range(9, a.steps + 1):
        x, y = two["losses"][str(step)], three["losses"][str(step)]
        rel = abs(x - y) / abs(x)
        worst = max(worst, rel)
        print(f"{step:5d}   {x:22.6f}   {y:12.6f}   {rel:.2e}")
    print(f"largest relative difference {worst:.2e} (tolerance {a.tolerance:g})")
    return 0 if worst <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
