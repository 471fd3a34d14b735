"""Test worker: a tiny Hugging Face Llama under DeepSpeed AutoTP + ZeRO, beside the layout
ds_dynatrain computes from the uncut model alone (``autotp_splits`` + ``TensorParallelLayout``).

Each rank writes ``OUT/rank<r>.json``: the split DeepSpeed recorded on each parameter
(``ds_autotp_uc_meta``: partition dimension and sizes) beside ours, and whether its fp32 master
partitions equal, bitwise, the partitions the oracle (``tests/tp_oracle.py``) cuts from the full
initial weights for this rank.

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment. Arguments: OUT TP STAGE
TIE HEADS KV INTER DTYPE.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_dynatrain.vps.layout import param_metas_from_groups  # noqa: E402
from ds_dynatrain.vps.tensor_parallel import TensorParallelLayout  # noqa: E402
from ds_dynatrain.zero.autotp import autotp_splits  # noqa: E402
from ds_dynatrain.zero.geometry import fp32_partitions  # noqa: E402
from tests.tp_oracle import partitions  # noqa: E402
from tests.workers.common import exit_without_teardown  # noqa: E402


def main() -> None:
    out_dir, tp, stage, tie, heads, kv, inter, dtype = sys.argv[1:9]
    tp, stage, heads, kv, inter = int(tp), int(stage), int(heads), int(kv), int(inter)
    import deepspeed
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no op build in the tests
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    hidden = 8 * heads
    cfg = LlamaConfig(
        hidden_size=hidden,
        head_dim=8,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=2,
        vocab_size=96,
        tie_word_embeddings=tie == "1",
    )
    model = LlamaForCausalLM(cfg)
    torch_dtype = getattr(torch, dtype)
    full = {n: p.detach().to(torch_dtype).double().numpy().reshape(-1) for n, p in model.named_parameters()}
    splits = autotp_splits(model, tp)
    metas = param_metas_from_groups(list(model.named_parameters()), [list(model.parameters())])
    metas = tuple(tuple(type(m)(m.key, m.shape, dtype) for m in g) for g in metas)
    layout = TensorParallelLayout(tp, world // tp, metas, tuple(sorted(splits.items())), stage=stage)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp},
        "steps_per_print": 10**9,
    }
    if dtype == "bfloat16":
        ds_cfg["bf16"] = {"enabled": True}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    theirs, ours = {}, {}
    for name, p in engine.module.named_parameters():
        meta = getattr(p, DS_AUTOTP_UC_META, None)
        theirs[name] = None if not meta else [meta["partition_dim"], list(meta["partition_sizes"])]
        s = splits.get(name)
        ours[name] = None if s is None else [s.dim, list(s.sizes)]
    from deepspeed.utils import groups

    tp_rank = groups.get_tensor_model_parallel_rank()
    dp_rank = groups.get_data_parallel_rank()
    want = partitions(layout, full)[rank]
    got = [t.detach().float().numpy().astype("float64") for t in fp32_partitions(opt)]
    equal = len(got) == len(want)
    for g, w in zip(got, want):
        owned = ~(w != w)  # NaN marks padding in the oracle
        equal = equal and g.shape == w.shape and bool((g[owned] == w[owned]).all())
    result = {
        "rank": rank,
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
        "layout_rank": layout.rank(tp_rank, dp_rank),
        "theirs": theirs,
        "ours": ours,
        "partitions_equal": equal,
        "partition_sizes": [[int(g.shape[0]) for g in got], [int(w.shape[0]) for w in want]],
        "cut": sorted(k for k, v in ours.items() if v is not None),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
