"""Test worker: checkpoints saved at one world size, loaded at another.

``save``: for each ZeRO stage, train TinyLM a few steps, save a snapshot (this project's engine)
and a DeepSpeed checkpoint (DeepSpeed's default ``torch.save`` engine) of the same state, gather
the state (DeepSpeed's ``safe_get_full_*``), then train on (the uninterrupted run, its losses in
``<out>/metrics_z<stage>.jsonl``).

Every process writes, from an exit hook registered before the first engine (so it runs after the
library's own), the names of its OS threads to ``<out>/threads_rank<r>``.

``load``: for each stage and format, build a fresh engine at this world size, ``load_checkpoint``,
gather the state (rank 0 writes it), train on (losses in ``<out>/metrics_z<stage>_<format>.jsonl``).

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment (no launcher).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from tests.workers.common import (  # noqa: E402
    TinyLM,
    Tokens,
    allow_cpu_fp16,
    base_config,
    gather_state,
    record_threads_at_exit,
)

SAVE_STEPS = 3
MORE_STEPS = 2


def config(stage: int, metrics: str) -> dict:
    cfg = base_config(stage, metrics)
    if stage == 3:
        cfg["zero_optimization"]["sub_group_size"] = 40
    cfg["dynatrain"].pop("max_world_size", None)
    return cfg


def train(engine, loader, until: int) -> None:
    while engine.global_steps < until:
        for batch in loader:
            engine.backward(engine(batch))
            engine.step()
            if engine.global_steps >= until:
                break


def build(stage: int, metrics: str):
    torch.manual_seed(0)
    model = TinyLM()
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=config(stage, metrics)
    )
    return engine, loader


def load_one(a, rank: int, saved: int, loaded: int, fmt: str) -> None:
    """Fresh engine of ZeRO stage ``loaded``; load the stage-``saved`` checkpoint; gather; train on."""
    tag = f"z{saved}_{fmt}" if saved == loaded else f"z{saved}_into{loaded}_{fmt}"
    engine, loader = build(loaded, os.path.join(a.out, f"metrics_{tag}.jsonl"))
    path, client = engine.load_checkpoint(os.path.join(a.load_from, f"{fmt}_z{saved}"), tag="ckpt")
    state = gather_state(engine)
    if rank == 0:
        torch.save(state, os.path.join(a.out, f"state_{tag}.pt"))
        with open(os.path.join(a.out, f"client_{tag}.json"), "w") as f:
            json.dump({"path": path, "keys": sorted(client or {})}, f)
    train(engine, loader, SAVE_STEPS + MORE_STEPS)
    engine.checkpoint_engine.close()
    engine.destroy()


def refuse(a, rank: int, name: str, path: str, check_state: bool = True) -> None:
    """``load_checkpoint`` of a broken directory must raise on every rank and (``check_state``)
    change nothing."""
    engine, loader = build(2, os.path.join(a.out, f"metrics_broken_{name}.jsonl"))
    train(engine, loader, 1)
    before = gather_state(engine)
    try:
        engine.load_checkpoint(path, tag="ckpt")
        error = None
    except Exception as err:  # noqa: BLE001 - the test checks the type and message
        error = f"{type(err).__name__}: {err}"
    same = None
    if check_state:
        after = gather_state(engine)
        same = (
            all(
                torch.equal(before[k][kind], after[k][kind])
                for k in before
                if not k.startswith("__")
                for kind in before[k]
            )
            and before["__global_steps__"] == after["__global_steps__"]
        )
    with open(os.path.join(a.out, f"broken_{name}_rank{rank}.json"), "w") as f:
        json.dump({"error": error, "state_unchanged": same}, f)
    engine.checkpoint_engine.close()
    engine.destroy()


def main():
    allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--load-from", default=None, help="directory the save job wrote (load mode)")
    p.add_argument("--formats", default="ours,torch")
    p.add_argument(
        "--cross",
        default="",
        help="SAVED:LOADED,... also load the checkpoint of ZeRO stage SAVED into an engine of stage LOADED",
    )
    p.add_argument("--broken", default="", help="NAME=DIR,... directories that must be refused (stage 2)")
    p.add_argument(
        "--broken-same",
        default="",
        help="NAME=DIR,... the same, saved at this world size (DeepSpeed's "
        "own load: the state is not checked afterwards)",
    )
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    rank = int(os.environ["RANK"])
    atexit.register(record_threads_at_exit, os.path.join(a.out, f"threads_rank{rank}"))  # after the library's hooks
    for stage in map(int, a.stages.split(",")):
        if a.mode == "save":
            engine, loader = build(stage, os.path.join(a.out, f"metrics_z{stage}.jsonl"))
            train(engine, loader, SAVE_STEPS)
            engine.save_checkpoint(os.path.join(a.out, f"ours_z{stage}"), tag="ckpt")
            engine.checkpoint_engine.wait()
            from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

            ours, engine.checkpoint_engine = engine.checkpoint_engine, TorchCheckpointEngine()
            engine.save_checkpoint(
                os.path.join(a.out, f"torch_z{stage}"), tag="ckpt", client_state={"universal_checkpoint_info": {}}
            )
            engine.checkpoint_engine = ours
            state = gather_state(engine)
            if rank == 0:
                torch.save(state, os.path.join(a.out, f"state_z{stage}.pt"))
            train(engine, loader, SAVE_STEPS + MORE_STEPS)
            engine.checkpoint_engine.close()
            engine.destroy()
            continue
        for fmt in a.formats.split(","):
            load_one(a, rank, stage, stage, fmt)
    if a.mode == "load":
        for pair in filter(None, a.cross.split(",")):
            saved, loaded = map(int, pair.split(":"))
            for fmt in a.formats.split(","):
                load_one(a, rank, saved, loaded, fmt)
        for item in filter(None, a.broken.split(",")):
            name, path = item.split("=", 1)
            refuse(a, rank, name, path)
        for item in filter(None, a.broken_same.split(",")):
            name, path = item.split("=", 1)
            refuse(a, rank, name, path, check_state=False)
    import torch.distributed as tdist

    tdist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
