"""Worker of ``python -m benchmarks.snapshot``: trains a Llama-shaped model with ZeRO-2 and takes a
snapshot every ``--every`` steps with one checkpoint engine, timing the training loop.

Engines: ``dynatrain`` (ours, asynchronous), ``torch`` (DeepSpeed's default
``TorchCheckpointEngine``, synchronous ``torch.save``), ``dcp``
(``torch.distributed.checkpoint.async_save`` of each rank's module and optimizer state).
Rank 0 writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ds_dynatrain  # noqa: E402


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["none", "dynatrain", "torch", "dcp"], required=True)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=a.hidden,
            intermediate_size=a.hidden * 8 // 3,
            num_hidden_layers=a.layers,
            num_attention_heads=a.hidden // 64,
            num_key_value_heads=a.hidden // 64,
            max_position_embeddings=a.seq_len,
        )
    )
    engine, _o, _l, _s = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), config=a.deepspeed_config
    )
    if a.engine == "torch":
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        engine.checkpoint_engine = TorchCheckpointEngine()
    rank = engine.global_rank
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), a.seq_len), generator=g)
    save_dir = os.path.join(a.dir, a.engine)
    if rank == 0:
        shutil.rmtree(save_dir, ignore_errors=True)
    torch.distributed.barrier()

    plain, with_snap, stalls, flush = [], [], [], []
    pending = None  # dcp future

    def step():
        for _ in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(input_ids=batch, labels=batch).loss)
            engine.step()

    cpu0 = None
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        stall = 0.0
        ce = engine.checkpoint_engine
        wait0 = getattr(ce, "stats", {}).get("capture_wait_s", 0.0)
        step()
        if a.engine == "dynatrain" and stalls:
            # the optimizer step waited for the capture of the last snapshot: that snapshot's stall
            stalls[-1] += engine.checkpoint_engine.stats["capture_wait_s"] - wait0
        snap = a.engine != "none" and i >= a.warmup and (i - a.warmup) % a.every == 0
        if snap:
            s0 = time.perf_counter()
            tag = f"global_step{engine.global_steps}"
            if a.engine == "dcp":
                import torch.distributed.checkpoint as dcp

                if pending is not None:
                    f0 = pending[1]
                    pending[0].result()
                    flush.append((pending[2], time.perf_counter() - f0))
                state = {
                    f"rank{rank}": {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
                }
                pending = (
                    dcp.async_save(state, checkpoint_id=os.path.join(save_dir, tag)),
                    s0,
                    os.path.join(save_dir, tag),
                )
            else:
                engine.save_checkpoint(save_dir, tag=tag)
            stall += time.perf_counter() - s0
        dt = time.perf_counter() - t0
        if i >= a.warmup:
            (with_snap if snap else plain).append(dt)
            if snap:
                stalls.append(stall)
    if a.engine == "dcp" and pending is not None:
        pending[0].result()
        flush.append((pending[2], time.perf_counter() - pending[1]))
    ce = engine.checkpoint_engine
    if a.engine == "dynatrain":
        ce.wait()
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this rank, the last flush included
    cpu_s = (cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime) / a.steps
    torch.distributed.barrier()
    tags = sorted(d for d in os.listdir(save_dir) if d.startswith("global_step")) if os.path.isdir(save_dir) else []
    snap_bytes = dir_bytes(os.path.join(save_dir, tags[-1])) if tags else 0
    if a.engine == "none":
        persist, flush_gbps, stalls = 0.0, 0.0, [0.0]
    elif a.engine == "dynatrain":
        persist = ce.stats["persist_s"] / max(1, len(stalls))  # this rank's files, seconds per snapshot
        flush_gbps = snap_bytes / 2 / persist / 1e9 * 2 if persist else 0.0
    elif a.engine == "torch":
        persist = statistics.median(stalls)
        flush_gbps = snap_bytes / persist / 1e9
    else:
        persist = statistics.median(s for _, s in flush)
        flush_gbps = snap_bytes / persist / 1e9
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "engine": a.engine,
                    "stall_s": statistics.median(stalls),
                    "stalls": stalls,
                    "step_s": statistics.median(plain) if plain else None,
                    "step_with_snapshot_s": statistics.median(with_snap) if with_snap else None,
                    "iter_s": statistics.mean(plain + with_snap),
                    "cpu_s": cpu_s,
                    "snapshot_bytes": snap_bytes,
                    "persist_s": persist,
                    "flush_gbps": flush_gbps,
                    "every": a.every,
                    "params": sum(q.numel() for q in model.parameters()),
                },
                f,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
