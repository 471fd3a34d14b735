"""Fine-tune a small Llama with Hugging Face Trainer and DeepSpeed ZeRO; ds_dynatrain takes the
snapshots and resumes them on any number of processes.

A Trainer script as users write it, plus one line: ``import ds_dynatrain`` (and a ``"dynatrain"``
section in the DeepSpeed config given with ``--deepspeed``). Every argument of
``transformers.TrainingArguments`` is accepted (``HfArgumentParser``)::

    torchrun --nproc-per-node 2 examples/finetune_trainer.py --deepspeed configs/trainer_zero2.json \\
        --output_dir runs/ft --max_steps 40 --save_steps 10 --per_device_train_batch_size 4 \\
        --gradient_accumulation_steps 3
    # later, on 3 processes, from the last complete checkpoint (same global batch: 4 x 2 x 3 = 4 x 3 x 2)
    torchrun --nproc-per-node 3 examples/finetune_trainer.py --deepspeed configs/trainer_zero2.json \\
        --output_dir runs/ft --max_steps 40 --save_steps 10 --per_device_train_batch_size 4 \\
        --gradient_accumulation_steps 2 --resume_from_checkpoint last

On a machine without a GPU add ``--use_cpu`` (gloo); ``DS_ACCELERATOR=cpu`` makes DeepSpeed's
choice explicit. ``--timings FILE`` writes, on rank 0, when the process started, when training
began (after any resume) and when the first step after it ended (``time.time()`` seconds; the
resume benchmark reads them).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

STARTED = time.time()

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from text_data import ByteTextDataset  # noqa: E402
from train_lm import build_model  # noqa: E402

import ds_dynatrain  # noqa: E402,F401  (the one line: deepspeed.initialize now reaches ds_dynatrain)


@dataclass
class ScriptArguments:
    data: Optional[str] = field(default=None, metadata={"help": "text file or folder (default: Python's sources)"})
    seq_len: int = field(default=128, metadata={"help": "bytes per sample"})
    layers: int = field(default=4, metadata={"help": "Llama decoder layers"})
    hidden: int = field(default=256, metadata={"help": "Llama hidden size (4 x 256: 3.3 M parameters)"})
    model_seed: int = field(default=1234, metadata={"help": "seed of the initial weights"})
    timings: Optional[str] = field(default=None, metadata={"help": "JSON file of start/resume/first-step times"})


def collate(samples):
    batch = torch.stack(samples)
    return {"input_ids": batch, "labels": batch}


def main(argv=None) -> int:
    from transformers import HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses(argv)
    if args.resume_from_checkpoint == "last":
        args.resume_from_checkpoint = True  # Trainer's "the last checkpoint in output_dir"
    torch.manual_seed(script.model_seed)
    model = build_model(script.seq_len, script.layers, script.hidden)
    dataset = ByteTextDataset(script.data, script.seq_len)
    times = {"started": STARTED}

    class Timings(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            times["train_begin"], times["begin_step"] = time.time(), state.global_step

        def on_step_end(self, args, state, control, **kwargs):
            times.setdefault("first_step_end", time.time())

    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate, callbacks=[Timings()])
    if trainer.is_world_process_zero():
        n = sum(p.numel() for p in model.parameters())
        print(f"model: Llama, {n / 1e6:.2f} M parameters; data: {dataset.source}, {len(dataset)} samples", flush=True)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if trainer.is_world_process_zero():
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        print(f"engine: {type(trainer.model_wrapped).__name__}; losses by step: {json.dumps(losses)}", flush=True)
        if script.timings:
            with open(script.timings, "w") as f:
                json.dump({**times, "losses": losses, "engine": type(trainer.model_wrapped).__name__}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
