"""Test worker: a plain Hugging Face Accelerate loop (``accelerator.prepare``, ``accumulate``,
``backward``, ``save_state``/``load_state``) with DeepSpeed ZeRO and ``import ds_dynatrain``, on the
CPU (a gloo ``PartialState(cpu=True)`` formed first); started by ``run_plain``.

Trains TinyLM's tiny Llama (``trainer_worker.model``) on sequential batches of 2 samples per process
with ``--gas`` accumulation steps to ``--steps`` optimizer steps (epochs of 8 steps at a global
batch of 12; ``--step-sleep S``: seconds of sleep after each, while the file ``--sleep-while``
exists if given). ``--save-at K``: ``accelerator.save_state(--out/state)`` after step K and the
gathered state to ``--out/save.pt``. ``--load``: ``accelerator.load_state(--out/state)`` before
training, the gathered state to ``--out/begin.pt``, the first ``K x gas`` batches of each process
skipped (``skip_first_batches``). Rank 0 writes ``--out/losses_<world size at start>.json`` (step ->
mean loss of the step over all processes). ``--count``: every process appends the sample indices of
each micro-batch it trains to ``--out/samples_<pid>.jsonl``. Under ``dynatrain launch`` (which adds
``--deepspeed_config``) the launch config's global batch, micro-batch, stage and section are used,
and the accumulation steps are those of this process's world size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from tests.workers.common import gather_state  # noqa: E402
from tests.workers.trainer_worker import dataset, model  # noqa: E402


def main() -> int:
    import torch.distributed as tdist
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--gas", type=int, required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--load-at", type=int, default=0, help="the step of the state in --out/state")
    p.add_argument("--deepspeed_config", default=None, help="what `dynatrain launch` adds: its batch keys and section")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of sleep after each step")
    p.add_argument("--sleep-while", default=None, help="the --step-sleep only while this file exists")
    p.add_argument("--count", action="store_true", help="append each micro-batch's sample indices to --out")
    a = p.parse_args()
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout

    world = int(os.environ["WORLD_SIZE"])
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": a.gas,
        "train_batch_size": 2 * a.gas * world,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3}},
        "zero_optimization": {"stage": a.stage},
        "dynatrain": {},
    }
    if a.deepspeed_config:  # the launch config's global batch, micro-batch, stage and section
        with open(a.deepspeed_config) as f:
            given = json.load(f)
        cfg.update({k: v for k, v in given.items() if k in ("train_batch_size", "zero_optimization", "dynatrain")})
        a.gas = given["train_batch_size"] // (given["train_micro_batch_size_per_gpu"] * world)
        cfg["gradient_accumulation_steps"] = a.gas
    # on a CPU machine: the gloo world first (on GPUs Accelerator() forms it), then DeepSpeed as
    # `accelerate launch --use_deepspeed` selects it
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(cpu=True)
    if os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):  # the script as users write it: the launcher's config
        accelerator = Accelerator()
    else:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=a.gas)
    net = model()
    optimizer = DummyOptim(net.parameters())
    loader = torch.utils.data.DataLoader(dataset(), batch_size=2, shuffle=False)
    net, optimizer, loader, scheduler = accelerator.prepare(net, optimizer, loader, DummyScheduler(optimizer))
    state_dir = os.path.join(a.out, "state")
    step = 0
    if a.load_at:
        accelerator.load_state(state_dir)
        st = gather_state(net)
        if tdist.get_rank() == 0:
            torch.save(st, os.path.join(a.out, "begin.pt"))
        step = a.load_at
    active = accelerator.skip_first_batches(loader, a.load_at * a.gas) if a.load_at else loader
    losses, micro = {}, []
    while step < a.steps:  # epochs
        for batch in active:
            if a.count:
                with open(os.path.join(a.out, f"samples_{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps(batch["idx"].tolist()) + "\n")
            with accelerator.accumulate(net):
                loss = net(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            micro.append(loss.detach())
            if accelerator.sync_gradients:
                step += 1
                losses[step] = accelerator.gather(torch.stack(micro).mean()).mean().item()
                micro = []
                if step == a.save_at:
                    accelerator.save_state(state_dir)
                    st = gather_state(net)
                    if tdist.get_rank() == 0:
                        torch.save(st, os.path.join(a.out, "save.pt"))
                if a.sleep_while is None or os.path.exists(a.sleep_while):
                    time.sleep(a.step_sleep)
                if step >= a.steps:
                    break
        active = loader
    if tdist.get_rank() == 0:
        with open(os.path.join(a.out, f"losses_{world}.json"), "w") as f:
            json.dump({"losses": losses, "engine": type(net).__name__}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
