"""The Trainer demo (``make demo-trainer``): fine-tune with Hugging Face Trainer on 2 processes with
snapshots, the same job resized online 2 -> 3 -> 2, and a resume on 3 from a snapshot; the losses
of all three side by side.

1. ``torchrun --nproc-per-node 2 examples/finetune_trainer.py`` trains 24 steps, a snapshot every
   8 (``configs/trainer_zero2.json``: ZeRO-2 and a ``"dynatrain"`` section), 4 samples per process
   and 3 accumulation steps: 24 samples a step;
2. ``dynatrain launch --nproc 2 --slots 3`` runs the same script on
   ``configs/trainer_zero2_elastic.json`` (the same job with ``resize_schedule``: 2 -> 3 after step
   8, 3 -> 2 after step 16; the accumulation steps follow, 24 samples a step throughout);
3. ``torchrun --nproc-per-node 3`` resumes from run 1's ``checkpoint-8`` with 2 accumulation steps
   and trains to step 24;
4. the losses are printed side by side with the largest relative difference to run 1; the demo
   fails if one exceeds ``--tolerance`` (floating-point reduction order only). Trainer logs no loss
   at a step where the online run's world changed (its loop resumed there).

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
ELASTIC_CONFIG = os.path.join(ROOT, "configs", "trainer_zero2_elastic.json")


def run(nproc: int, out: str, name: str, gas: int, steps: int, extra=(), elastic: bool = False) -> dict:
    """One job of the fine-tuning script (torchrun, or ``dynatrain launch`` with 3 slots when
    ``elastic``); returns rank 0's timings file (losses in it)."""
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if elastic:
        launcher = ["-m", "ds_dynatrain.cli", "launch", "--nproc", str(nproc), "--slots", "3"]
    cmd = [
        sys.executable, *launcher, SCRIPT,
        "--deepspeed", ELASTIC_CONFIG if elastic else CONFIG, "--output_dir", os.path.join(out, name),
        "--max_steps", str(steps),
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
    online = run(2, a.out, "online", gas=3, steps=a.steps, elastic=True)
    checkpoint = os.path.join(a.out, "two", "checkpoint-8")
    three = run(3, a.out, "three", gas=2, steps=a.steps, extra=["--resume_from_checkpoint", checkpoint])
    print(f"\nloss by step; resized online: 2 -> 3 after step 8, 3 -> 2 after step 16; resumed from {checkpoint}")
    print(" step   2 processes   resized online   resumed on 3")
    worst = {"online": 0.0, "three": 0.0}
    for step in range(1, a.steps + 1):
        x = two["losses"][str(step)]
        row = [f"{step:5d}   {x:11.6f}"]
        for name, other, width in (("online", online, 14), ("three", three, 12)):
            y = other["losses"].get(str(step))
            row.append(" " * width + "-" if y is None else f"{y:{width + 1}.6f}")
            if y is not None:
                worst[name] = max(worst[name], abs(x - y) / abs(x))
        print("   ".join(row))
    print(
        f"largest relative difference to the 2-process run: resized online {worst['online']:.2e}, "
        f"resumed on 3 {worst['three']:.2e} (tolerance {a.tolerance:g})"
    )
    return 0 if max(worst.values()) <= a.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
