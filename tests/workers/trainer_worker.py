"""Test worker: a Hugging Face ``Trainer`` run of a tiny Llama with DeepSpeed ZeRO, the script as
users write it plus ``import ds_dynatrain`` (and a ``"dynatrain"`` section in the DeepSpeed config);
started by ``run_plain`` (torch env:// variables), on the CPU (``use_cpu=True``, gloo).

* ``--plain``: no ``"dynatrain"`` section: DeepSpeed's own engine and checkpoint files.
* ``--resume last|PATH``: ``trainer.train(resume_from_checkpoint=True|PATH)``.
* ``--dump DIR``: the gathered training state (``gather_state``, collective) after any load, at
  train begin (``begin.pt``), and at every save (``save<step>.pt``); rank 0 writes
  ``losses.json`` (step -> logged loss) at the end.
* ``--step-sleep S``: seconds of sleep after each step (``on_step_end``), while the file
  ``--sleep-while`` exists if given.
* ``--eval-steps N``: an evaluation on 24 samples every N steps (``losses.json`` has them).
* ``--deepspeed FILE``: that config (batch keys, ``"dynatrain"`` section) over the worker's own,
  as a Trainer script started by ``dynatrain launch`` takes it.
* Every process appends the indices of the samples it trains, micro-batch by micro-batch, to
  ``--out/samples_<pid>.jsonl`` (a ``Trainer`` subclass's ``training_step``: what is trained).
* Every process of a run with the plugin writes, from an exit hook registered before Trainer builds
  its engine (so it runs after the library's own), the names of its OS threads to
  ``--out/threads_<pid>``.
* ``--kill-at K``: SEAM (the kill is real, the seam picks its moment): once the snapshot of the save
  before step K is durable, the io queue of every rank's snapshot writer is replaced by one whose
  first write waits until Trainer has finished the save at step K (its rotation included), then
  SIGKILLs this process: every rank dies with checkpoint-K's files unflushed.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import deepspeed.ops  # noqa: E402

import ds_dynatrain  # noqa: E402,F401  (the one line a Trainer script adds)

# DeepSpeed's own engine (a config without the section) starts deepspeed.comm, which on the CPU
# JIT-builds its shared-memory op (inference only; minutes on a fresh machine): skipped, as
# ds_dynatrain skips it for its engines (ds_dynatrain/zero/comm.py)
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
from tests.workers.common import gather_state, record_threads_at_exit  # noqa: E402

# started by `dynatrain launch` as a joiner, this process imports the package before Trainer as
# any Trainer script does; nothing else here knows of resizes

VOCAB, SEQ, SAMPLES = 64, 16, 96


def ds_config(stage: int, plain: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if not plain:
        cfg["dynatrain"] = {"snapshot": {"keep_last": 1}}
    return cfg


def _launch_config(path: str) -> dict:
    """The config file given (``--deepspeed``: its batch keys and resize schedule), completed with
    this worker's optimizer and Trainer's "auto" values."""
    with open(path) as f:
        cfg = json.load(f)
    base = ds_config(cfg.get("zero_optimization", {}).get("stage", 2), plain=False)
    base.update(cfg)
    return base


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
    )


def dataset() -> list:
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": t, "labels": t, "idx": i}
        for i, t in enumerate(torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g))
    ]


def collate(samples) -> dict:
    """A micro-batch, with the indices of its samples (``idx``, taken out again before the model)."""
    return {
        "input_ids": torch.stack([x["input_ids"] for x in samples]),
        "labels": torch.stack([x["labels"] for x in samples]),
        "idx": torch.tensor([x["idx"] for x in samples]),
    }


def counting_trainer(out: str):
    """``Trainer`` whose ``training_step`` appends the indices of each micro-batch it trains to
    ``out/samples_<pid>.jsonl`` (what is trained, not what the loader fetched ahead)."""
    from transformers import Trainer

    class CountingTrainer(Trainer):
        def training_step(self, model, inputs, *args, **kwargs):
            idx = inputs.pop("idx")
            with open(os.path.join(out, f"samples_{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(idx.tolist()) + "\n")
            return super().training_step(model, inputs, *args, **kwargs)

        def prediction_step(self, model, inputs, *args, **kwargs):
            inputs = {k: v for k, v in inputs.items() if k != "idx"}  # evaluation: not counted
            return super().prediction_step(model, inputs, *args, **kwargs)

    return CountingTrainer


def killing_queue_factory(release: threading.Event):
    """SEAM: io queues whose first write waits for ``release``, then SIGKILLs this process."""
    from io_engine.ioqueue import default_queue_factory
    from tests.faults import QueueWrapper

    class KillingQueue(QueueWrapper):
        def submit_write(self, fd, view, offset, token):
            release.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    return lambda kind, depth: KillingQueue(default_queue_factory(kind, depth))


def main() -> int:
    import torch.distributed as tdist
    from transformers import TrainerCallback, TrainingArguments

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--per-device", type=int, default=2)
    p.add_argument("--gas", type=int, default=1)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--resume", default=None)
    p.add_argument("--dump", default=None)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of sleep after each step")
    p.add_argument("--sleep-while", default=None, help="the --step-sleep only while this file exists")
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate on 24 samples every this many steps")
    p.add_argument("--deepspeed", default=None, help="a DeepSpeed config file, as Trainer scripts take it")
    a = p.parse_args()
    ds_dynatrain.log_to_console()
    if not a.plain:
        os.makedirs(a.out, exist_ok=True)
        atexit.register(record_threads_at_exit, os.path.join(a.out, f"threads_{os.getpid()}"))

    args = TrainingArguments(
        output_dir=a.out,
        per_device_train_batch_size=a.per_device,
        gradient_accumulation_steps=a.gas,
        max_steps=a.steps,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        save_total_limit=a.save_total_limit,
        logging_steps=1,
        eval_strategy="steps" if a.eval_steps else "no",
        eval_steps=a.eval_steps or None,
        per_device_eval_batch_size=2,
        learning_rate=1e-2,
        warmup_steps=2,
        weight_decay=0.01,
        seed=0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,  # the sample index reaches training_step
        deepspeed=_launch_config(a.deepspeed) if a.deepspeed else ds_config(a.stage, a.plain),
    )
    evaluation = dataset()[:24] if a.eval_steps else None
    trainer = counting_trainer(a.out)(
        model=model(), args=args, train_dataset=dataset(), eval_dataset=evaluation, data_collator=collate
    )
    release = threading.Event()

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            if a.dump and a.resume:  # the state just loaded (before the first step, no moments exist)
                st = gather_state(trainer.model_wrapped)
                if tdist.get_rank() == 0:
                    torch.save(st, os.path.join(a.dump, "begin.pt"))

        def on_save(self, args, state, control, **kw):
            if a.dump:
                st = gather_state(trainer.model_wrapped)
                if tdist.get_rank() == 0:
                    torch.save(st, os.path.join(a.dump, f"save{state.global_step}.pt"))
            engine = trainer.model_wrapped
            if a.kill_at and state.global_step == a.kill_at:
                release.set()
            elif a.kill_at and state.global_step + args.save_steps == a.kill_at:
                from io_engine import Flusher, IOConfig, SnapshotFileWriter

                ce = engine.checkpoint_engine
                ce.wait()  # the save before the kill is durable
                ce._writer = SnapshotFileWriter(
                    flusher=Flusher(IOConfig(), queue_factory=killing_queue_factory(release))
                )

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if a.sleep_while is None or os.path.exists(a.sleep_while):
                time.sleep(a.step_sleep)

    trainer.add_callback(Probe())
    trainer.add_callback(Slow())
    resume = True if a.resume == "last" else a.resume
    trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
        with open(os.path.join(a.dump or a.out, "losses.json"), "w") as f:
            json.dump({"losses": losses, "eval": evals, "engine": type(trainer.model_wrapped).__name__}, f)
    if a.plain:
        # DeepSpeed's own engine leaves its gloo group to the interpreter's exit, where a gloo thread
        # still alive sometimes aborts the process ("terminate called without an active exception");
        # a script that ends its group first exits cleanly (ours do it for their engines themselves)
        tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
