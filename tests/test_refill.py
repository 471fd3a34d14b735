"""The refill policy (``dynatrain launch --max-refills N``): after a worker is killed without notice,
the job restarts from its latest snapshot on the workers still alive, then the agent asks it to
grow back to its slots, and the joiner starts in the freed slot.

Real job under ``dynatrain launch`` (TinyLM, ZeRO-2, gloo), a real SIGKILL of a worker (the fault,
injected at a seam: the process), and the refill budget read back from a real ``TCPStore``.
Oracles: the restore and resize records and the per-step world sizes in the metrics; the request
queue in the store.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as tdist
from conftest import ROOT, WORKERS, free_port, read_jsonl
from test_elastic_requests import _finish, _wait_for_step

from ds_dynatrain.elastic.keys import ANSWER_KEY, NODE_COUNT, NODE_KEY, REQUEST_COUNT, REQUEST_KEY
from ds_dynatrain.elastic.refill import Refill

SCRIPT = os.path.join(WORKERS, "elastic_worker.py")


def test_refill_asks_for_the_slots_at_most_n_times():
    """The budget: a grow to the largest size the live hosts' slots serve, only when larger than the
    restarted size, at most ``max_refills`` times."""
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    store.add(NODE_COUNT, 2)
    store.set(NODE_KEY.format(0), json.dumps({"slots": 3}))
    store.set(NODE_KEY.format(1), json.dumps({"slots": 2}))
    refill = Refill(store, 2, largest=lambda n: min(n, 4))  # the batch serves at most 4 ranks
    assert refill.after_restart(4) is None  # nothing to grow back to: no refill spent
    assert refill.after_restart(2) == 0 and refill.after_restart(3) == 1
    assert refill.after_restart(1) is None  # the budget is spent
    assert int(store.add(REQUEST_COUNT, 0)) == 2
    assert [json.loads(store.get(REQUEST_KEY.format(i))) for i in range(2)] == [
        {"world_size": 4, "refill": True},
        {"world_size": 4, "refill": True},
    ]
    store.set(ANSWER_KEY.format(1), json.dumps({"ok": True, "message": "resized 3 -> 4"}))
    refill.poll()
    assert refill.request is None


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_sigkill_restore_then_refill_back_to_the_slots(tmp_path):
    """`dynatrain launch --nproc 2 --max-refills 1`: worker g0r1 is killed after the step-4 snapshot;
    the job restarts on 1 rank from it, the agent asks for a grow back to the host's 2 slots, and
    the job serves it: a resize 1 -> 2 (request 0) after the restore, and the last steps on 2 ranks
    again, the agent exiting 0."""
    from workers.common import base_config

    port = free_port()
    cfg = base_config(2, str(tmp_path / "rf.jsonl"))
    snaps = tmp_path / "snaps"
    cfg["dynatrain"]["snapshot"] = {"interval_steps": 2, "dir": str(snaps), "keep_last": 10}
    cfg_path = tmp_path / "rf.json"
    cfg_path.write_text(json.dumps(cfg))
    # held after step 5 until the kill (it lands after the step-4 snapshot), and past step 12 until
    # the grow back is seen (the restarted job never runs out of steps before it)
    hold, until = tmp_path / "rf.hold", tmp_path / "rf.until"
    hold.write_text("")
    until.write_text("")
    log = open(tmp_path / "rf.log", "w")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--max-refills", "1"]
    cmd += ["--config", str(cfg_path), "--store", f"127.0.0.1:{port}", SCRIPT, "--out", str(tmp_path)]
    cmd += ["--steps", "12", "--step-sleep", "0.2", "--hold", f"5:{hold}", "--until", str(until)]
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    try:
        _wait_for_step(tmp_path / "rf.jsonl", 5, job)
        deadline = time.monotonic() + 120
        while not ((snaps / "latest").exists() and (snaps / "latest").read_text().strip() == "global_step4"):
            assert time.monotonic() < deadline and job.poll() is None, "the step-4 snapshot was not committed"
            time.sleep(0.1)
        os.kill(int((tmp_path / "pid_g0r1").read_text()), signal.SIGKILL)
        hold.unlink()
        deadline = time.monotonic() + 240
        while not [r for r in read_jsonl(tmp_path / "rf.jsonl") if r["event"] == "resize"]:
            assert time.monotonic() < deadline and job.poll() is None, "the job did not grow back"
            time.sleep(0.2)
        grown = [r for r in read_jsonl(tmp_path / "rf.jsonl") if r["event"] == "resize"][0]["step"]
        _wait_for_step(tmp_path / "rf.jsonl", max(12, grown + 2), job, timeout=120)
        until.unlink()
    finally:
        hold.unlink(missing_ok=True)
        until.unlink(missing_ok=True)
        rc = _finish(job, log, timeout=200)
    out = (tmp_path / "rf.log").read_text()
    assert rc == 0, out[-4000:]
    assert "agent: worker g0r1 failed (signal SIGKILL); restarting the job on 1 rank from snapshot" in out
    assert "agent: refill: asking the job to grow back from 1 to 2 ranks once it runs again (request 0" in out
    assert "agent: refill request 0: resized 1 -> 2" in out
    # a new process in the freed slot, rank 1 of the grown generation
    assert re.search(r"agent: starting joiner g\d+r1 \(rank 1 of generation \d+, world size 2\)", out), out[-4000:]
    recs = read_jsonl(tmp_path / "rf.jsonl")
    restores = [r for r in recs if r["event"] == "restore"]
    assert len(restores) == 1 and restores[0]["step"] == 4
    after = recs[recs.index(restores[0]) :]
    resizes = [r for r in after if r["event"] == "resize"]
    assert [(r["from"], r["to"], r.get("request")) for r in resizes] == [(1, 2, 0)]
    steps = [r for r in after if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(5, steps[-1]["step"] + 1)) and steps[-1]["step"] >= 12
    sizes = [(r["step"], r["world_size"]) for r in steps]
    assert all(w == (1 if s <= resizes[0]["step"] else 2) for s, w in sizes), sizes
