"""Soak part 1: resize cycles 4 -> 2 -> 4 in one job (``SOAK_CYCLES``, default 100).

One ``dynatrain launch --nproc 4`` job (TinyLM, ZeRO-2, gloo on the CPU) whose config schedule
shrinks it to 2 after step 4k+2 and grows it back to 4 after step 4k+4, k = 0..CYCLES-1, with
``standby: true`` (the two processes that leave stand by and come back; no process is started
after the launch). The job holds right after step 5 (the first cycle done, one step on the new
world) and after step 4*CYCLES+1 (the last), and the test reads there, for every worker and the
launcher agent, the open file descriptors (``/proc/PID/fd``), OS threads (``/proc/PID/task``) and
resident set (``VmRSS``).

Oracle:

* the job ends with status 0 within the part's timeout (a hang fails it), every step ran once,
  the resizes are exactly the schedule's, every one after the first reuses a cached group;
* flat resources from the first cycle to the last, for each process: file descriptors and
  threads within +2, resident set within +50 MiB;
* every step's loss equals that of a static 2-rank job with the same global batch within 1e-4
  relative (the tolerance of ``tests/test_main_job.py``: only the reduction order differs).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import soaklib

CYCLES = soaklib.count("SOAK_CYCLES", 100)
STEPS = 4 * CYCLES + 2
FIRST_HOLD, LAST_HOLD = 5, 4 * CYCLES + 1
FD_TOLERANCE, THREAD_TOLERANCE, RSS_TOLERANCE = 2, 2, 50 << 20
LOSS_RTOL = 1e-4
pytestmark = pytest.mark.soak

WORKER = os.path.join(soaklib.WORKERS, "soak_resize_worker.py")


def _config(metrics: str, schedule: bool) -> dict:
    from workers.common import base_config

    cfg = base_config(2, metrics)
    cfg["scheduler"]["params"]["total_num_steps"] = STEPS
    cfg["dynatrain"].update(max_world_size=4, log_interval_steps=50, standby=True)
    if schedule:
        cfg["dynatrain"]["resize_schedule"] = [
            {"step": s, "world_size": w} for k in range(CYCLES) for s, w in ((4 * k + 2, 2), (4 * k + 4, 4))
        ]
    return cfg


def _launch(tmp_path, name: str, nproc: int, schedule: bool, holds=()) -> soaklib.Proc:
    out = tmp_path / name
    out.mkdir()
    cfg = out / "config.json"
    cfg.write_text(json.dumps(_config(str(out / "metrics.jsonl"), schedule)))
    cmd = soaklib.dynatrain("launch", "--nproc", str(nproc), "--config", str(cfg), WORKER)
    cmd += ["--out", str(out), "--steps", str(STEPS), "--hold-at", ",".join(map(str, holds))]
    return soaklib.Proc(cmd, str(tmp_path / f"{name}.log"))


def _measure_at(job: soaklib.Proc, out, step: int, members: int, timeout: float) -> dict:
    """Wait until ``members`` processes hold at ``step``; read their resources and the agent's;
    release them."""
    deadline = time.monotonic() + timeout
    while len([f for f in os.listdir(out) if f.startswith(f"held_{step}_")]) < members:
        assert job.poll() is None, f"the job ended before step {step}:\n{job.output()[-4000:]}"
        assert time.monotonic() < deadline, f"step {step} not reached within {timeout:.0f} s (a hang?)"
        time.sleep(0.2)
    time.sleep(0.5)  # every member is in its wait loop: nothing in flight
    res = {"agent": soaklib.resources(job.pid)}
    for f in sorted(os.listdir(out)):
        if f.startswith(f"held_{step}_"):
            res[f[len(f"held_{step}_") :]] = soaklib.resources(int((out / f).read_text()))
    (out / f"release_{step}").write_text("")
    return res


def _losses(path) -> dict:
    return {r["step"]: r for r in soaklib.read_jsonl(str(path)) if r["event"] == "step"}


@pytest.mark.timeout(600 + 12 * CYCLES)
def test_resize_cycles_4_2_4_in_one_job(tmp_path):
    t0 = time.monotonic()
    job = _launch(tmp_path, "cycles", 4, True, (FIRST_HOLD, LAST_HOLD))
    try:
        first = _measure_at(job, tmp_path / "cycles", FIRST_HOLD, 4, 300)
        last = _measure_at(job, tmp_path / "cycles", LAST_HOLD, 4, 60 + 10 * CYCLES)
        rc = job.wait(300)
    finally:
        job.stop()
    job_s = time.monotonic() - t0
    out = job.output()
    assert rc == 0, out[-5000:]
    static = _launch(tmp_path, "static", 2, False)
    try:
        src = static.wait(120 + 2 * STEPS)
    finally:
        static.stop()
    assert src == 0, static.output()[-4000:]
    recs = soaklib.read_jsonl(str(tmp_path / "cycles" / "metrics.jsonl"))
    resizes = [r for r in recs if r["event"] == "resize"]
    steps, ref = _losses(tmp_path / "cycles" / "metrics.jsonl"), _losses(tmp_path / "static" / "metrics.jsonl")
    worst = max(abs(steps[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in ref if s in steps)
    rows, flat = [], True
    for proc in sorted(first):
        a, b = first[proc], last.get(proc)
        if b is None:
            rows.append([proc, a["fds"], "-", a["threads"], "-", a["rss"] >> 20, "-"])
            flat = False
            continue
        rows.append(
            [proc, a["fds"], b["fds"], a["threads"], b["threads"], f"{a['rss'] / 2**20:.0f}", f"{b['rss'] / 2**20:.0f}"]
        )
        flat &= b["fds"] - a["fds"] <= FD_TOLERANCE and b["threads"] - a["threads"] <= THREAD_TOLERANCE
        flat &= b["rss"] - a["rss"] <= RSS_TOLERANCE
    seconds = [r["seconds"] for r in resizes]
    text = "\n".join(
        [
            f"{CYCLES} cycles 4 -> 2 -> 4 in one job ({len(resizes)} resizes, {len(steps)} steps) in {job_s:.0f} s; "
            f"resize time median {sorted(seconds)[len(seconds) // 2]:.2f} s, max {max(seconds):.2f} s",
            f"resources at the first cycle and the last (tolerance: fds +{FD_TOLERANCE}, threads "
            f"+{THREAD_TOLERANCE}, RSS +{RSS_TOLERANCE >> 20} MiB):",
            soaklib.table(["process", "fds first", "last", "threads first", "last", "RSS MiB first", "last"], rows),
            f"largest relative loss difference to a static 2-rank run: {worst:.2e} (tolerance {LOSS_RTOL:g})",
        ]
    )
    soaklib.write_figures(
        "resize_cycles",
        {
            "cycles": CYCLES,
            "resizes": len(resizes),
            "steps": len(steps),
            "job_seconds": job_s,
            "resize_seconds_median": sorted(seconds)[len(seconds) // 2],
            "resize_seconds_max": max(seconds),
            "first": first,
            "last": last,
            "max_rel_loss_diff": worst,
            "hangs": 0,
        },
        text,
    )
    assert [(r["from"], r["to"]) for r in resizes] == [(4, 2), (2, 4)] * CYCLES
    assert [r["step"] for r in resizes] == [s for k in range(CYCLES) for s in (4 * k + 2, 4 * k + 4)]
    assert [r["group_reused"] for r in resizes] == [False] + [True] * (2 * CYCLES - 1)
    assert sorted(steps) == list(range(1, STEPS + 1)) == sorted(ref)
    assert "agent: starting joiner" not in out  # the standby processes came back every time
    assert flat, rows
    assert worst <= LOSS_RTOL, worst
