"""The pipeline + ZeRO-1 layout computed from the layer list alone equals what DeepSpeed's
``PipelineModule`` and pipeline engine really build (``tests/workers/pipeline_layout_worker.py``,
real gloo groups): the stage bounds equal ``module.parts`` for DeepSpeed's partition methods,
each stage's trainable parameters are ours by name, shape and order, each layer's count of
trainable elements is DeepSpeed's (``_count_layer_params``, the weights of method
``parameters``), the global rank of (stage, DP rank) is DeepSpeed's, and every rank's fp32 master
partitions equal, bitwise, those the oracle lays out from the full initial weights.

Cases: PP 2 (``parameters``), PP 2 x DP 2 bf16 (``uniform``), PP 4 (``type:block``) with the
tied embedding/head on the first and last stage.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import WORKERS, run_plain

pytestmark = pytest.mark.multiprocess

# (world, pp, partition method, dtype)
CASES = {
    "pp2_parameters": (2, 2, "parameters", "float32"),
    "pp2_dp2_uniform_bf16": pytest.param((4, 2, "uniform", "bfloat16"), marks=pytest.mark.slow),
    "pp4_type_block": pytest.param((4, 4, "type:block", "float32"), marks=pytest.mark.slow),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_pipeline_layout_equals_deepspeed(tmp_path, case):
    world, pp, method, dtype = case
    args = [str(tmp_path), str(pp), method, dtype]
    jobs = run_plain(tmp_path, os.path.join(WORKERS, "pipeline_layout_worker.py"), world, args, timeout=200, name="pp")
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    for rank in range(world):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["our_parts"] == r["parts"], f"rank {rank}: stage bounds"
        # the weights a rebuild hands partition_balanced instead of building every layer again
        assert r["our_layer_params"] == r["layer_params"], f"rank {rank}: each layer's trainable elements"
        assert r["our_params"] == r["params"], f"rank {rank}: the stage's parameters"
        assert r["layout_rank"] == rank
        assert r["partition_sizes"][0] == r["partition_sizes"][1], f"rank {rank}"
        assert r["partitions_equal"], f"rank {rank}: fp32 partitions differ from the oracle"
    # the case is what it claims: the tied embedding sits on the first and the last stage
    first = json.loads((tmp_path / "rank0.json").read_text())
    last = json.loads((tmp_path / f"rank{world - 1}.json").read_text())
    assert first["params"][0][0] == last["params"][0][0] == "tied_modules.embed.weight"
    assert len(set(first["parts"])) == pp + 1
