"""Worker of ``python -m benchmarks.reconfig``: one process of one of its jobs (``--mode``).

Modes (rank 0 writes ``--out``, JSON; every time is in seconds, every size in bytes):

* ``ours``: started by ``dynatrain launch`` with a ``resize_schedule`` in its config. Trains a
  Llama-shaped model with ZeRO-2 until ``--steps`` optimizer steps are done; the resize happens
  inside ``engine.step()`` of the scheduled step. Every iteration (``gradient_accumulation_steps``
  micro-steps of forward, backward and step) is timed. Processes that leave at the resize stop
  there; joiners start at the resize step. Rank 0 of the new world writes the last resize record,
  the iteration times and ``first_step_excess_s`` (the first iteration on the new world minus the
  median of the later ones, at least 0).
* ``ds-save``: a plain ``deepspeed.initialize`` rank (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in
  the environment). Trains ``--steps`` steps, then ``save_checkpoint`` with DeepSpeed's default
  ``TorchCheckpointEngine`` and the client state ``ds_to_universal`` needs; writes ``save_s``
  (barrier to barrier) and the checkpoint's size.
* ``ds-load``: a plain ``deepspeed.initialize`` rank at the new world size with
  ``checkpoint.load_universal``; loads ``--tag`` from ``--dir`` and trains ``--steps`` steps.
  Writes wall-clock timestamps (``time.time()``) of the end of start-up, of the load and of the
  first step, so the driver can time the relaunch from the moment it started the processes.
* ``link``: two plain gloo processes, no DeepSpeed: ``send``/``recv`` of a ``--mib`` MiB buffer
  from rank 0 to rank 1 after a warm-up, best of ``--repeat``; writes ``link_gbps`` (GB/s, 1e9).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB = 8192


def build_model(hidden: int, layers: int, seq_len: int, kv_heads: int = 0):
    """A randomly initialised Llama (untied embeddings, 64-wide heads, MLP width 8/3 of hidden;
    ``kv_heads`` key/value heads, 0 for as many as the query heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=hidden * 8 // 3,
            num_hidden_layers=layers,
            num_attention_heads=hidden // 64,
            num_key_value_heads=kv_heads or hidden // 64,
            max_position_embeddings=seq_len,
            tie_word_embeddings=False,
        )
    )


def train_iteration(engine, seq_len: int, gen: torch.Generator) -> float:
    """One optimizer step (all its micro-steps) on random tokens. Returns its wall time, seconds."""
    t0 = time.perf_counter()
    for _ in range(engine.gradient_accumulation_steps()):
        tokens = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), seq_len), generator=gen)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        if not getattr(engine, "is_member", True):
            break
    return time.perf_counter() - t0


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def plain_config(path: str, world_size: int, load_universal: bool = False) -> dict:
    """The benchmark's DeepSpeed config for a plain DeepSpeed job at ``world_size`` (no dynatrain
    section; accumulation recomputed so the global batch stays the same)."""
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("dynatrain", None)
    cfg["gradient_accumulation_steps"] = cfg["train_batch_size"] // (cfg["train_micro_batch_size_per_gpu"] * world_size)
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def plain_deepspeed(a, load_universal: bool = False):
    """``deepspeed.initialize`` on the environment's ranks, without the CPU shared-memory op build."""
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    cfg = plain_config(a.config, int(os.environ["WORLD_SIZE"]), load_universal)
    model = build_model(a.hidden, a.layers, a.seq_len)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, model


def run_ours(a) -> None:
    import ds_dynatrain

    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    model = build_model(a.hidden, a.layers, a.seq_len)
    engine, *_ = ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=a.deepspeed_config)
    gen = torch.Generator().manual_seed(1000 + engine.global_rank)
    iterations = []  # one per optimizer step this process ran
    while engine.is_member and engine.global_steps < a.steps:
        ws = engine.dp_world_size
        dt = train_iteration(engine, a.seq_len, gen)
        if engine.is_member:
            iterations.append(
                {
                    "step": engine.global_steps,
                    "world_size_before": ws,
                    "world_size_after": engine.dp_world_size,
                    "seconds": dt,
                }
            )
    if not engine.is_member or engine.global_rank != 0 or not engine.resize_records:
        return
    record = engine.resize_records[-1]
    after = [it["seconds"] for it in iterations if it["step"] > record["step"]]
    before = [it["seconds"] for it in iterations if it["step"] < record["step"]]
    rest = statistics.median(after[1:]) if len(after) > 1 else None
    write_json(
        a.out,
        {
            "mode": "ours",
            "params": sum(p.numel() for p in model.parameters()),
            "record": record,
            "iterations": iterations,
            "old_iter_s": statistics.median(before[1:]) if len(before) > 1 else None,
            "new_iter_s": rest,
            "first_step_excess_s": max(0.0, after[0] - rest) if rest is not None else None,
        },
    )


def run_ds_save(a) -> None:
    import torch.distributed as tdist

    engine, model = plain_deepspeed(a)
    gen = torch.Generator().manual_seed(1000 + engine.global_rank)
    iters = [train_iteration(engine, a.seq_len, gen) for _ in range(a.steps)]
    tdist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(a.dir, tag=a.tag, client_state={"universal_checkpoint_info": {}})
    tdist.barrier()
    save_s = time.perf_counter() - t0
    if engine.global_rank == 0:
        write_json(
            a.out,
            {
                "mode": "ds-save",
                "params": sum(p.numel() for p in model.parameters()),
                "save_s": save_s,
                "checkpoint_bytes": dir_bytes(os.path.join(a.dir, a.tag)),
                "iterations": iters,
                "global_steps": engine.global_steps,
            },
        )
    tdist.destroy_process_group()  # left to interpreter teardown, gloo may abort the process


def run_ds_load(a) -> None:
    import torch.distributed as tdist

    engine, _model = plain_deepspeed(a, load_universal=True)
    t_init = time.time()
    path, _client = engine.load_checkpoint(a.dir, tag=a.tag)
    if path is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint {a.tag!r} in {a.dir}")
    t_load = time.time()
    gen = torch.Generator().manual_seed(1000 + engine.global_rank)
    iters = []
    for _ in range(a.steps):
        iters.append(train_iteration(engine, a.seq_len, gen))
        if len(iters) == 1:
            t_first = time.time()
    if engine.global_rank == 0:
        write_json(
            a.out,
            {
                "mode": "ds-load",
                "t_init": t_init,
                "t_load": t_load,
                "t_first_step": t_first,
                "iterations": iters,
                "global_steps": engine.global_steps,
            },
        )
    tdist.destroy_process_group()


def run_link(a) -> None:
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    buf = torch.ones(a.mib << 18, dtype=torch.float32)  # 4-byte elements
    best = float("inf")
    for i in range(a.repeat + 1):  # the first round is the warm-up
        tdist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            tdist.send(buf, dst=1)
        else:
            tdist.recv(buf, src=0)
        tdist.barrier()
        if i:
            best = min(best, time.perf_counter() - t0)
    if rank == 0:
        nbytes = buf.numel() * buf.element_size()
        write_json(a.out, {"mode": "link", "bytes": nbytes, "seconds": best, "link_gbps": nbytes / best / 1e9})
    tdist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ours", "ds-save", "ds-load", "link"], required=True)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=1, help="optimizer steps to reach (ours) or to run (ds-*)")
    p.add_argument("--config", help="DeepSpeed config of the plain DeepSpeed modes (JSON path)")
    p.add_argument("--dir", help="checkpoint directory (ds-save, ds-load)")
    p.add_argument("--tag", help="checkpoint tag (ds-save, ds-load)")
    p.add_argument("--mib", type=int, default=256, help="link: message size, MiB")
    p.add_argument("--repeat", type=int, default=3, help="link: timed rounds")
    p.add_argument("--out", required=True)
    p.add_argument("--deepspeed_config", help="appended by dynatrain launch")
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    {"ours": run_ours, "ds-save": run_ds_save, "ds-load": run_ds_load, "link": run_link}[a.mode](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
