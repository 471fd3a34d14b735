"""Test worker: a small pipeline model (a ``PipelineModule`` with an embedding tied to the head,
blocks of different widths and a norm) under DeepSpeed's pipeline engine and ZeRO-1, beside the
layout ds_dynatrain computes from the layer list alone (``zero.pipeline.pipeline_layout``).

Each rank writes ``OUT/rank<r>.json``: DeepSpeed's stage bounds (``module.parts``) beside ours,
its stage's trainable parameters (name, shape, in ``named_parameters`` order) beside our stage's,
its (stage, DP rank) beside the global rank our layout gives them, and whether its fp32 master
partitions equal, bitwise, those an oracle lays out from the full initial weights of every stage
(gathered from all ranks) by ``ZeroLayout.fragments``.

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment. Arguments: OUT PP
METHOD DTYPE.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_dynatrain.zero.geometry import fp32_partitions  # noqa: E402
from ds_dynatrain.zero.pipe_module import layer_param_counts  # noqa: E402
from ds_dynatrain.zero.pipeline import pipeline_layout  # noqa: E402
from tests.workers.common import exit_without_teardown  # noqa: E402

VOCAB, HIDDEN = 48, 16


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)

    def forward(self, x):
        return nn.functional.embedding(x, self.weight)


def head(module, x):
    return x @ module.weight.t()


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, width)
        self.fc2 = nn.Linear(width, HIDDEN)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def specs():
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    blocks = [LayerSpec(Block, w) for w in (32, 8, 48, 16, 24)]
    return [
        TiedLayerSpec("embed", Embed),
        *blocks,
        LayerSpec(nn.LayerNorm, HIDDEN),
        TiedLayerSpec("embed", Embed, forward_fn=head),
    ]


def main() -> None:
    out_dir, pp, method, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no op build in the tests
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    module = PipelineModule(
        layers=specs(),
        num_stages=pp,
        loss_fn=loss_fn,
        partition_method=method,
        seed_layers=True,
        base_seed=1234,
        seed_fn=lambda s: torch.manual_seed(int(s)),  # DeepSpeed's own seeding rejects numpy ints
    )
    ours = pipeline_layout(module, pp, world, dtype, method, stage=1)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    if dtype == "bfloat16":
        ds_cfg["bf16"] = {"enabled": True}
    torch_dtype = getattr(torch, dtype)
    mine = {n: p.detach().to(torch_dtype).double().numpy().reshape(-1) for n, p in module.named_parameters()}
    every = [None] * world
    torch.distributed.all_gather_object(every, mine)
    full = {k: v for d in every for k, v in d.items()}
    engine, opt, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=ds_cfg)
    stage, dp_rank = module._grid.get_stage_id(), module._grid.get_data_parallel_id()
    zl = ours.zero(stage)
    want = [[float("nan")] * zl.partition_numel(b) for b in range(zl.num_partitions)]
    for f in zl.fragments(dp_rank):
        want[f.group][f.local : f.local + f.numel] = full[f.key][f.start : f.start + f.numel].tolist()
    got = [t.detach().double().numpy().tolist() for t in fp32_partitions(opt)]
    equal = len(got) == len(want) and all(
        len(g) == len(w) and all(x == y for x, y in zip(g, w) if y == y) for g, w in zip(got, want)
    )
    result = {
        "rank": rank,
        "layout_rank": ours.rank(stage, dp_rank),
        "parts": [int(x) for x in module.parts],
        "our_parts": list(ours.parts),
        "params": [[n, list(p.shape)] for n, p in module.named_parameters() if p.requires_grad],
        "our_params": [[p.key, list(p.shape)] for p in ours.stage_params(stage)],
        "partitions_equal": equal,
        "partition_sizes": [[len(g) for g in got], [len(w) for w in want]],
        "layer_params": [int(n) for n in module._count_layer_params()],
        "our_layer_params": layer_param_counts(ours),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
