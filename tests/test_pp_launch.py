"""A pipeline job under ``dynatrain launch``: it trains on its script's group; at its step
boundary it serves a PP change at its world size, shrinks on a preemption notice and on a request
for fewer processes (the largest layout the processes left serve), grows by new processes the
launcher starts, refuses what it cannot do with
the reason, and stops on a signal to the launcher; a worker that dies without notice is the
launcher's restart on the processes left, from the last snapshot, at another PP degree.

Each job is checked against the same job undisturbed; the switch itself is checked bitwise against
static runs in ``tests/test_pp_switch.py``, a load at another layout in ``tests/test_pp_load.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import WORKERS, background_job, launch, read_jsonl

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]

SCRIPT = os.path.join(WORKERS, "pp_launch_worker.py")


def _config(out) -> dict:
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "dynatrain": {
            "snapshot": {"interval_steps": 1, "dir": str(out / "snaps"), "keep_last": 2},
            "metrics_path": str(out / "metrics.jsonl"),
        },
    }


@pytest.fixture(scope="module")
def static_steps(tmp_path_factory):
    """The oracle of the online changes: the 2-process job (PP 2 x DP 1) undisturbed, 24 steps over
    the training data handed to ``initialize`` (``--data``, as every job compared with it: the
    samples of each step follow the global order whatever the layout, so a joiner or a process at
    another DP rank that read other samples would show in the losses)."""
    out = tmp_path_factory.mktemp("static")
    job = launch(out, SCRIPT, 2, _config(out), ["--out", str(out), "--steps", "24", "--data"], timeout=300, name="job")
    assert job.returncode == 0, job.output[-4000:]
    want = read_jsonl(str(out / "steps.jsonl"))
    assert [(r["step"], r["world"], r["pp"]) for r in want] == [(s, 2, 2) for s in range(1, 25)]
    # the job's own step records: one a step, its DP size (1 at PP 2) and the loss train_batch returned
    steps = [r for r in read_jsonl(str(out / "metrics.jsonl")) if r["event"] == "step"]
    assert [(r["step"], r["world_size"], r["loss"], r["samples"]) for r in steps] == [
        (w["step"], 1, w["loss"], 4) for w in want
    ]
    assert all(r["step_s"] > 0 and r["samples_per_s"] > 0 for r in steps)
    return want


def _steps(out) -> list:
    """The step records of a job, one a step: rank 0 before and after a change may both write one
    (the same loss: every stage gets the last stage's)."""
    got: dict = {}
    for r in read_jsonl(str(out / "steps.jsonl")):
        assert got.setdefault(r["step"], r)["loss"] == r["loss"], r
    return [got[s] for s in sorted(got)]


def _close(got, want) -> bool:
    """Every loss of ``got`` within 1e-5 relative of ``want``'s at its step."""
    by_step = {w["step"]: w["loss"] for w in want}
    return all(abs(g["loss"] - by_step[g["step"]]) <= 1e-5 * abs(by_step[g["step"]]) for g in got)


# make test-slow (the suite's time): make test keeps a PP job's requests under launch (the grow and
# shrink below) and its PP switch (test_pp_switch)
@pytest.mark.slow
def test_a_pipeline_job_serves_requests_and_shrinks_online_on_a_preemption_and_on_a_request(tmp_path, static_steps):
    """PP 2 x DP 2 over 4 processes. Asked for a TP degree after step 1 (refused) and for PP 1
    after step 2 (read after step 3, its memory touched during the two steps ``warm_switch_steps``
    gives it, served after step 5: PP 1 x DP 4). The last process gets a preemption notice
    (SIGTERM) after step 5: at step 6's boundary it hands its state over and leaves, and the job
    goes on at the largest layout its 3 survivors serve whose DP size splits the global batch of
    4: PP 3 x DP 1 (PP 1 x DP 3 would not split it). Asked for one process, no PP degree, after
    step 7: PP 1 x DP 1 after step 8. No restart: one generation of processes throughout. Oracle: a 2-process job
    without any of it (PP 2 x DP 1), every loss within 1e-5 relative (the same micro-batches in the
    same order; a DP size other than 1 rounds a gradient differently)."""
    shrunk = tmp_path
    extra = ["--request", "--preempt-at", "5", "--shrink-at", "7", "--steps", "9", "--data"]
    job = launch(shrunk, SCRIPT, 4, _config(shrunk), ["--out", str(shrunk), *extra], timeout=300, name="job")
    assert job.returncode == 0, job.output[-4000:]
    got = _steps(shrunk)
    assert [(r["step"], r["world"], r["pp"], r["generation"]) for r in got] == [
        (1, 4, 2, 0),
        (2, 4, 2, 0),
        (3, 4, 2, 0),  # the request read: its switch prepared
        (4, 4, 2, 0),
        (5, 4, 1, 0),  # the request switched the job to PP 1 x DP 4 after step 5
        (6, 3, 3, 0),  # the preemption: PP 3 x DP 1
        (7, 3, 3, 0),
        (8, 1, 1, 0),  # the request for one process
        (9, 1, 1, 0),
    ]
    assert _close(got, static_steps), (got, static_steps)
    refused, served = json.loads((shrunk / "request.json").read_text())
    assert refused["returncode"] == 2, refused
    assert "a PipelineModule job of 4 processes changes its PP and DP degrees" in refused["output"], refused
    assert "has no TP degree" in refused["output"], refused
    assert served["returncode"] == 0, served
    assert "PP 2 x DP 2 -> PP 1 x DP 4 after step 5" in served["output"], served
    resized = [r for r in read_jsonl(str(shrunk / "metrics.jsonl")) if r["event"] == "resize"]
    figures = [(r["step"], r["from"], r["to"], r["pipeline_parallel_from"], r["pipeline_parallel_to"]) for r in resized]
    assert figures == [(5, 4, 4, 2, 1), (6, 4, 3, 1, 3), (8, 3, 1, 3, 1)]
    assert all(r["bytes_moved"] > 0 for r in resized[:2])
    assert resized[0]["prepared_bytes"] > 0  # the request's switch found its memory touched ahead
    log = (shrunk / "job.log").read_text()
    assert "restarting" not in log and "failed" not in log, log[-3000:]
    left = [json.loads(p.read_text()) for p in shrunk.glob("left_*.json")]  # the preempted one, then two
    assert len(left) == 3 and all(len(s) == 2 for s in left), left
    assert all(x.startswith("NotAMemberError: member g0r") for said in left for x in said), left


@pytest.mark.slow  # the requested switch and the preemption, each on its own, are the test above
def test_a_preemption_gives_up_a_requested_pp_switch_still_being_prepared(tmp_path, static_steps):
    """PP 2 x DP 1 over 2 processes, asked for PP 1 after step 1: read after step 2, its switch due
    after step 4. The second process gets a preemption notice after step 3: at step 4's boundary
    the prepared switch is given up (the requester told why, not a refusal of the layout) and the
    job shrinks to its one survivor at PP 1. Oracle: the undisturbed 2-process job."""
    extra = ["--switch-at", "1", "--preempt-at", "3", "--steps", "5", "--data"]
    job = launch(tmp_path, SCRIPT, 2, _config(tmp_path), ["--out", str(tmp_path), *extra], timeout=300, name="job")
    assert job.returncode == 0, job.output[-4000:]
    got = _steps(tmp_path)
    assert [(r["step"], r["world"], r["pp"]) for r in got] == [(1, 2, 2), (2, 2, 2), (3, 2, 2), (4, 1, 1), (5, 1, 1)]
    assert _close(got, static_steps), (got, static_steps)
    answer = json.loads((tmp_path / "switch.json").read_text())
    assert answer["returncode"] != 0 and "PP 1 abandoned: a preemption came first" in answer["output"], answer
    resized = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["event"] == "resize"]
    assert [(r["step"], r["from"], r["to"], r["pipeline_parallel_to"]) for r in resized] == [(4, 2, 1, 1)]
    assert resized[0].get("prepared_bytes") is None  # the hold was let go with the request, not used


def test_a_pipeline_job_grows_online_by_new_processes_and_shrinks_back(tmp_path, static_steps):
    """PP 2 x DP 1 over 2 processes. Asked for 4 processes at PP 4 after step 2: the launcher
    starts two joiners (each builds the module at PP 1 in its world of one) while the job trains
    on; once every process has the new generation's group the job switches to PP 4 x DP 1 (whole
    layers moved to the new stages, joiners receiving) at a step the test does not know; each
    joiner warmed up first (rank 0's modules, forward and backward on a synthetic batch). A request
    queued while the grow is prepared waits for it. Asked for 2 processes 2 steps after the grow
    (no PP degree: the job picks PP 2, the largest its world takes): PP 2 x DP 1, two of the 4
    leaving. Oracle: the job undisturbed; the DP size stays 1, so every loss is bitwise its loss.
    The snapshots of the 4-process world (joiners writing their stages) commit; the step whose
    boundary grew the job takes none (its joiners enter at the next step)."""
    extra = ["--grow-at", "2", "--grow-to", "4", "--grow-pp", "4", "--shrink-after", "2", "--shrink-to", "2", "--data"]
    job = launch(tmp_path, SCRIPT, 2, _config(tmp_path), ["--out", str(tmp_path), "--steps", "24", *extra], timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    got = _steps(tmp_path)
    grew = next(r["step"] for r in got if r["world"] == 4)  # the boundary of this step grew the job
    assert grew >= 3, got
    worlds = [(r["step"], r["world"], r["pp"]) for r in got]
    assert worlds == [(s, 2, 2) for s in range(1, grew)] + [(s, 4, 4) for s in range(grew, grew + 3)] + [
        (grew + 3, 2, 2),  # asked for after step grew + 2: the shrink after step grew + 3
        (grew + 4, 2, 2),
    ], worlds
    by_step = {w["step"]: w["loss"] for w in static_steps}
    assert [r["loss"] for r in got] == [by_step[r["step"]] for r in got]
    grow = json.loads((tmp_path / "grow.json").read_text())
    assert grow["returncode"] == 0, grow
    assert f"PP 2 x DP 1 -> PP 4 x DP 1 after step {grew} in " in grow["output"], grow
    assert "prepared in the background" in grow["output"], grow
    metrics = read_jsonl(str(tmp_path / "metrics.jsonl"))
    resized = [r for r in metrics if r["event"] == "resize"]
    figures = [(r["step"], r["from"], r["to"], r["pipeline_parallel_from"], r["pipeline_parallel_to"]) for r in resized]
    assert figures == [(grew, 2, 4, 2, 4), (grew + 3, 4, 2, 4, 2)]
    assert all(r["bytes_moved"] > 0 for r in resized) and resized[0]["prepare_s"] > 0
    snaps = [(r["step"], r["ok"]) for r in metrics if r["event"] == "snapshot"]
    assert snaps == [(s, True) for s in range(1, grew + 5) if s != grew], snaps
    log = (tmp_path / "job.log").read_text()
    assert log.count("starting joiner") == 2, log[-3000:]
    assert log.count("joiner warmed up in") == 2, log[-3000:]  # rank 0's input described, both warmed
    assert "restarting" not in log and "failed" not in log, log[-3000:]


@pytest.mark.slow  # the grow's other branch: blocking (no background_groups), DP inside the new stages
def test_a_pipeline_job_grows_at_its_pp_degree_waiting_for_its_joiners(tmp_path, static_steps):
    """As above with ``background_groups`` off and no PP degree asked: the request is served at
    the step boundary after it, the survivors waiting at the rendezvous for the joiners' start-up,
    and the job keeps PP 2, now over DP 2 (each stage's fp32 master and moments re-partitioned
    in its DP group, half of each moving to a joiner). Oracle: the job undisturbed, every loss
    within 1e-5 relative (DP 2 rounds gradients differently)."""
    config = _config(tmp_path)
    config["dynatrain"]["background_groups"] = False
    extra = ["--grow-at", "2", "--grow-to", "4", "--shrink-after", "2", "--shrink-to", "2", "--data"]
    job = launch(tmp_path, SCRIPT, 2, config, ["--out", str(tmp_path), "--steps", "24", *extra], timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    got = _steps(tmp_path)
    assert [(r["step"], r["world"], r["pp"]) for r in got] == [(1, 2, 2), (2, 2, 2)] + [
        (s, 4, 2) for s in (3, 4, 5)
    ] + [(6, 2, 2), (7, 2, 2)]
    assert _close(got, static_steps), (got, static_steps)
    grow = json.loads((tmp_path / "grow.json").read_text())
    assert grow["returncode"] == 0 and "PP 2 x DP 1 -> PP 2 x DP 2 after step 3 in " in grow["output"], grow
    resized = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["event"] == "resize"]
    assert [(r["step"], r["from"], r["to"]) for r in resized] == [(3, 2, 4), (6, 4, 2)]
    assert resized[0]["bytes_moved"] > 0 and "prepare_s" not in resized[0]


@pytest.mark.slow  # the grow and shrink are the requests' above; this is the config's schedule reaching them
def test_a_pipeline_jobs_schedule_grows_and_shrinks_it_under_launch(tmp_path, static_steps):
    """PP 2 x DP 1 over 2 processes with ``resize_schedule`` [step 3: 4 processes at PP 4, step 6:
    2 at PP 2]: the launcher accepts the entries (their DP sizes are the job's to check, against
    its layout), the joiners start a few steps ahead of step 3, the job grows after step 3 and
    shrinks after step 6. Oracle: the job undisturbed, every loss bitwise (DP 1 throughout)."""
    config = _config(tmp_path)
    config["dynatrain"]["resize_schedule"] = [
        {"step": 3, "world_size": 4, "pipeline_parallel": 4},
        {"step": 6, "world_size": 2, "pipeline_parallel": 2},
    ]
    job = launch(tmp_path, SCRIPT, 2, config, ["--out", str(tmp_path), "--steps", "8", "--data"], timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    got = _steps(tmp_path)
    worlds = [(r["step"], r["world"], r["pp"]) for r in got]
    assert worlds == [(1, 2, 2), (2, 2, 2), (3, 4, 4), (4, 4, 4), (5, 4, 4), (6, 2, 2), (7, 2, 2), (8, 2, 2)]
    by_step = {w["step"]: w["loss"] for w in static_steps}
    assert [r["loss"] for r in got] == [by_step[r["step"]] for r in got]
    resized = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["event"] == "resize"]
    assert [(r["step"], r["from"], r["to"], r["pipeline_parallel_to"]) for r in resized] == [(3, 2, 4, 4), (6, 4, 2, 2)]


@pytest.mark.slow  # the grow is the one above; this is the request another host's agent makes
def test_dynatrain_join_grows_a_pipeline_job_by_the_joining_hosts_slots(tmp_path, static_steps):
    """PP 2 x DP 1 over 2 processes, held after step 3 while a second agent (`dynatrain join
    --nproc 2`, node 1) asks the job to grow by its 2 slots: the job grows to 4 processes at PP 2 x
    DP 2 (the degree it picks), both joiners started on node 1. Oracle: the job undisturbed, every
    loss within 1e-5 relative (DP 2 rounds gradients differently)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_config(tmp_path)))
    flag, log, join_log = tmp_path / "go", tmp_path / "job.log", tmp_path / "join.log"
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--config", str(cfg), SCRIPT]
    args = ["--out", str(tmp_path), "--steps", "12", "--data", "--hold-at", "3", "--flag", str(flag)]
    with background_job(cmd + args, str(log)) as job:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"held_{r}").exists() for r in (0, 1)):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        store = ""
        for line in log.read_text().splitlines():
            if "agent: store at " in line:
                store = line.split("agent: store at ")[1].split(",")[0]
        join = [sys.executable, "-m", "ds_dynatrain.cli", "join", "--store", store, "--nproc", "2"]
        with background_job(join + ["--config", str(cfg), SCRIPT, *args[:5]], str(join_log)) as joining:
            while "asks the job to grow by 2" not in join_log.read_text():
                assert joining.poll() is None and time.monotonic() < deadline, join_log.read_text()[-3000:]
                time.sleep(0.1)
            flag.write_text("")
            assert job.wait(timeout=240) == 0, log.read_text()[-3000:]
            joining.wait(timeout=60)
    got = _steps(tmp_path)
    grew = next(r["step"] for r in got if r["world"] == 4)
    assert [(r["step"], r["world"], r["pp"]) for r in got] == [(s, 2 if s < grew else 4, 2) for s in range(1, 13)]
    assert _close(got, static_steps), (got, static_steps)
    joined = join_log.read_text()
    assert "starting joiner g1r" in joined and joined.count("starting joiner") == 2, joined[-3000:]
    resized = [r for r in read_jsonl(str(tmp_path / "metrics.jsonl")) if r["event"] == "resize"]
    assert [(r["step"], r["from"], r["to"], r["pipeline_parallel_to"]) for r in resized] == [(grew, 2, 4, 2)]


@pytest.mark.slow  # the restart is the launcher's (test_elastic_requests.py), the load at another PP test_pp_load's
def test_a_pipeline_job_restarts_from_its_snapshot_at_another_pp_after_a_worker_dies(tmp_path):
    """PP 2 x DP 1; a worker dies without notice (SIGKILL) after step 4 and its snapshot: the
    launcher restarts the job on the one process left, whose script builds PP 1, and the snapshot
    of step 4 is loaded there. Oracle: the job without the death: every later loss bitwise (the
    same DP size, 1, the same micro-batches in the same order, fp32)."""
    static, killed = tmp_path / "static", tmp_path / "killed"
    for out, extra in ((static, []), (killed, ["--kill-at", "4"])):
        out.mkdir()
        job = launch(out, SCRIPT, 2, _config(out), ["--out", str(out), *extra], timeout=300, name="job")
        assert job.returncode == 0, job.output[-4000:]
    want = read_jsonl(str(static / "steps.jsonl"))
    got = read_jsonl(str(killed / "steps.jsonl"))
    assert [(r["step"], r["world"], r["pp"], r["generation"]) for r in got] == [
        (1, 2, 2, 0),
        (2, 2, 2, 0),
        (3, 2, 2, 0),
        (4, 2, 2, 0),
        (5, 1, 1, 1),
        (6, 1, 1, 1),
    ]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    log = (killed / "job.log").read_text()
    assert "worker g0r1 failed (signal SIGKILL); restarting the job on 1 rank from snapshot global_step4" in log
    restore = [r for r in read_jsonl(str(killed / "metrics.jsonl")) if r["event"] == "restore"]
    assert [(r["step"], r["world_size"], r["lost_steps"], r["skipped"], r["pipeline_parallel"]) for r in restore] == [
        (4, 1, 0, [], 1)
    ]


@pytest.mark.slow  # the stop's path is the DP job's (tests/test_launcher_signals.py), reached from train_batch
def test_a_signal_to_the_launcher_stops_a_pipeline_job_with_a_final_snapshot(tmp_path):
    """Held after step 2 until the launcher has been sent SIGTERM: the job stops at step 3 with a
    final snapshot of it (``latest``), intact, and the launcher exits 128 + SIGTERM."""
    from ds_dynatrain.checkpoint.inspect import verify_checkpoint

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_config(tmp_path)))
    flag, log = tmp_path / "go", tmp_path / "job.log"
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--config", str(cfg), SCRIPT]
    cmd += ["--out", str(tmp_path), "--steps", "100", "--hold-at", "2", "--flag", str(flag)]
    with background_job(cmd, str(log)) as job:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"held_{r}").exists() for r in (0, 1)):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        job.send_signal(signal.SIGTERM)  # to the launcher alone
        while "stops at its next step boundary" not in log.read_text():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        flag.write_text("")
        rc = job.wait(timeout=240)
    out = log.read_text()
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert "agent: the job was stopped after step 3 (SIGTERM)" in out, out[-3000:]
    assert (tmp_path / "snaps" / "latest").read_text().strip() == "global_step3"
    rep = verify_checkpoint(str(tmp_path / "snaps"))
    assert rep.ok, rep.problems
    # the stop ends the process inside step 3's train_batch (SystemExit): the script logs steps 1 and 2
    assert [r["step"] for r in read_jsonl(str(tmp_path / "steps.jsonl"))] == [1, 2]


def test_a_pp_request_is_checked_before_it_is_queued():
    """``dynatrain resize --pipeline-parallel`` against a real store: a degree that does not divide
    the world size, a TP and a PP degree at once, a DP size that cannot split the global batch
    (named as the DP size, not the world size) and (the command line) a world size of 0 are
    refused by the requester; nothing is queued."""
    from torch.distributed import TCPStore

    from ds_dynatrain.elastic.keys import JOB_KEY, REQUEST_COUNT
    from ds_dynatrain.elastic.requests import request_resize
    from ds_dynatrain.errors import ResizeRefusedError

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(JOB_KEY, json.dumps({"global_batch": 4, "micro_batch": 1, "max_world_size": None, "world_size": 2}))
    with pytest.raises(ResizeRefusedError, match="PP degree 3 does not divide the world size 2"):
        request_resize("127.0.0.1", store.port, 2, 5, pipeline_parallel=3)
    with pytest.raises(ResizeRefusedError, match="a TP and a PP degree: a request changes one of the two"):
        request_resize("127.0.0.1", store.port, 2, 5, tensor_parallel=1, pipeline_parallel=1)
    with pytest.raises(ResizeRefusedError, match=r"^DP size 3 refused: the global batch"):
        request_resize("127.0.0.1", store.port, 6, 5, pipeline_parallel=2)  # 6 processes at PP 2: DP 3
    cli = [sys.executable, "-m", "ds_dynatrain.cli", "resize", "--store", f"127.0.0.1:{store.port}"]
    zero = subprocess.run([*cli, "--world-size", "0"], capture_output=True, text=True, timeout=60)
    assert zero.returncode == 2 and "argument --world-size: 0: a job needs at least 1" in zero.stderr, zero.stderr
    assert int(store.add(REQUEST_COUNT, 0)) == 0
