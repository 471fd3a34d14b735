"""Worker of ``python -m benchmarks.migrate``: one process of one of its jobs (``--mode``).

Plain torch.distributed ranks (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment). Rank 0
writes ``--out`` (JSON; times in seconds, sizes in bytes), with every rank's figures gathered.

* ``save``: ``ds_dynatrain.initialize`` a Llama-shaped model (ZeRO-2, fp32, AdamW), train
  ``--steps`` steps, then save the same state twice: a snapshot (this project's engine) into
  ``--dir``/ours and a DeepSpeed checkpoint (DeepSpeed's default ``TorchCheckpointEngine``, with
  the client state ``ds_to_universal`` needs) into ``--dir``/deepspeed.
* ``ours``: ``ds_dynatrain.initialize`` at this world size, then ``load_checkpoint`` of the
  snapshot (saved at another world size): ``load_s`` barrier to barrier, each rank's
  ``bytes_read``, ``read_s`` and peak extra resident memory during the load.
* ``deepspeed``: ``deepspeed.initialize`` with ``checkpoint.load_universal`` at this world size,
  then ``load_checkpoint`` of the universal checkpoint: ``load_s``, peak extra memory per rank.
* ``convert``: ``ds_to_universal`` run in this process (one process, no ranks): its wall time and
  peak resident set.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.reconfig_worker import build_model, train_iteration, write_json  # noqa: E402


def peak_reset() -> int:
    """Reset the peak resident set (Linux ``clear_refs`` 5); the current resident set, bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_bytes("VmRSS")


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def config(a, world_size: int, load_universal: bool = False) -> dict:
    cfg = {
        "train_batch_size": 12,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 12 // world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def gather(obj) -> list:
    import torch.distributed as tdist

    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def elastic_engine(a):
    """``ds_dynatrain.initialize`` of the benchmark's model at this world size: ``(engine, model)``."""
    import ds_dynatrain

    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    model = build_model(a.hidden, a.layers, a.seq_len)
    cfg = dict(config(a, int(os.environ["WORLD_SIZE"])), dynatrain={"log_interval_steps": 10**6})
    cfg.pop("gradient_accumulation_steps")
    engine, *_ = ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, model


def run_save(a) -> None:
    import torch.distributed as tdist
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    engine, model = elastic_engine(a)
    gen = torch.Generator().manual_seed(1000 + engine.global_rank)
    for _ in range(a.steps):
        train_iteration(engine, a.seq_len, gen)
    engine.save_checkpoint(os.path.join(a.dir, "ours"), tag=a.tag)
    engine.checkpoint_engine.wait()
    ours, engine.checkpoint_engine = engine.checkpoint_engine, TorchCheckpointEngine()
    engine.save_checkpoint(os.path.join(a.dir, "deepspeed"), tag=a.tag, client_state={"universal_checkpoint_info": {}})
    engine.checkpoint_engine = ours
    tdist.barrier()
    if engine.global_rank == 0:
        write_json(
            a.out,
            {"mode": "save", "params": sum(p.numel() for p in model.parameters()), "global_steps": engine.global_steps},
        )
    ours.close()
    tdist.destroy_process_group()


def run_ours(a) -> None:
    import torch.distributed as tdist

    from ds_dynatrain.checkpoint.resharded import load_resharded

    engine, _model = elastic_engine(a)
    tdist.barrier()
    base = peak_reset()
    t0 = time.perf_counter()
    _path, _client, stats = load_resharded(engine, os.path.join(a.dir, "ours"), a.tag)
    tdist.barrier()
    load_s = time.perf_counter() - t0
    peak = max(0, status_bytes("VmHWM") - base)
    ranks = gather(
        {
            "bytes_read": stats.bytes_read,
            "read_s": stats.read_s,
            "plan_s": stats.plan_s,
            "install_s": stats.install_s,
            "gather_s": stats.gather_s,
            "seconds": stats.seconds,
            "peak_extra_bytes": peak,
        }
    )
    if engine.global_rank == 0:
        write_json(a.out, {"mode": "ours", "load_s": load_s, "global_steps": engine.global_steps, "ranks": ranks})
    engine.checkpoint_engine.close()
    tdist.destroy_process_group()


def run_deepspeed(a) -> None:
    import deepspeed
    import deepspeed.ops
    import torch.distributed as tdist

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ws = int(os.environ["WORLD_SIZE"])
    model = build_model(a.hidden, a.layers, a.seq_len)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config(a, ws, load_universal=True)
    )
    tdist.barrier()
    base = peak_reset()
    t0 = time.perf_counter()
    path, _ = engine.load_checkpoint(os.path.join(a.dir, "deepspeed"), tag=a.tag)
    tdist.barrier()
    load_s = time.perf_counter() - t0
    if path is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint {a.tag!r}")
    ranks = gather({"peak_extra_bytes": max(0, status_bytes("VmHWM") - base)})
    if engine.global_rank == 0:
        write_json(a.out, {"mode": "deepspeed", "load_s": load_s, "global_steps": engine.global_steps, "ranks": ranks})
    tdist.destroy_process_group()


def run_convert(a) -> None:
    """``ds_to_universal`` in this process (no distributed set-up): ``--dir``/deepspeed/``--tag`` to
    ``<tag>_universal``; writes its wall time and peak resident set (this process and its worker
    processes, bytes)."""
    import resource
    import runpy

    src = os.path.join(a.dir, "deepspeed", a.tag)
    sys.argv = [
        "ds_to_universal",
        "--input_folder",
        src,
        "--output_folder",
        src + "_universal",
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
    ]
    t0 = time.perf_counter()
    runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__")
    seconds = time.perf_counter() - t0
    peak = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    )
    write_json(a.out, {"mode": "convert", "seconds": seconds, "peak_rss_bytes": peak * 1024})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["save", "ours", "deepspeed", "convert"], required=True)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--dir", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    {"save": run_save, "ours": run_ours, "deepspeed": run_deepspeed, "convert": run_convert}[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
