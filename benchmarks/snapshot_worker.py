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


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["none", "dynatrain", "torch", "dcp"], required=True)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--paired", action="store_true", help="also run --steps without snapshots before and after")
    p.add_argument("--rounds", type=int, default=1, help="paired: blocks with snapshots, each between two without")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--deepspeed_config", required=True)
    return p.parse_args()


def build_engine(a):
    """The Llama-shaped model (byte vocabulary) under ``ds_dynatrain.initialize``, with DeepSpeed's
    own checkpoint engine for ``--engine torch``."""
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
    return model, engine


def cpu_now() -> float:
    """CPU seconds of every thread of this process so far, user and system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def steal_now() -> float:
    """CPU seconds the hypervisor has taken from this machine's CPUs so far, all of them together
    (``steal``, the eighth field of ``/proc/stat``'s ``cpu`` line: time a virtual CPU was ready to
    run and the host ran something else). 0.0 where the kernel does not report it. On a virtual
    machine whose disk the host emulates, the host's work for the guest's writes can show up here:
    CPU time training loses that no process of the guest spent."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if fields[0] == "cpu" and len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


class Loop:
    """The timed training loop of one rank: iterations, snapshots with one engine, and what they
    cost (seconds per iteration, stalls per snapshot, flushes of DCP)."""

    def __init__(self, a, engine):
        self.a, self.engine = a, engine
        self.rank = engine.global_rank
        g = torch.Generator().manual_seed(self.rank)
        self.batch = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), a.seq_len), generator=g)
        self.save_dir = os.path.join(a.dir, a.engine)
        self.plain, self.with_snap, self.stalls, self.flush = [], [], [], []
        self.pending = None  # DCP's future, its start and its directory
        # DCP's background save runs its collectives (the plans' gather and scatter) beside the
        # training loop's: on a group of its own, or the two interleave on one group and hang
        self.dcp_group = torch.distributed.new_group(backend="gloo") if a.engine == "dcp" else None

    def step(self) -> None:
        engine = self.engine
        for _ in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(input_ids=self.batch, labels=self.batch).loss)
            engine.step()

    def _finish_dcp(self) -> None:
        if self.pending is not None:
            future, f0, path = self.pending
            future.result()
            self.flush.append((path, time.perf_counter() - f0))
            self.pending = None

    def snapshot(self) -> float:
        """Take one snapshot; returns the seconds the loop was held by the call."""
        s0 = time.perf_counter()
        engine = self.engine
        tag = f"global_step{engine.global_steps}"
        if self.a.engine == "dcp":
            import torch.distributed.checkpoint as dcp

            self._finish_dcp()
            state = {
                f"rank{self.rank}": {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict()}
            }
            path = os.path.join(self.save_dir, tag)
            self.pending = (dcp.async_save(state, checkpoint_id=path, process_group=self.dcp_group), s0, path)
        else:
            engine.save_checkpoint(self.save_dir, tag=tag)
        return time.perf_counter() - s0

    def block(self, count: int, snapshots: bool, times: list) -> float:
        """``count`` iterations, a snapshot after every ``--every``-th from the first when
        ``snapshots``; each iteration's seconds appended to ``times`` (and to ``plain`` or
        ``with_snap``). The last snapshot's flush is waited for and its wait added to the last
        iteration (a conservative count: in steady state it overlaps the next iterations).
        Returns the CPU seconds of the block and the machine's steal seconds over it (``steal_now``)."""
        c0, st0 = cpu_now(), steal_now()
        for i in range(count):
            t0 = time.perf_counter()
            ce = self.engine.checkpoint_engine
            wait0 = getattr(ce, "stats", {}).get("capture_wait_s", 0.0)
            self.step()
            if snapshots and self.a.engine == "dynatrain" and self.stalls:
                # the optimizer step waited for the capture of the last snapshot: that snapshot's stall
                self.stalls[-1] += ce.stats["capture_wait_s"] - wait0
            snap = snapshots and i % self.a.every == 0
            stall = self.snapshot() if snap else 0.0
            if snapshots and i == count - 1:  # the block's last flush, counted in the block
                if self.a.engine == "dcp":
                    self._finish_dcp()
                elif self.a.engine == "dynatrain":
                    ce.wait()
            dt = time.perf_counter() - t0
            times.append(dt)
            (self.with_snap if snap else self.plain).append(dt)
            if snap:
                self.stalls.append(stall)
        return cpu_now() - c0, steal_now() - st0


def flush_figures(a, loop: Loop, snap_bytes: int):
    """``(persist_s, flush_gbps)``: seconds per snapshot to make this rank's files durable and the
    resulting write bandwidth (GB/s) of the whole snapshot."""
    if a.engine == "none":
        return 0.0, 0.0
    if a.engine == "dynatrain":
        persist = loop.engine.checkpoint_engine.stats["persist_s"] / max(1, len(loop.stalls))
        return persist, (snap_bytes / persist / 1e9 if persist else 0.0)
    persist = statistics.median(loop.stalls) if a.engine == "torch" else statistics.median(s for _, s in loop.flush)
    return persist, snap_bytes / persist / 1e9


def main():
    a = parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    model, engine = build_engine(a)
    loop = Loop(a, engine)
    if loop.rank == 0:
        shutil.rmtree(loop.save_dir, ignore_errors=True)
    torch.distributed.barrier()
    for _ in range(a.warmup):
        loop.step()
    snapshots = a.engine != "none"
    paired = a.paired and snapshots  # the same process without snapshots, before and after (drift cancels)
    # paired: without, (with, without) x rounds; each block with snapshots is compared with the two
    # blocks without around it, and the rounds' median is the slowdown
    rounds = max(1, a.rounds) if paired else 1
    main_blocks, plain_blocks, main_costs, plain_costs = [], [], [], []  # costs: (CPU s, steal s) per block
    if paired:
        plain_blocks.append([])
        plain_costs.append(loop.block(a.steps, False, plain_blocks[-1]))
    for _ in range(rounds):
        main_blocks.append([])
        main_costs.append(loop.block(a.steps, snapshots, main_blocks[-1]))
        if paired:
            plain_blocks.append([])
            plain_costs.append(loop.block(a.steps, False, plain_blocks[-1]))
    cpu_main, steal_main = (sum(c) for c in zip(*main_costs))
    cpu_plain, steal_plain = (sum(c) for c in zip(*plain_costs)) if paired else (0.0, 0.0)
    main_times = [t for b in main_blocks for t in b]
    plain_times = [t for b in plain_blocks for t in b]
    round_slowdowns, round_steals = [], []  # per round: slowdown, and the extra steal as a share of CPU time
    for k, on in enumerate(main_blocks if paired else []):
        around = plain_blocks[k] + plain_blocks[k + 1]
        base_iter = statistics.mean(around)
        round_slowdowns.append(statistics.mean(on) / base_iter - 1)
        base_steal = (plain_costs[k][1] + plain_costs[k + 1][1]) / len(around)
        round_steals.append((main_costs[k][1] / len(on) - base_steal) / (os.cpu_count() * base_iter))
    torch.distributed.barrier()
    save_dir = loop.save_dir
    tags = sorted(d for d in os.listdir(save_dir) if d.startswith("global_step")) if os.path.isdir(save_dir) else []
    snap_bytes = dir_bytes(os.path.join(save_dir, tags[-1])) if tags else 0
    persist, flush_gbps = flush_figures(a, loop, snap_bytes)
    stalls = loop.stalls or [0.0]
    snap_stats = getattr(loop.engine.checkpoint_engine, "stats", {})
    from_source = snap_stats.get("from_source_bytes", 0) / snap_stats["bytes"] if snap_stats.get("bytes") else None
    if loop.rank == 0:
        with open(a.out, "w") as f:
            json.dump(
                {
                    "engine": a.engine,
                    "stall_s": statistics.median(stalls),
                    "stalls": stalls,
                    "step_s": statistics.median(loop.plain) if loop.plain else None,
                    "step_with_snapshot_s": statistics.median(loop.with_snap) if loop.with_snap else None,
                    "iter_s": statistics.mean(main_times),
                    "cpu_s": cpu_main / len(main_times),
                    "steal_s": steal_main / len(main_times),
                    "cpus": os.cpu_count(),
                    "paired_base_iter_s": statistics.mean(plain_times) if paired else None,
                    "paired_base_cpu_s": cpu_plain / len(plain_times) if paired else None,
                    "paired_base_steal_s": steal_plain / len(plain_times) if paired else None,
                    "paired_drift": (
                        statistics.mean(plain_blocks[-1]) / statistics.mean(plain_blocks[0]) - 1 if paired else None
                    ),
                    "round_slowdowns": round_slowdowns or None,
                    "round_steal_overheads": round_steals or None,
                    "snapshot_bytes": snap_bytes,
                    "persist_s": persist,
                    "flush_gbps": flush_gbps,
                    "from_source_share": from_source,
                    "every": a.every,
                    "params": sum(q.numel() for q in model.parameters()),
                },
                f,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
