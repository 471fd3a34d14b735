"""The TP + ZeRO layout computed from the uncut model alone equals what DeepSpeed AutoTP and ZeRO
really build (``tests/workers/tp_layout_worker.py``, a tiny Hugging Face Llama on real gloo
groups): every parameter's split (dimension and per-rank sizes) equals the ``ds_autotp_uc_meta``
DeepSpeed recorded on it, the global rank of ``(TP rank, DP rank)`` is DeepSpeed's, and every
rank's fp32 master partitions equal, bitwise, those the oracle cuts from the full initial weights.

Cases: uneven GQA at TP 2 (6 heads, 3 KV heads: q rows 32/16, MLP 51/50), a tied vocab-parallel
embedding and head at TP 2 x DP 2, TP 4 above the KV heads (empty shards), ZeRO-1/2/3, bf16.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import WORKERS, run_plain

pytestmark = pytest.mark.multiprocess

# (world, tp, stage, tie, heads, kv, inter, dtype)
CASES = {
    # every AutoTP job also checks its layout against its engine at start (check_layout): the
    # switch tests of make test cover that path; these cases check it here beside the oracle
    "gqa_uneven_tp2_zero2": pytest.param((2, 2, 2, "0", 6, 3, 101, "float32"), marks=pytest.mark.slow),
    "tied_tp2_dp2_zero1_bf16": pytest.param((4, 2, 1, "1", 4, 2, 64, "bfloat16"), marks=pytest.mark.slow),
    "tp4_above_kv_heads_zero2": pytest.param((4, 4, 2, "0", 4, 2, 64, "float32"), marks=pytest.mark.slow),
    "gqa_uneven_tp2_zero3": pytest.param((2, 2, 3, "0", 6, 3, 101, "float32"), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_tp_layout_equals_deepspeed(tmp_path, case):
    world, tp, stage, tie, heads, kv, inter, dtype = case
    args = [str(tmp_path), str(tp), str(stage), tie, str(heads), str(kv), str(inter), dtype]
    jobs = run_plain(tmp_path, os.path.join(WORKERS, "tp_layout_worker.py"), world, args, timeout=200, name="tp")
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    for rank in range(world):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["ours"] == r["theirs"], f"rank {rank}: our splits differ from DeepSpeed's"
        assert r["layout_rank"] == rank, f"rank {rank} is (TP {r['tp_rank']}, DP {r['dp_rank']})"
        assert r["partition_sizes"][0] == r["partition_sizes"][1], f"rank {rank}"
        assert r["partitions_equal"], f"rank {rank}: fp32 partitions differ from the oracle"
        # the case is what it claims: something is cut, and the tied pair is one cut parameter
        assert any("q_proj" in k for k in r["cut"]) and any("down_proj" in k for k in r["cut"])
        assert ("model.embed_tokens.weight" in r["cut"]) == (tie == "1")
