"""Test worker: builds generated models as real modules, runs ``deepspeed.initialize`` on each and
writes, per model, the layout ds_dynatrain computes from metadata beside where DeepSpeed really put
every parameter (``engine_storage_fragments``) and its partition sizes, for every world size from 1
to the number of processes, to ``OUT/ws<W>_rank<r>.json``.

A model description (JSON, written by ``tests/test_layout_generated.py``)::

    {"name": ..., "stage": 1 | 2, "dtype": "float32" | "bfloat16", "round_robin": bool,
     "parameter_alignment": bool,
     "params": [{"name": "p0", "shape": [3, 1], "frozen": false}, ...],
     "tie": null | {"alias": "tied", "of": 2, "position": 1},
     "groups": [[param index, ...], ...]}

``tie``: parameter ``of`` is registered a second time, under ``alias``, at ``position`` in the
module's registration order (one Parameter, two names, as tied input/output embeddings);
``groups``: the optimizer parameter groups, each in its own order (frozen members included).

Usage: ``generated_layout_worker.py CASES.json OUT`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT
in the environment (WORLD_SIZE: the number of processes, the largest world size).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ds_dynatrain.zero.geometry import engine_storage_fragments, layout_for_model  # noqa: E402


class Generated(torch.nn.Module):
    """Parameters registered as the description says (no forward: the layout needs none)."""

    def __init__(self, case: dict):
        super().__init__()
        self.created = [
            torch.nn.Parameter(torch.randn(*p["shape"]), requires_grad=not p["frozen"]) for p in case["params"]
        ]
        order = [(p["name"], self.created[i]) for i, p in enumerate(case["params"])]
        tie = case.get("tie")
        if tie:
            order.insert(tie["position"], (tie["alias"], self.created[tie["of"]]))
        for name, param in order:
            self.register_parameter(name, param)


def run_case(case: dict, world_size: int, rank: int) -> dict:
    import deepspeed

    torch.manual_seed(0)
    model = Generated(case)
    bf16 = case["dtype"] == "bfloat16"
    cfg = {
        "train_batch_size": 2 * world_size,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {
            "stage": case["stage"],
            "round_robin_gradients": case["round_robin"],
            "parameter_alignment": case["parameter_alignment"],
        },
        "steps_per_print": 10**9,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    groups = [
        {"params": [model.created[i] for i in g], "weight_decay": 0.01 * gi} for gi, g in enumerate(case["groups"])
    ]
    expected = layout_for_model(
        list(model.named_parameters()),
        [g["params"] for g in groups],
        world_size,
        cfg,
        torch.bfloat16 if bf16 else torch.float32,
    )
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    tie = case.get("tie")
    result = {
        "expected": [list(vars(f).values()) for f in expected.fragments(rank)],
        "actual": [list(vars(f).values()) for f in engine_storage_fragments(engine)],
        "expected_partition_numel": [expected.partition_numel(g) for g in range(expected.num_groups)],
        "actual_partition_numel": [t.numel() for t in engine.optimizer.single_partition_of_fp32_groups],
        "trainable_numel": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "tied": tie is None or getattr(model, tie["alias"]) is model.created[tie["of"]],
    }
    engine.destroy()
    return result


def main():
    """Every world size from 1 to the number of processes in turn, each on a process group of its
    own (ranks beyond the world size wait): one process start serves every world size."""
    from datetime import timedelta

    import deepspeed.ops
    import torch.distributed as tdist

    from ds_dynatrain.zero.comm import reset_deepspeed_comm

    # as ds_dynatrain.initialize does: DeepSpeed's CPU shared-memory op is for inference only, and
    # its JIT build can leave a stale lock behind (see ds_dynatrain/initialize.py)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    out_dir = sys.argv[2]
    nproc, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    timeout = timedelta(seconds=120)
    store = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), nproc, rank == 0, timeout=timeout)
    for world_size in range(1, nproc + 1):
        if rank >= world_size:
            continue
        os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
        tdist.init_process_group(
            "gloo", store=tdist.PrefixStore(f"ws{world_size}", store), rank=rank, world_size=world_size, timeout=timeout
        )
        result = {c["name"]: run_case(c, world_size, rank) for c in cases}
        with open(os.path.join(out_dir, f"ws{world_size}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
        tdist.destroy_process_group()
        reset_deepspeed_comm()  # DeepSpeed caches the dead group otherwise
    store.add("done", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    while rank == 0 and store.add("done", 0) < nproc:  # rank 0 hosts the store: it goes last
        if time.monotonic() > deadline:
            raise TimeoutError("the other ranks did not finish")
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
