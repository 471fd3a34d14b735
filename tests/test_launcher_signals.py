"""SIGTERM and SIGINT to ``dynatrain launch`` (a scheduler ending the job, Ctrl-C): the job takes a
final snapshot at its next step boundary and every process exits cleanly; a second signal ends it
at once.

Real 2-worker jobs (TinyLM, ZeRO-2, gloo) with snapshots every 4 steps. The job is held after step
5 (every worker waits for a flag file) until the test has signalled the launcher and the launcher
has said so: the stop is seen at the boundary of step 6, between two periodic snapshots, whatever
the machine's speed. Oracles: the launcher's exit status (128 + the signal); the metrics file's
last step; ``latest``; the state the job stopped with (gathered by every rank through DeepSpeed's
accessors when ``engine.step()`` ended it) against the state a fresh 2-rank job loads from that
snapshot, bitwise; stderr without a traceback; every worker gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, WORKERS, assert_no_gloo_thread, read_jsonl

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(WORKERS, "lifecycle_worker.py")
HOLD, INTERVAL = 5, 4  # held after step 5: the stop comes at step 6, between the snapshots of 4 and 8


def _config(tmp_path, name: str) -> dict:
    from workers.common import base_config

    cfg = base_config(2, str(tmp_path / f"{name}.jsonl"))
    cfg["dynatrain"]["snapshot"] = {"interval_steps": INTERVAL, "dir": str(tmp_path / "snapshots")}
    return cfg


def _launch(tmp_path, name: str, cfg: dict, args) -> tuple:
    """Start ``dynatrain launch`` in a process group of its own, stdout and stderr in separate files."""
    cfg_path = tmp_path / f"{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--config", str(cfg_path), SCRIPT]
    job = subprocess.Popen(
        [*cmd, "--out", str(tmp_path), *args], stdout=out, stderr=err, cwd=ROOT, env=env, start_new_session=True
    )
    return job, (out, err)


def _finish(job, logs, timeout: float = 240) -> int:
    """Wait for the launcher; then kill its whole process group (no stray worker, pass or fail)."""
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not end within {timeout:.0f} s")
    finally:
        _kill(job, logs)


def _kill(job, logs) -> None:
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait()
    for f in logs:
        f.close()


def _stopping(tmp_path) -> bool:
    return "stops at its next step boundary" in (tmp_path / "job.out").read_text()


def _wait_for(what, cond, job, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.1)


def _held(tmp_path) -> bool:
    return all((tmp_path / f"held_{m}").exists() for m in ("g0r0", "g0r1"))


def _pids_gone(tmp_path) -> bool:
    for m in ("g0r0", "g0r1"):
        try:
            os.kill(int((tmp_path / f"pid_{m}").read_text()), 0)
            return False
        except ProcessLookupError:
            continue
    return True


@pytest.mark.timeout(600)
# SIGINT takes the same path as SIGTERM (one handler for both): make test runs SIGTERM only
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)], ids=["SIGTERM", "SIGINT"]
)
def test_a_signal_to_the_launcher_ends_the_job_with_a_final_snapshot(tmp_path, sig):
    flag = tmp_path / "go"
    job, logs = _launch(tmp_path, "job", _config(tmp_path, "job"), ["--hold-at", str(HOLD), "--flag", str(flag)])
    try:
        _wait_for("the hold at step 5", lambda: _held(tmp_path), job)
        job.send_signal(sig)  # to the launcher only, not to its process group
        _wait_for("the launcher's stop", lambda: _stopping(tmp_path), job)
        flag.write_text("")  # only now may the job go on
        rc = job.wait(timeout=240)
        leftover = not _pids_gone(tmp_path)  # before the process group is killed below
    finally:
        _kill(job, logs)
    out, err = (tmp_path / "job.out").read_text(), (tmp_path / "job.err").read_text()
    assert rc == 128 + sig, out[-3000:] + err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    assert not leftover, "a worker outlived the launcher"
    for m in ("g0r0", "g0r1"):  # after the library's exit hooks (a hook of the worker's, run after them)
        assert_no_gloo_thread(tmp_path / f"threads_{m}")
    steps = [r["step"] for r in read_jsonl(tmp_path / "job.jsonl") if r["event"] == "step"]
    assert steps == list(range(1, HOLD + 2))  # it trained the held step's successor, and no further
    snaps = tmp_path / "snapshots"
    assert (snaps / "latest").read_text() == f"global_step{HOLD + 1}"
    assert f"job stopped after step {HOLD + 1}" in out and f"final snapshot {snaps / f'global_step{HOLD + 1}'}" in out
    stopped = torch.load(tmp_path / "stopped.pt")
    assert stopped["__global_steps__"] == HOLD + 1

    back = tmp_path / "back"
    back.mkdir()
    job, logs = _launch(back, "load", _config(back, "load"), ["--load", f"{snaps}:global_step{HOLD + 1}"])
    rc = _finish(job, logs)
    assert rc == 0, (back / "load.err").read_text()[-3000:]
    loaded = torch.load(back / "loaded.pt")
    assert loaded["__global_steps__"] == HOLD + 1 and loaded["__step__"] == stopped["__step__"]
    for name in (k for k in stopped if not k.startswith("__")):
        for kind in ("fp32", "exp_avg", "exp_avg_sq", "param"):
            assert torch.equal(stopped[name][kind], loaded[name][kind]), (name, kind)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_signal_kills_the_job_at_once(tmp_path):
    """The job is held (it never reaches the boundary that would stop it): the second SIGTERM ends
    the launcher with 143 and no worker is left."""
    flag = tmp_path / "go"  # never written
    job, logs = _launch(tmp_path, "job", _config(tmp_path, "job"), ["--hold-at", "2", "--flag", str(flag)])
    try:
        _wait_for("the hold at step 2", lambda: _held(tmp_path), job)
        job.send_signal(signal.SIGTERM)
        _wait_for("the launcher's stop", lambda: _stopping(tmp_path), job)
        t0 = time.monotonic()
        job.send_signal(signal.SIGTERM)
        rc = job.wait(timeout=60)
        took = time.monotonic() - t0
        leftover = not _pids_gone(tmp_path)  # before the process group is killed below
    finally:
        _kill(job, logs)
    assert rc == 128 + signal.SIGTERM and took < 30, (rc, took)
    assert "killing the workers now" in (tmp_path / "job.out").read_text()
    assert not leftover, "a worker outlived the launcher"
    assert not (tmp_path / "snapshots" / "latest").exists()  # nothing was committed: killed before step 4
