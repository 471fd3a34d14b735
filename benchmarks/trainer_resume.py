"""Resuming a Hugging Face Trainer run on another number of processes: ours beside the documented
route (``ds_to_universal --inject_missing_state`` + ``"checkpoint": {"load_universal": true}``).

    python -m benchmarks.trainer_resume [--layers 14] [--hidden 768] [--from-np 2] [--to-np 1] [--json]

One run, on this machine. ``examples/finetune_trainer.py`` (Trainer, DeepSpeed ZeRO-2, fp32,
DeepSpeed's AdamW and WarmupDecayLR; a byte-level Llama, 14 x 768 = about 100 M parameters,
sequence 128, micro-batch 1, the same global batch at both sizes) trains K steps on N processes
with DeepSpeed's own engine and saves ``checkpoint-K`` (DeepSpeed's files, Trainer's files). Then
M processes resume from it and train one step, twice:

* ``ours``: ``import ds_dynatrain`` and a ``"dynatrain"`` section: the checkpoint is loaded as it
  is, each rank reading only its new partitions. ``ours_s``: from starting the processes to the end
  of the first step after the resume.
* ``route``: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``
  (``convert_s``, the whole command), the ``latest_universal`` tag file, then M processes of the
  plain script with ``load_universal`` (``relaunch_s``, the same end point as ours).
  ``route_s = convert_s + relaunch_s``; ``ratio = route_s / ours_s``.

Both resumes start the same processes, import the same libraries and build the same model; the
difference is the conversion and the load. ``*_load_s`` is the time from starting the processes to
Trainer's ``on_train_begin`` (after the load); ``*_first_loss`` is the loss of the first step after
the resume on both routes (they must agree: the same state, loaded two ways). Times in seconds.
Work files go to a temporary directory under ``--dir``, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import List

from benchmarks.reconfig import JobFailed, read_json, run_job, run_plain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "finetune_trainer.py")
GLOBAL_BATCH = 6  # samples per optimizer step at every size (1, 2, 3 and 6 processes divide it)


def config(section: bool, universal: bool = False) -> dict:
    """The DeepSpeed config of the run: Trainer fills the "auto" values."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True, "fused": True},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {"stage": 2},
    }
    if section:
        cfg["dynatrain"] = {"snapshot": {"keep_last": 1}}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def trainer_args(a, work: str, name: str, nproc: int, cfg: dict, max_steps: int, extra: List[str]) -> List[str]:
    path = os.path.join(work, f"{name}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return [
        "--deepspeed", path,
        "--output_dir", os.path.join(work, name),
        "--max_steps", str(max_steps),
        "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", str(GLOBAL_BATCH // nproc),
        "--layers", str(a.layers), "--hidden", str(a.hidden), "--seq_len", str(a.seq_len),
        "--learning_rate", "3e-4", "--warmup_steps", "1", "--logging_steps", "1",
        "--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--save_only_model", "false",
        "--timings", os.path.join(work, f"{name}_times.json"),
        *extra,
    ]  # fmt: skip


def resume(a, work: str, name: str, cfg: dict, checkpoint: str) -> dict:
    """M processes resume from ``checkpoint`` and train one step: times from their start."""
    args = trainer_args(a, work, name, a.to_np, cfg, a.steps + 1, ["--resume_from_checkpoint", checkpoint])
    t_start = run_plain(a.to_np, args, work, name, a.timeout, worker=SCRIPT)
    times = read_json(os.path.join(work, f"{name}_times.json"), os.path.join(work, f"{name}_rank0.log"))
    if times["begin_step"] != a.steps:
        raise JobFailed(f"{name} began at step {times['begin_step']}, not at the checkpoint's {a.steps}")
    return {
        "s": times["first_step_end"] - t_start,
        "load_s": times["train_begin"] - t_start,
        "first_loss": times["losses"][str(a.steps + 1)],
        "engine": times["engine"],
    }


def measure(a, work: str) -> dict:
    save_args = trainer_args(a, work, "saved", a.from_np, config(False), a.steps, ["--save_steps", str(a.steps)])
    run_plain(a.from_np, save_args, work, "saved", a.timeout, worker=SCRIPT)
    checkpoint = os.path.join(work, "saved", f"checkpoint-{a.steps}")
    ours = resume(a, work, "ours", config(True), checkpoint)
    tag = f"global_step{a.steps}"
    convert_s = run_job(
        [
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
            "--input_folder", os.path.join(checkpoint, tag),
            "--output_folder", os.path.join(checkpoint, f"{tag}_universal"),
            "--inject_missing_state",
            "--num_extract_workers", str(a.convert_workers), "--num_merge_workers", str(a.convert_workers),
        ],
        os.path.join(work, "convert.log"),
        a.timeout,
        "ds_to_universal",
    )  # fmt: skip
    with open(os.path.join(checkpoint, "latest_universal"), "w") as f:
        f.write(f"{tag}_universal")
    route = resume(a, work, "route", config(False, universal=True), checkpoint)
    return {
        "from": a.from_np,
        "to": a.to_np,
        "params_m": round(params_m(a), 1),
        "ours_s": ours["s"],
        "ours_load_s": ours["load_s"],
        "convert_s": convert_s,
        "relaunch_s": route["s"],
        "route_load_s": route["load_s"],
        "route_s": convert_s + route["s"],
        "ratio": (convert_s + route["s"]) / ours["s"],
        "ours_first_loss": ours["first_loss"],
        "route_first_loss": route["first_loss"],
        "engines": [ours["engine"], route["engine"]],
    }


def params_m(a) -> float:
    """Parameters of ``examples/train_lm.py``'s byte-level Llama, millions."""
    inter = int(a.hidden * 2.6875) // 8 * 8
    per_layer = 4 * a.hidden * a.hidden + 3 * a.hidden * inter + 2 * a.hidden
    return (a.layers * per_layer + 2 * 256 * a.hidden + a.hidden) / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2, help="steps before the save (K)")
    ap.add_argument("--from-np", type=int, default=2, help="processes of the saving run (N)")
    ap.add_argument("--to-np", type=int, default=1, help="processes of the resumed runs (M)")
    ap.add_argument("--convert-workers", type=int, default=2, help="ds_to_universal extract and merge workers")
    ap.add_argument("--timeout", type=float, default=900, help="per job, seconds")
    ap.add_argument("--dir", default=None, help="parent of the temporary work directory")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    for n in (a.from_np, a.to_np):
        if n < 1 or GLOBAL_BATCH % n:
            ap.error(f"process counts must divide the global batch {GLOBAL_BATCH}: got {n}")
    work = tempfile.mkdtemp(prefix="trainer_resume_", dir=a.dir)
    try:
        r = measure(a, work)
    except JobFailed as err:
        print(f"benchmark failed: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        print(json.dumps(r))
        return 0
    print(
        f"Trainer resume {r['from']} -> {r['to']} processes, Llama {r['params_m']} M parameters, ZeRO-2 "
        "(seconds from starting the processes to the end of the first step after the resume)"
    )
    print(f"  ours (load as saved)            {r['ours_s']:8.2f}   of which to train begin {r['ours_load_s']:.2f}")
    print(f"  route: ds_to_universal          {r['convert_s']:8.2f}")
    print(f"  route: relaunch, load_universal {r['relaunch_s']:8.2f}   of which to train begin {r['route_load_s']:.2f}")
    print(f"  route total                     {r['route_s']:8.2f}   ratio route / ours {r['ratio']:.1f}x")
    print(f"  first loss after the resume: ours {r['ours_first_loss']:.6f}, route {r['route_first_loss']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
