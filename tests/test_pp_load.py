"""Loading DeepSpeed's own pipeline checkpoint (``layer_XX-model_states.pt``, one ``mp_rank_XX``
model-state file per stage, ZeRO-1 files) into a pipeline job at another PP and DP degree
(``engine.load_checkpoint`` of the engine ``ds_dynatrain.initialize`` builds from a
``PipelineModule``), on real gloo groups (``tests/workers/pp_switch_worker.py``: modes
``route-save``, plain DeepSpeed training and saving at the old PP; ``load``; ``static``).

Oracles (``verify``, ``inspect`` and ``export`` of the saved checkpoint are checked too: the
exported weights equal the saving job's fp32 master bitwise):

* the gathered logical state (every parameter's fp32 master and both Adam moments whole, from
  every stage, the tied copies equal; the optimizer step) right after the load equals, bitwise,
  the saving job's state at the save;
* a plain DeepSpeed run at the new PP degree (no code of ds_dynatrain) started from the saving
  job's state, set with DeepSpeed's own ``safe_set_full_*``, trains the same batches: every loss
  after the load and the final state equal the loaded job's, bitwise.

The checkpoint is DeepSpeed's own (plain ``deepspeed.initialize`` and ``save_checkpoint``) or this
project's snapshots of a pipeline job (``dynatrain.snapshot``, asynchronous, every step). With
``refuse`` the loading job first loads a copy missing stage 1's optimizer-state file and a layer's
file (not read by the load, but DeepSpeed's own needs it), whole and with ``load_module_only=True``:
refused with ``CheckpointIncompleteError`` naming the file, every rank's fp32 master and working
parameters unchanged (bitwise), and the real load that follows meets both oracles.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import WORKERS, run_plain
from offline_tools import check_offline_tools, check_refused_unchanged
from test_pp_switch import _equal

from ds_dynatrain.checkpoint.saved_file import is_snapshot_file

pytestmark = pytest.mark.multiprocess

WORKER = os.path.join(WORKERS, "pp_switch_worker.py")

# (world, pp saved, pp loaded, partition method saved, at the load, dtype, a layer with a buffer, refuse,
#  saved by ds_dynatrain's snapshots instead of DeepSpeed's save_checkpoint, two optimizer groups)
CASES = {
    # two optimizer parameter groups (weight decay, and none for biases and the norm)
    "deepspeed_pp2_to_pp1_groups_refusal": (2, 2, 1, "parameters", "parameters", "float32", False, True, False, True),
    "snapshots_pp1_to_pp2": pytest.param(
        (2, 1, 2, "parameters", "uniform", "float32", False, False, True, False), marks=pytest.mark.slow
    ),
    "snapshots_pp2dp2_to_pp4_uniform_bf16": pytest.param(
        (4, 2, 4, "uniform", "parameters", "bfloat16", False, False, True, False), marks=pytest.mark.slow
    ),
    "deepspeed_pp4_to_pp2dp2_buffer": pytest.param(
        (4, 4, 2, "parameters", "parameters", "float32", True, True, False, False), marks=pytest.mark.slow
    ),
    "snapshots_pp2_to_pp1_refusal": pytest.param(
        (2, 2, 1, "parameters", "parameters", "float32", False, True, True, False), marks=pytest.mark.slow
    ),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_pipeline_checkpoint_loads_at_another_pp_as_saved_and_trains_as_the_static_run(tmp_path, case):
    world, a, b, method, method_to, dtype, buffer, refuse, snapshots, groups = case
    common = ["--pp-from", str(a), "--pp-to", str(b), "--method", method, "--method-to", method_to]
    common += ["--dtype", dtype, "--out", str(tmp_path)] + ["--buffer"] * buffer + ["--groups"] * groups
    for mode in ("route-save", "load", "static"):
        extra = ["--refuse"] if refuse and mode == "load" else []
        extra += ["--snapshots"] if snapshots and mode == "route-save" else []
        jobs = run_plain(tmp_path, WORKER, world, ["--mode", mode, *common, *extra], timeout=240, name=mode)
        assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    before, after = torch.load(tmp_path / "before.pt"), torch.load(tmp_path / "after.pt")
    _equal(before, after)  # the loaded state is the saved one, bitwise
    check_offline_tools(str(tmp_path / "route"), before, world, pp=a)
    loaded = json.loads((tmp_path / "load_rank0.json").read_text())
    static = json.loads((tmp_path / "static_rank0.json").read_text())
    assert loaded["after"] == static["after"], (loaded["after"], static["after"])
    _equal(torch.load(tmp_path / "final_load.pt"), torch.load(tmp_path / "final_static.pt"))
    assert loaded["steps_loaded"] == 2 and loaded["path"].endswith("mp_rank_00_model_states.pt")
    if snapshots:  # this project's format, every file of it, only the last snapshot kept
        saved = os.listdir(tmp_path / "route")
        assert [d for d in saved if d.startswith("global_step")] == ["global_step2"], saved
        files = os.listdir(tmp_path / "route" / "global_step2")
        assert any(f.startswith("layer_") for f in files) and all(
            is_snapshot_file(str(tmp_path / "route" / "global_step2" / f)) for f in files
        ), files
    log = (tmp_path / "load_rank0.log").read_text()
    assert f"(ZeRO-1, PP {a} x DP {world // a}) onto PP {b} x DP {world // b}" in log
    if refuse:
        assert "zero_pp_rank_0_mp_rank_01_optim_states.pt: missing" in loaded["refusal"], loaded["refusal"]
        assert "layer_01-model_states.pt: missing" in loaded["refusal"], loaded["refusal"]
        # the module alone (DeepSpeed's own load of the layer files): refused before it reads one
        assert "layer_01-model_states.pt: missing" in loaded["refusal_module_only"], loaded["refusal_module_only"]
        # stage 1's model-state file of an earlier save: refused, naming it
        assert (
            "mixes files of several saves: global_steps 1 in mp_rank_01_model_states.pt; global_steps 2 in"
            in loaded["refusal_stale"]
        ), loaded["refusal_stale"]
        assert "resize_schedule entries at steps [1] are at or before the loaded step 2" in log
        check_refused_unchanged(tmp_path, world)
