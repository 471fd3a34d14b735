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

import pytest
from conftest import WORKERS, launch, read_jsonl

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
