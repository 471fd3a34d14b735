"""A pipeline job under ``dynatrain launch``: it trains on its script's group, refuses resize
requests with the reason, and survives a worker that dies without notice by the launcher's restart
on the processes left, from its last snapshot, at another PP degree.

Oracle: the same job without the death (PP 2 over 2 processes throughout). Its steps after the
snapshot the restarted job loads are repeated bitwise at PP 1 on one process: fp32, the same
micro-batches in the same order, the same DP size (1).
"""

from __future__ import annotations

import json
import os
import signal
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


def test_a_pipeline_job_restarts_from_its_snapshot_at_another_pp_after_a_worker_dies(tmp_path):
    static, killed = tmp_path / "static", tmp_path / "killed"
    for out, extra in ((static, ["--request"]), (killed, ["--kill-at", "3"])):
        out.mkdir()
        job = launch(out, SCRIPT, 2, _config(out), ["--out", str(out), *extra], timeout=300, name="job")
        assert job.returncode == 0, job.output[-4000:]
    want = read_jsonl(str(static / "steps.jsonl"))
    assert [(r["step"], r["world"], r["pp"]) for r in want] == [(s, 2, 2) for s in range(1, 7)]
    got = read_jsonl(str(killed / "steps.jsonl"))
    assert [(r["step"], r["world"], r["pp"], r["generation"]) for r in got] == [
        (1, 2, 2, 0),
        (2, 2, 2, 0),
        (3, 2, 2, 0),
        (4, 1, 1, 1),
        (5, 1, 1, 1),
        (6, 1, 1, 1),
    ]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bitwise, before and after the restart
    log = (killed / "job.log").read_text()
    assert "worker g0r1 failed (signal SIGKILL); restarting the job on 1 rank from snapshot global_step3" in log
    restore = [r for r in read_jsonl(str(killed / "metrics.jsonl")) if r["event"] == "restore"]
    assert [(r["step"], r["world_size"], r["lost_steps"], r["skipped"]) for r in restore] == [(3, 1, 0, [])]
    request = json.loads((static / "request.json").read_text())
    assert request["returncode"] != 0, request
    assert "a PipelineModule job does not serve resize requests yet" in request["output"], request


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
