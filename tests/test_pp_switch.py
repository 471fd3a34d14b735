"""A pipeline job's PP degree switched online, in memory, beside two oracles
(``tests/workers/pp_switch_worker.py``, real DeepSpeed pipeline engines on gloo):

* a PP degree the world cannot take, and another number of processes, are refused with the
  reason, nothing changed (more stages than layers: ``tests/test_pp_plan.py``);
* the gathered logical state (every parameter's fp32 master and both Adam moments, whole, from
  every stage; the optimizer step) is bitwise the same right after the switch as right before it,
  and the copies of the tied embedding/head on different stages are equal;
* the losses of the steps after the switch and the final state equal, bitwise, a plain DeepSpeed
  run at the new PP degree started from the state before the switch (set with DeepSpeed's own
  ``safe_set_full_*``), and DeepSpeed's universal-checkpoint route for the same change;
* the same change made by the config's ``resize_schedule`` (inside ``train_batch``) trains the
  same, bitwise, and schedules the job cannot take are refused at ``initialize``, naming the entry;
  its snapshots (every step) hold, bitwise, the state of their step at their step's layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import WORKERS, assert_no_gloo_thread, run_plain
from safetensors.torch import load_file

from ds_dynatrain.checkpoint.consolidate import export_safetensors
from ds_dynatrain.checkpoint.inspect import inspect_report

pytestmark = pytest.mark.multiprocess

WORKER = os.path.join(WORKERS, "pp_switch_worker.py")

# (world, pp from, pp to, partition method, dtype, a layer with a buffer: the real rebuild, two optimizer
#  parameter groups: weight decay and none for the norm, which PP 2's stage 0 does not hold)
CASES = {
    "pp2_to_pp1_groups": (2, 2, 1, "parameters", "float32", False, True),
    "pp1_to_pp2": pytest.param((2, 1, 2, "parameters", "float32", False, False), marks=pytest.mark.slow),
    "pp2dp2_to_pp4_uniform_bf16": pytest.param((4, 2, 4, "uniform", "bfloat16", False, False), marks=pytest.mark.slow),
    "pp4_to_pp1dp4_buffer_groups": pytest.param((4, 4, 1, "parameters", "float32", True, True), marks=pytest.mark.slow),
    "pp2_to_pp1_fp16": pytest.param((2, 2, 1, "parameters", "float16", False, False), marks=pytest.mark.slow),
}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k == "__step__":
            assert set(a[k]) == set(b[k]), k
            continue
        for kind in a[k]:
            assert torch.equal(a[k][kind], b[k][kind]), f"{k} {kind}"


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_pp_switch_equals_the_static_run(tmp_path, case):
    world, a, b, method, dtype, buffer, groups = case
    common = ["--pp-from", str(a), "--pp-to", str(b), "--method", method, "--dtype", dtype, "--out", str(tmp_path)]
    common += ["--buffer"] * buffer + ["--groups"] * groups
    for mode in ("switch", "schedule", "static"):
        jobs = run_plain(tmp_path, WORKER, world, ["--mode", mode, *common], timeout=240, name=mode)
        assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
        if mode == "switch":  # DeepSpeed's comm uses torch's current collectives, also at DP > 1
            assert not any("FutureWarning" in j.output for j in jobs), jobs[0].output[-4000:]
    switch = [json.loads((tmp_path / f"switch_rank{r}.json").read_text()) for r in range(world)]
    static = json.loads((tmp_path / "static_rank0.json").read_text())
    rec = switch[0]["record"]
    assert (rec["pipeline_parallel_from"], rec["pipeline_parallel_to"]) == (a, b)
    assert rec["bytes_moved"] > 0 and rec["from"] == rec["to"] == world
    assert sorted({s["stage"] for s in switch}) == list(range(b)) and len(switch[0]["parts"]) == b + 1
    refused = switch[0]["refused"]
    assert f"PP degree {world + 1} refused: it must be >= 1 and divide the world size {world}" in refused[0]
    assert f"world size {world + 1} refused: a pipeline job changes its PP degree over its {world}" in refused[1]
    assert "PP degree 0 refused" in refused[2]
    assert "TP degree 2 refused: a PipelineModule job has no tensor-parallel axis" in refused[3]
    assert f"PP degree {world + 1} refused: it must be >= 1 and divide the world size {world}" in refused[4]
    # prepared by engine.prepare_resize just before (and waited for): all the memory it announced
    # was touched, freed at the switch and counted in the record
    assert rec["prepared_bytes"] == switch[0]["prepared"] > 0 and rec["prepared_touch_s"] > 0
    # the refusals changed nothing, the switch moved the state bitwise
    _equal(torch.load(tmp_path / "before.pt"), torch.load(tmp_path / "after.pt"))
    assert all(s["after"] == static["after"] for s in switch), (switch[0]["after"], static["after"])
    _equal(torch.load(tmp_path / "final_switch.pt"), torch.load(tmp_path / "final_static.pt"))
    # the switched job's processes exit normally, no gloo thread left to outlive the interpreter
    for r in range(world):
        assert_no_gloo_thread(tmp_path / f"threads_switch_rank{r}")
    # training went on: the state changed after the switch
    before, final = torch.load(tmp_path / "before.pt"), torch.load(tmp_path / "final_switch.pt")
    assert not torch.equal(before["1.fc1.weight"]["fp32"], final["1.fc1.weight"]["fp32"])
    # the same change by the config's resize_schedule, inside train_batch: the same training
    scheduled = [json.loads((tmp_path / f"schedule_rank{r}.json").read_text()) for r in range(world)]
    assert scheduled[0]["record"]["pipeline_parallel_to"] == b and scheduled[0]["record"]["step"] == 2
    assert scheduled[0]["record"]["prepared_bytes"] > 0  # touched ahead (dynatrain.warm_switch_steps)
    assert all(s["before"] == switch[0]["before"] and s["after"] == static["after"] for s in scheduled)
    _equal(torch.load(tmp_path / "final_schedule.pt"), torch.load(tmp_path / "final_static.pt"))
    # its snapshots, taken every step: the one of the switch's step is of the old layout and holds
    # the state before the switch, the last one the final state (read by `export`, no model)
    snaps = str(tmp_path / "snaps")
    for step, pp, state in ((2, a, "before.pt"), (4, b, "final_schedule.pt")):
        info = inspect_report(snaps, f"global_step{step}")
        assert (info["pipeline_parallel"], info["world_size"], info["step"]) == (pp, world, step)
        out = str(tmp_path / f"export{step}.safetensors")
        export_safetensors(snaps, out, tag=f"global_step{step}")
        weights, want = load_file(out), torch.load(tmp_path / state)
        assert all(torch.equal(weights[k], want[k]["fp32"]) for k in want if k != "__step__")
    said = scheduled[0]["refused"]
    assert f"(step 2): world size {world + 1}: a PipelineModule job changes its PP degree over its {world}" in said[0]
    assert "(step 2) gives no pipeline_parallel" in said[1]
    assert f"(step 2): PP degree {world + 1} refused: it must be >= 1 and divide the world size {world}" in said[2]


@pytest.mark.slow  # the static oracle of test_pp_switch_equals_the_static_run is the one in make test
@pytest.mark.parametrize(
    "case",
    [(2, 2, 1, "parameters", "float32", False, False), (2, 1, 2, "parameters", "float32", False, False)],
    ids=["pp2_to_pp1", "pp1_to_pp2"],
)
def test_pp_switch_equals_the_universal_checkpoint_route(tmp_path, case):
    """The second oracle: DeepSpeed's own route for the same change (save at the old PP,
    ``ds_to_universal``, relaunch at the new PP with ``load_universal``) gives, bitwise, the losses
    and final state of the online switch."""
    world, a, b, method, dtype, buffer, groups = case
    common = ["--pp-from", str(a), "--pp-to", str(b), "--method", method, "--dtype", dtype, "--out", str(tmp_path)]
    common += ["--buffer"] * buffer + ["--groups"] * groups
    jobs = run_plain(tmp_path, WORKER, world, ["--mode", "route-save", *common], timeout=240, name="save")
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    convert = subprocess.run(
        [
            *(sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state"),
            *(
                "--input_folder",
                str(tmp_path / "route" / "t"),
                "--output_folder",
                str(tmp_path / "route_universal" / "t"),
            ),
            *("--num_extract_workers", "1", "--num_merge_workers", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert convert.returncode == 0, convert.stdout[-2000:] + convert.stderr[-2000:]
    for mode in ("route-load", "switch"):
        jobs = run_plain(tmp_path, WORKER, world, ["--mode", mode, *common], timeout=240, name=mode)
        assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    saved = json.loads((tmp_path / "route-save_rank0.json").read_text())
    route = json.loads((tmp_path / "route-load_rank0.json").read_text())
    switch = json.loads((tmp_path / "switch_rank0.json").read_text())
    assert saved["before"] == switch["before"]  # the same training up to the change on both routes
    assert route["after"] == switch["after"], (route["after"], switch["after"])
    _equal(torch.load(tmp_path / "final_route-load.pt"), torch.load(tmp_path / "final_switch.pt"))


def test_training_data_follows_the_global_sample_order_across_a_switch(tmp_path):
    """The training data handed to ``initialize`` (16 samples, 4 a step), read by ``train_batch()``
    on the first and last stages: every step, at PP 2 and after the switch to PP 1 x DP 2, and
    into the second epoch, trains on exactly the samples of the global order (torch's
    ``randperm`` seeded with ``seed + epoch``, seed 0) for that step, and on no other."""
    args = ["--mode", "data", "--pp-from", "2", "--pp-to", "1", "--steps-before", "2", "--steps-after", "4"]
    jobs = run_plain(tmp_path, WORKER, 2, [*args, "--out", str(tmp_path)], timeout=240, name="data")
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    ranks = [json.loads((tmp_path / f"data_rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["loader"] == "ElasticDataLoader" and ranks[0]["steps"] == 6
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for step in range(6):
        epoch, k = divmod(step, 4)
        want = torch.randperm(16, generator=torch.Generator().manual_seed(epoch))[4 * k : 4 * k + 4].tolist()
        fetched = [sorted(i for s, i in r["log"] if s == step) for r in ranks]
        assert sorted(set(fetched[0]) | set(fetched[1])) == sorted(want), (step, fetched, want)
        if step < 2:  # PP 2: stage 0 reads the inputs, stage 1 the labels, of the same 4 samples
            assert fetched[0] == fetched[1] == sorted(want)
        else:  # PP 1 x DP 2: each DP rank 2 of them
            assert len(fetched[0]) == len(fetched[1]) == 2 and not set(fetched[0]) & set(fetched[1])


def test_a_stage_the_switch_cannot_rebuild_stops_every_rank_at_initialize(tmp_path):
    """A layer with a persistent buffer on PP 2's last stage only: both ranks are refused at
    ``initialize`` with the same error naming the buffer (not one rank refused and the other
    waiting in the engine's first collective)."""
    args = ["--mode", "refuse-start", "--pp-from", "2", "--out", str(tmp_path)]
    jobs = run_plain(tmp_path, WORKER, 2, args, timeout=120, name="refuse")
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    said = [json.loads((tmp_path / f"refuse-start_rank{r}.json").read_text())["refusal"] for r in range(2)]
    assert said[0] == said[1] and "cannot change PP yet: 6.factor" in said[0], said
