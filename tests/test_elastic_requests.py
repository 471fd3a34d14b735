"""Membership changes nobody scheduled: ``dynatrain resize --store`` requests from outside the job,
and SIGTERM as a preemption notice.

Real jobs under ``dynatrain launch --store`` (a known port), TinyLM, ZeRO-2. Oracles: the
requester's exit status and message; the resize records and per-step world sizes in the metrics;
the final state of the resized job equals, within reduction noise, a job run at a static world
size with the same global batch; the launcher's exit status.
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
from conftest import ROOT, WORKERS, free_port, launch, read_jsonl, resize_command

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(WORKERS, "elastic_worker.py")


def _config(metrics: str) -> dict:
    from workers.common import base_config

    return base_config(2, metrics)


def _steps(path):
    try:
        return [r for r in read_jsonl(path) if r["event"] == "step"]
    except (OSError, ValueError):
        return []


def _wait_for_step(path, step: int, job: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in _steps(path)):
            return
        assert job.poll() is None, "the job ended early"
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached within {timeout} s")


def _start(tmp_path, nproc: int, steps: int, name: str, worker_args=()):
    port = free_port()
    cfg_path = tmp_path / f"{name}.json"
    cfg_path.write_text(json.dumps(_config(str(tmp_path / f"{name}.jsonl"))))
    log = open(tmp_path / f"{name}.log", "w")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ds_dynatrain.cli",
            "launch",
            "--nproc",
            str(nproc),
            "--allow-oversubscribe",  # CPU workers: grown past --nproc on purpose
            "--config",
            str(cfg_path),
            "--store",
            f"127.0.0.1:{port}",
            SCRIPT,
            "--out",
            str(tmp_path),
            "--steps",
            str(steps),
            "--step-sleep",
            "0.2",
            *worker_args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    return job, port, log


def _request(port: int, world_size: int):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    return subprocess.run(
        resize_command(f"127.0.0.1:{port}", world_size, 120),
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env=env,
    )


def _finish(job, log, timeout=180):
    try:
        rc = job.wait(timeout=timeout)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    return rc


def _static_final(tmp_path, nproc, steps):
    d = tmp_path / "static"
    d.mkdir()
    job = launch(
        d,
        SCRIPT,
        nproc,
        _config(str(d / "static.jsonl")),
        ["--out", str(d), "--steps", str(steps)],
        timeout=180,
        name="static",
    )
    assert job.returncode == 0, job.output[-3000:]
    return torch.load(d / "final.pt"), {r["step"]: r for r in _steps(d / "static.jsonl")}


def _close(a, b, what):
    for name in (k for k in a if not k.startswith("__")):
        torch.testing.assert_close(a[name]["fp32"], b[name]["fp32"], rtol=1e-4, atol=1e-5, msg=f"{what}: {name}")


def _request_async(port: int, world_size: int) -> subprocess.Popen:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    return subprocess.Popen(
        resize_command(f"127.0.0.1:{port}", world_size, 150),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_resize_requests_from_outside_the_job(tmp_path):
    # the job's end is held (--until) until every request below is answered: however slowly a busy
    # machine starts the requesters and joiners, they never meet a job that has finished its steps
    until = tmp_path / "req.until"
    until.write_text("")
    job, port, log = _start(tmp_path, 2, 24, "req", ["--until", str(until)])
    try:
        _wait_for_step(tmp_path / "req.jsonl", 2, job)
        grow = _request(port, 3)
        assert grow.returncode == 0, grow.stderr
        assert "resized 2 -> 3" in grow.stdout
        bad = _request(port, 5)  # 12 samples do not split over 5 ranks: refused before it is queued
        assert bad.returncode == 2 and "refused" in bad.stderr and "not divisible" in bad.stderr, bad.stderr
        too_big = _request(port, 7)  # above max_world_size=6
        assert too_big.returncode == 2 and "max_world_size=6" in too_big.stderr, too_big.stderr
        # two requests at once (a join while another resize is pending): both served, in order
        pending = [_request_async(port, 4), _request_async(port, 2)]
        answers = [p.communicate(timeout=200) for p in pending]
        assert [p.returncode for p in pending] == [0, 0], answers
    finally:
        until.unlink(missing_ok=True)  # the job may end now, at a step boundary its members agree on
        rc = _finish(job, log)
    assert rc == 0, (tmp_path / "req.log").read_text()[-4000:]
    steps = _steps(tmp_path / "req.jsonl")
    last = steps[-1]["step"]
    assert last >= 24 and [r["step"] for r in steps] == list(range(1, last + 1))
    records = [r for r in read_jsonl(tmp_path / "req.jsonl") if r["event"] == "resize"]
    resizes = [(r["from"], r["to"]) for r in records]
    assert len(resizes) == 3 and resizes[0] == (2, 3), resizes
    # each was prepared behind training, the new partitions of the ranks that stay touched ahead
    # (warm_switch_steps): a share of the same optimizer state at each world size, padding apart
    held = {r["to"]: r["prepared_bytes"] for r in records}
    assert held[3] > 0 and all(held[w] * w == pytest.approx(held[3] * 3, rel=0.01) for w in held), held
    assert resizes[1][0] == 3 and resizes[1][1] == resizes[2][0] and {resizes[1][1], resizes[2][1]} == {2, 4}
    assert steps[-1]["world_size"] == resizes[2][1] and steps[0]["world_size"] == 2
    for out, _err in answers:
        assert "resized" in out
    final, _ = _static_final(tmp_path, 2, last)
    _close(torch.load(tmp_path / "final.pt"), final, "requested resizes vs static")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_on_two_members_at_once_shrinks_the_job(tmp_path):
    # the job is held right after step 3 (--hold) until both notices are sent: they arrive at the
    # same step boundary whatever the machine's speed, and never after the job's last step
    hold = tmp_path / "pre.hold"
    hold.write_text("")
    job, _port, log = _start(tmp_path, 4, 12, "pre", ["--hold", f"3:{hold}"])
    try:
        _wait_for_step(tmp_path / "pre.jsonl", 3, job)
        pids = {m: int((tmp_path / f"pid_{m}").read_text()) for m in ("g0r1", "g0r3")}
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
    finally:
        hold.unlink(missing_ok=True)
        rc = _finish(job, log)
    out = (tmp_path / "pre.log").read_text()
    assert rc == 0, out[-4000:]
    assert "member g0r1: preemption notice" in out and "member g0r3: preemption notice" in out
    assert "member g0r1 left the job" in out and "member g0r3 left the job" in out
    steps = _steps(tmp_path / "pre.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 13))
    sizes = [r["world_size"] for r in steps]
    assert sizes == [4] * 4 + [2] * 8, sizes  # both notices seen at the boundary after step 4
    resizes = [(r["from"], r["to"]) for r in read_jsonl(tmp_path / "pre.jsonl") if r["event"] == "resize"]
    assert resizes == [(4, 2)]
    final, _ = _static_final(tmp_path, 2, 12)
    _close(torch.load(tmp_path / "final.pt"), final, "preempted job vs static")


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_sigkill_restores_from_the_latest_snapshot_on_fewer_ranks(tmp_path):
    """A member killed without notice: the launcher restarts the job on the live members' number
    (3 -> 2) from the latest complete snapshot; the steps since it are lost and counted. Oracle: a
    static 2-rank job that loads the same snapshot trains to the same losses and state (the first
    steps bitwise; later ones within 1e-6, the restored job also taking snapshots)."""
    port = free_port()
    cfg = _config(str(tmp_path / "kill.jsonl"))
    snaps = tmp_path / "snaps"
    cfg["dynatrain"]["snapshot"] = {"interval_steps": 2, "dir": str(snaps), "keep_last": 10}
    cfg_path = tmp_path / "kill.json"
    cfg_path.write_text(json.dumps(cfg))
    # the job is held right after step 5 (--hold) until the kill: the kill lands before the job's
    # end, after the step-4 snapshot is committed, whatever the machine's speed
    hold = tmp_path / "kill.hold"
    hold.write_text("")
    log = open(tmp_path / "kill.log", "w")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ds_dynatrain.cli",
            "launch",
            "--nproc",
            "3",
            "--config",
            str(cfg_path),
            "--store",
            f"127.0.0.1:{port}",
            SCRIPT,
            "--out",
            str(tmp_path),
            "--steps",
            "12",
            "--step-sleep",
            "0.2",
            "--hold",
            f"5:{hold}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        _wait_for_step(tmp_path / "kill.jsonl", 5, job)
        deadline = time.monotonic() + 120
        while not ((snaps / "latest").exists() and (snaps / "latest").read_text().strip() == "global_step4"):
            assert time.monotonic() < deadline and job.poll() is None, "the step-4 snapshot was not committed"
            time.sleep(0.1)
        os.kill(int((tmp_path / "pid_g0r2").read_text()), signal.SIGKILL)
        hold.unlink()  # before the restarted job reaches step 5 again (it starts new processes first)
    finally:
        hold.unlink(missing_ok=True)
        rc = _finish(job, log, timeout=300)
    out = (tmp_path / "kill.log").read_text()
    assert rc == 0, out[-4000:]
    assert "agent: worker g0r2 failed (signal SIGKILL); restarting the job on 2 ranks from snapshot" in out
    recs = read_jsonl(tmp_path / "kill.jsonl")
    restores = [r for r in recs if r["event"] == "restore"]
    assert len(restores) == 1
    restored, lost = restores[0]["step"], restores[0]["lost_steps"]
    assert restored == 4 and lost == restores[0]["last_step"] - restored and lost >= 0
    assert f"{lost} {'step' if lost == 1 else 'steps'} since that snapshot {'was' if lost == 1 else 'were'} lost" in out
    after = [r for r in recs[recs.index(restores[0]) :] if r["event"] == "step"]
    assert [r["step"] for r in after] == list(range(restored + 1, 13)) and {r["world_size"] for r in after} == {2}
    # the oracle: the same snapshot loaded by a static 2-rank job
    d = tmp_path / "oracle"
    d.mkdir()
    oracle = launch(
        d,
        SCRIPT,
        2,
        _config(str(d / "oracle.jsonl")),
        ["--out", str(d), "--steps", "12", "--load", f"{snaps}:global_step{restored}"],
        timeout=200,
        name="oracle",
    )
    assert oracle.returncode == 0, oracle.output[-3000:]
    ref = {r["step"]: r for r in _steps(d / "oracle.jsonl")}
    assert after[0]["loss"] == ref[after[0]["step"]]["loss"]
    for r in after:
        assert abs(r["loss"] - ref[r["step"]]["loss"]) <= 1e-6 * abs(ref[r["step"]]["loss"]), (r, ref[r["step"]])
    _close(torch.load(tmp_path / "final.pt"), torch.load(d / "final.pt"), "restored job vs oracle")
