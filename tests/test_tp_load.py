"""Loading a checkpoint across TP degrees (``engine.load_checkpoint`` of an AutoTP job): DeepSpeed's
own AutoTP checkpoint and this project's, saved at one TP x DP layout and loaded at another, on
real gloo groups with a tiny Hugging Face Llama with uneven GQA (``tests/workers/tp_switch_worker.py``,
modes ``save``, ``load`` and ``static``), and the snapshots of an AutoTP job (``dynatrain.snapshot``)
written across a TP switch.

Oracles (``verify``, ``inspect`` and ``export`` of the saved checkpoint are checked too: the exported
weights equal the saving job's fp32 master bitwise):

* the gathered logical state (every parameter's fp32 master and both Adam moments whole, the TP
  shards joined by DeepSpeed's own affine maps, and the optimizer step) after the load equals,
  bitwise, the saving job's state at the save;
* a static run at the new layout, plain DeepSpeed with no code of ds_dynatrain, started from the
  saving job's state (set through DeepSpeed's own ``safe_set_full_*``), trains the same batches:
  every loss after the load and the final state equal the loaded job's, bitwise.

With ``--refuse`` the loading job first loads a copy of the checkpoint missing one TP rank's
optimizer-state file: refused with ``CheckpointIncompleteError`` naming the file, every rank's
fp32 master and working parameters unchanged (bitwise), and the real load that follows still meets both oracles.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import WORKERS, run_plain
from offline_tools import check_offline_tools, check_refused_unchanged
from test_tp_switch import _equal

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(WORKERS, "tp_switch_worker.py")

# (processes, worker arguments)
CASES = {
    # dynatrain.snapshot every step, TP 1 at step 1, a switch to TP 2, its snapshot at step 2 loaded at TP 1
    "snapshots_tp2_to_tp1_zero2_refusal": (
        2,
        ["--save-with", "snapshots", "--tp-from", "2", "--tp-to", "1", "--stage", "2", "--refuse"],
    ),
    "deepspeed_tp2_to_tp1_zero2_refusal": pytest.param(
        (2, ["--save-with", "deepspeed", "--tp-from", "2", "--tp-to", "1", "--stage", "2", "--refuse"]),
        marks=pytest.mark.slow,
    ),
    "ours_tp1_to_tp2_zero3_bf16": pytest.param(
        (2, ["--save-with", "ours", "--tp-from", "1", "--tp-to", "2", "--stage", "3", "--bf16"]),
        marks=pytest.mark.slow,
    ),
    "ours_tp2_to_tp1_zero2": pytest.param(
        (2, ["--save-with", "ours", "--tp-from", "2", "--tp-to", "1", "--stage", "2"]), marks=pytest.mark.slow
    ),
    "deepspeed_tp1_to_tp2_zero3_bf16": pytest.param(
        (2, ["--save-with", "deepspeed", "--tp-from", "1", "--tp-to", "2", "--stage", "3", "--bf16"]),
        marks=pytest.mark.slow,
    ),
    "deepspeed_tp2_to_tp1_zero2_fp16": pytest.param(
        (2, ["--save-with", "deepspeed", "--tp-from", "2", "--tp-to", "1", "--stage", "2", "--fp16"]),
        marks=pytest.mark.slow,
    ),
    # the loading job has no tensor_parallel section at all: a plain ZeRO job
    "ours_tp2_into_a_job_without_autotp": pytest.param(
        (2, ["--save-with", "ours", "--tp-from", "2", "--tp-to", "1", "--stage", "2", "--no-autotp"]),
        marks=pytest.mark.slow,
    ),
    "ours_tp2_same_layout_zero1_tied": pytest.param(
        (2, ["--save-with", "ours", "--tp-from", "2", "--tp-to", "2", "--stage", "1", "--tie"]),
        marks=pytest.mark.slow,
    ),
    "ours_tp2dp2_to_tp1dp4_bf16_tied": pytest.param(
        (4, ["--save-with", "ours", "--tp-from", "2", "--tp-to", "1", "--stage", "2", "--bf16", "--tie"]),
        marks=pytest.mark.slow,
    ),
    "deepspeed_tp1dp4_to_tp2dp2_zero1": pytest.param(
        (4, ["--save-with", "deepspeed", "--tp-from", "1", "--tp-to", "2", "--stage", "1"]),
        marks=pytest.mark.slow,
    ),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_load_across_tp_equals_the_saved_state_and_the_static_run(tmp_path, case):
    nproc, args = case
    common = ["--out", str(tmp_path), *args]
    for mode in ("save", "load", "static"):
        jobs = run_plain(tmp_path, SCRIPT, nproc, [*common, "--mode", mode], timeout=200, name=mode)
        assert all(j.returncode == 0 for j in jobs), "\n".join(j.output[-3000:] for j in jobs)
    before, after = torch.load(tmp_path / "before.pt"), torch.load(tmp_path / "after.pt")
    check_offline_tools(str(tmp_path / "ckpt"), before, nproc, tp=int(args[args.index("--tp-from") + 1]))
    assert not _equal(before, after), "the load did not restore the saved logical state"
    final_load, final_static = torch.load(tmp_path / "final_switch.pt"), torch.load(tmp_path / "final_static.pt")
    assert not _equal(final_load, final_static), "training after the load differs from the static run"
    loaded = json.loads((tmp_path / "losses_switch.json").read_text())
    static = json.loads((tmp_path / "losses_static.json").read_text())
    assert loaded["losses"] == static["losses"]
    assert loaded["steps"] == 4  # the saved step (2) and two more
    tp_to = int(args[args.index("--tp-to") + 1])
    log = (tmp_path / "load_rank0.log").read_text()
    assert f"onto TP {tp_to} x DP {nproc // tp_to}" in log
    if "--refuse" in args:
        assert "mp_rank_01_optim_states.pt: missing" in loaded["refusal"], loaded["refusal"]
        check_refused_unchanged(tmp_path, nproc)
