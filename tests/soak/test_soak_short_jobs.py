"""Soak part 4: short resizing jobs one after another (``SOAK_JOBS``, default 50).

Each job is ``dynatrain launch --nproc 2`` of TinyLM at ZeRO-2 whose config schedule grows it to 3
after step 2 and shrinks it back to 2 after step 4, 6 steps, a snapshot every 2 steps (so the
snapshot thread is alive at exit too). Oracle: every job exits with status 0 within its limit,
ran steps 1-6 once with the two resizes of its schedule, and left ``latest`` naming the step-6
snapshot (the last one is finished before the processes exit); nothing in its output says it
aborted ("terminate called", a status of 134 or -6: SIGABRT), and its stderr holds no Python
traceback. Figures: the counts of each and the time per job.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time

import pytest
import soaklib

from io_engine import read_latest
from io_engine.errors import IOEngineError

JOBS = soaklib.count("SOAK_JOBS", 50)
JOB_TIMEOUT_S = 240
pytestmark = pytest.mark.soak

WORKER = os.path.join(soaklib.WORKERS, "soak_resize_worker.py")


def _config(d) -> dict:
    from workers.common import base_config

    cfg = base_config(2, str(d / "metrics.jsonl"))
    cfg["dynatrain"].update(
        max_world_size=3,
        resize_schedule=[{"step": 2, "world_size": 3}, {"step": 4, "world_size": 2}],
        spawn_lookahead_steps=1,
        snapshot={"interval_steps": 2, "dir": str(d / "snapshots"), "keep_last": 2},
    )
    return cfg


def _one(tmp_path, n: int) -> dict:
    d = tmp_path / f"job{n}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_config(d)))
    cmd = soaklib.dynatrain("launch", "--nproc", "2", "--slots", "3", "--config", str(d / "config.json"), WORKER)
    t0 = time.monotonic()
    job = soaklib.Proc(cmd + ["--out", str(d), "--steps", "6"], str(d / "stdout.log"), str(d / "stderr.log"))
    try:
        rc = job.wait(JOB_TIMEOUT_S)
    finally:
        job.stop()
    out, err = job.output(), job.errors()
    recs = soaklib.read_jsonl(str(d / "metrics.jsonl"))
    steps = [r["step"] for r in recs if r["event"] == "step"]
    resizes = [(r["from"], r["to"]) for r in recs if r["event"] == "resize"]
    try:
        latest = read_latest(str(d / "snapshots"))
    except IOEngineError as err:
        latest = f"unreadable: {err}"
    return {
        "job": n,
        "rc": rc,
        "seconds": time.monotonic() - t0,
        "hang": rc is None,
        "terminate": "terminate called" in out + err,
        "sigabrt": rc in (134, -signal.SIGABRT),
        "traceback": "Traceback (most recent call last)" in err,
        "steps_ok": steps == [1, 2, 3, 4, 5, 6] and resizes == [(2, 3), (3, 2)],
        "last_snapshot": latest == "global_step6",
        "stderr_tail": err[-1500:] if rc != 0 or "Traceback" in err or "terminate called" in out + err else "",
    }


@pytest.mark.timeout(300 + JOB_TIMEOUT_S * JOBS)
def test_short_resizing_jobs_exit_cleanly(tmp_path):
    t0 = time.monotonic()
    results = [_one(tmp_path, n) for n in range(JOBS)]
    bad = [
        r
        for r in results
        if r["rc"] != 0 or r["terminate"] or r["traceback"] or not r["steps_ok"] or not r["last_snapshot"]
    ]
    counts = {
        "jobs": JOBS,
        "nonzero_exits": sum(r["rc"] != 0 for r in results),
        "hangs": sum(r["hang"] for r in results),
        "terminate_called": sum(r["terminate"] for r in results),
        "sigabrt": sum(r["sigabrt"] for r in results),
        "tracebacks_in_stderr": sum(r["traceback"] for r in results),
        "wrong_steps_or_resizes": sum(not r["steps_ok"] for r in results),
        "last_snapshot_missing": sum(not r["last_snapshot"] for r in results),
    }
    per_job = [r["seconds"] for r in results]
    text = "\n".join(
        [
            f"{JOBS} jobs 2 -> 3 -> 2 (6 steps, snapshots every 2) in {time.monotonic() - t0:.0f} s, "
            f"{statistics.median(per_job):.1f} s per job (median), {max(per_job):.1f} s the slowest",
            soaklib.table(["what", "jobs"], [[k, v] for k, v in counts.items() if k != "jobs"]),
        ]
        + [f"job {r['job']}: status {r['rc']}\n{r['stderr_tail']}" for r in bad[:5]]
    )
    soaklib.write_figures(
        "short_jobs", dict(counts, seconds_per_job_median=statistics.median(per_job), failed=bad), text
    )
    assert not bad, [(r["job"], r["rc"], r["stderr_tail"][-600:]) for r in bad]
