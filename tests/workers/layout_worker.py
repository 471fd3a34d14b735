"""Test worker: for several models and ZeRO settings, the layout ds_dynatrain computes from
metadata alone (before any engine exists) beside the fragments DeepSpeed's real engine built
(each parameter's ``_hp_mapping``). Each rank writes both to ``OUT/rank<r>.json``.

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ds_dynatrain.zero.geometry import (  # noqa: E402
    engine_fragments,
    engine_storage_fragments,
    fp32_partitions,
    layout_for_model,
    layout_of,
)
from tests.workers.common import TinyLM, allow_cpu_fp16, exit_without_teardown  # noqa: E402


class Frozen(torch.nn.Module):
    """A frozen embedding, a 1-element parameter, an odd total (the trainable count is 1 + 15*7 + 7 + 3 = 116
    + the 5x3 head... not divisible by 3 or 4)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 15)
        self.embed.weight.requires_grad_(False)
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.a = torch.nn.Linear(15, 7)
        self.b = torch.nn.Linear(7, 3, bias=False)
        self.c = torch.nn.Linear(3, 5)


def cases():
    def tiny():
        return TinyLM()

    def frozen():
        return Frozen()

    def groups_interleaved(model):
        named = list(model.named_parameters())
        g0 = [p for i, (n, p) in enumerate(named) if i % 2 == 0]
        g1 = [p for i, (n, p) in enumerate(named) if i % 2 == 1]
        return [{"params": g0, "weight_decay": 0.0}, {"params": g1, "weight_decay": 0.1, "lr": 1e-3}]

    yield "tiny_zero1", tiny, 1, {}, None
    yield "tiny_zero2", tiny, 2, {}, None
    yield "frozen_zero2", frozen, 2, {}, None
    yield "two_groups_zero2", tiny, 2, {}, groups_interleaved
    yield "two_groups_zero1", frozen, 1, {}, groups_interleaved
    yield "round_robin_zero2", tiny, 2, {"round_robin_gradients": True}, None
    yield "param_alignment_zero2_bf16", tiny, 2, {"parameter_alignment": True}, "bf16"
    yield "bf16_zero1", frozen, 1, {}, "bf16"
    # ZeRO-3: per-parameter partitions; sub-groups of at most 40 / 100 elements per rank
    yield "tiny_zero3", tiny, 3, {}, None
    yield "sub_groups_zero3", tiny, 3, {"sub_group_size": 40}, None
    yield "frozen_two_groups_zero3", frozen, 3, {"sub_group_size": 20}, groups_interleaved
    yield "bf16_sub_groups_zero3", frozen, 3, {"sub_group_size": 30}, "bf16"


def main():
    allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    import deepspeed
    import deepspeed.ops

    # as ds_dynatrain.initialize does: DeepSpeed's CPU shared-memory op is for inference only, and
    # its JIT build can leave a stale lock behind (see ds_dynatrain/initialize.py)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    out_dir = sys.argv[1]
    ws, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    result = {}
    for name, make, stage, zextra, extra in cases():
        torch.manual_seed(0)
        model = make()
        groups_fn = extra if callable(extra) else None
        bf16 = extra == "bf16"
        cfg = {
            "train_batch_size": 2 * ws,
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": stage, **zextra},
            "steps_per_print": 10**9,
        }
        if bf16:
            cfg["bf16"] = {"enabled": True}
        params = groups_fn(model) if groups_fn else [p for p in model.parameters()]
        group_lists = [g["params"] for g in params] if groups_fn else [params]
        expected = layout_for_model(
            list(model.named_parameters()), group_lists, ws, cfg, torch.bfloat16 if bf16 else torch.float32
        )
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
        result[name] = {
            "expected": [list(vars(f).values()) for f in expected.fragments(rank)],
            "actual": [list(vars(f).values()) for f in engine_storage_fragments(engine)],
            # stage 3 has no _hp_mapping; layout_of checks its sub-groups against DeepSpeed's
            "hp_mapping": (
                [list(vars(f).values()) for f in engine_fragments(engine)]
                if stage < 3
                else [list(vars(f).values()) for f in layout_of(engine).fragments(rank)]
            ),
            "expected_partition_numel": [expected.partition_numel(g) for g in range(expected.num_partitions)],
            "actual_partition_numel": [t.numel() for t in fp32_partitions(engine.optimizer)],
        }
        engine.destroy()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    import torch.distributed as tdist

    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
