"""The elastic device manager under requests nobody scheduled, and under a member's death.

    python -m benchmarks.elastic [--json] [--dir DIR]

One run, on this machine: ``examples/train_lm.py`` (the demo's 3.3 M-parameter Llama on the
Python standard library's sources), ZeRO-2, gloo, global batch 12, under ``dynatrain launch
--nproc 2 --store``. Three phases:

* **request, background** (``background_groups: true``): at step 4, ``dynatrain resize
  --world-size 4`` (in-process :func:`~ds_dynatrain.elastic.requests.request_resize`). The job starts the
  two joiners and builds the new world's groups while it trains on 2, and switches at the first
  step boundary where they are ready. ``request_to_step_s``: from the request to the first step
  record on 4 ranks. ``hidden_fraction``: the resize record's share of the new world's
  construction (joiner start-up and group rendezvous, ``background_build_s``) that ran while the
  old world trained, against the part left at the switch (``group_s + xfer_group_s``).
  ``stall_s``: the longest gap between two step records around the resize minus the median gap
  (each record's own ``time``, written as its step ended: the benchmark's polling, paused while it
  waits for the request's answer, does not enter); ``longest_gap_s`` and ``median_gap_s`` beside
  it; ``step_s_preparing`` against ``step_s_before``: what building the new world beside training
  costs each step on a host whose CPUs the workers use (joiners start up there).
* **request, blocking** (the anchor: ``background_groups: false``, the job stops at the step that
  serves the request until the new world is up): the same request, ``anchor_request_to_step_s``
  and ``anchor_stall_s``; ``gap_ratio = anchor_longest_gap_s / longest_gap_s``.
* **SIGKILL** (``snapshot.interval_steps: 4``, ``restore_on_failure``): at step 10 one of the two
  workers is killed. ``kill_to_step_s``: from the kill to the first step record after the
  restore (the agent restarts the job from the latest complete snapshot on the largest world size
  the live workers serve); ``steps_lost``: from the restore record.

Times in seconds. ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


class Job:
    """One ``dynatrain launch`` of the example, with a watcher of its records."""

    def __init__(self, work: str, name: str, dynatrain: dict, steps: int, nproc: int = 2):
        with open(os.path.join(ROOT, "configs", "zero2_elastic.json")) as f:
            cfg = json.load(f)
        self.metrics = os.path.join(work, f"{name}.jsonl")
        cfg["dynatrain"] = {
            "max_world_size": 4,
            "metrics_path": self.metrics,
            "join_timeout_s": 120,
            "collective_timeout_s": 60,
            **dynatrain,
        }
        cfg_path = os.path.join(work, f"{name}.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        self.port = _free_port()
        self.log_path = os.path.join(work, f"{name}.log")
        self.log = open(self.log_path, "w")
        env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), PYTHONPATH=ROOT)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ds_dynatrain.cli",
                "launch",
                "--nproc",
                str(nproc),
                "--slots",
                "4",  # the request grows the job to 4 workers on this host
                "--config",
                cfg_path,
                "--store",
                f"127.0.0.1:{self.port}",
                os.path.join(ROOT, "examples", "train_lm.py"),
                "--steps",
                str(steps),
                "--metrics",
                self.metrics,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=work,
            env=env,
            start_new_session=True,
        )

    def poll(self) -> list:
        return _records(self.metrics)

    def wait_for(self, pred, timeout: float = 300.0, after: int = -1):
        """The first record (index, record) after index ``after`` for which ``pred`` holds."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            recs = self.poll()
            for i, r in enumerate(recs):
                if i > after and pred(r):
                    return i, r
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended early:\n{self._tail()}")
            time.sleep(0.01)
        raise RuntimeError(f"timed out waiting in {self.log_path}:\n{self._tail()}")

    def _tail(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def finish(self) -> None:
        try:
            rc = self.proc.wait(timeout=300)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.log.close()
        if rc != 0:
            raise RuntimeError(f"the job failed ({rc}):\n{self._tail()}")

    def stall(self, resize_step: int, t_request: float) -> dict:
        """Around a resize after ``resize_step`` requested at ``t_request`` (Unix seconds), from
        the step records' own ``time`` stamps (written as each step ended) and ``step_s``:
        ``longest_gap_s`` between two consecutive step records from the step before the resize to
        six after it, ``median_gap_s`` over the whole job, ``stall_s`` = their difference (0 at
        least); ``step_s_before`` (median ``step_s`` before the request) and
        ``step_s_preparing`` (median ``step_s`` of the steps between the request and the switch,
        while the new world was built beside them)."""
        steps = [r for r in self.poll() if r["event"] == "step"]
        gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
        near = [
            b["time"] - a["time"] for a, b in zip(steps, steps[1:]) if resize_step - 1 <= a["step"] <= resize_step + 6
        ]
        before = [r["step_s"] for r in steps if r["time"] < t_request]
        preparing = [r["step_s"] for r in steps if r["time"] >= t_request and r["step"] <= resize_step]
        return {
            "longest_gap_s": max(near),
            "median_gap_s": statistics.median(gaps),
            "stall_s": max(0.0, max(near) - statistics.median(gaps)),
            "step_s_before": statistics.median(before) if before else float("nan"),
            "step_s_preparing": statistics.median(preparing) if preparing else float("nan"),
        }


def _request_phase(work: str, name: str, background: bool) -> dict:
    from ds_dynatrain.elastic.requests import request_resize

    job = Job(work, name, {"background_groups": background}, 40)
    try:
        job.wait_for(lambda r: r["event"] == "step" and r["step"] >= 4)
        t0 = time.time()
        answer = request_resize("127.0.0.1", job.port, 4, 300.0)
        _, first = job.wait_for(lambda r: r["event"] == "step" and r["world_size"] == 4)
        to_step = first["time"] - t0
    finally:
        job.finish()
    rec = answer["record"]
    return {"request_to_step_s": to_step, **job.stall(rec["step"], t0), "record": rec}


def _kill_phase(work: str) -> dict:
    snaps = os.path.join(work, "snapshots")
    job = Job(work, "kill", {"snapshot": {"interval_steps": 4, "dir": snaps, "keep_last": 3}}, 24)
    try:
        job.wait_for(lambda r: r["event"] == "step" and r["step"] >= 10)
        pids = subprocess.run(["pgrep", "-P", str(job.proc.pid)], capture_output=True, text=True).stdout.split()
        t0 = time.time()
        os.kill(int(pids[-1]), signal.SIGKILL)
        ri, restore = job.wait_for(lambda r: r["event"] == "restore")
        _, first = job.wait_for(lambda r: r["event"] == "step", after=ri)
        kill_to_step = first["time"] - t0
    finally:
        job.finish()
    return {
        "kill_to_step_s": kill_to_step,
        "steps_lost": restore["lost_steps"],
        "restored_world_size": restore["world_size"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--dir", default=None, help="where the temporary run directory goes")
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="dynatrain-elastic-", dir=a.dir)
    try:
        ours = _request_phase(work, "background", True)
        anchor = _request_phase(work, "blocking", False)
        kill = _kill_phase(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rec = ours["record"]
    out = {
        "hidden_fraction": rec["hidden_fraction"],
        "background_build_s": rec["background_build_s"],
        "exposed_group_s": rec["group_s"] + rec.get("xfer_group_s", 0.0),
        "resize_s": rec["seconds"],
        "request_to_step_s": ours["request_to_step_s"],
        "stall_s": ours["stall_s"],
        "longest_gap_s": ours["longest_gap_s"],
        "median_gap_s": ours["median_gap_s"],
        "step_s_before": ours["step_s_before"],
        "step_s_preparing": ours["step_s_preparing"],
        "anchor_request_to_step_s": anchor["request_to_step_s"],
        "anchor_stall_s": anchor["stall_s"],
        "anchor_longest_gap_s": anchor["longest_gap_s"],
        "anchor_group_s": anchor["record"]["group_s"],
        "gap_ratio": anchor["longest_gap_s"] / ours["longest_gap_s"],
        **kill,
    }
    if a.json:
        print(json.dumps(out))
        return 0
    print(
        f"request 2 -> 4, background: {out['request_to_step_s']:.2f} s to the first step on 4 ranks; "
        f"stall {out['stall_s']:.2f} s (longest gap between steps {out['longest_gap_s']:.2f} s, median "
        f"{out['median_gap_s']:.2f} s); {100 * out['hidden_fraction']:.1f} % of the new world's construction "
        f"({out['background_build_s']:.2f} s) hidden behind training, {out['exposed_group_s']:.3f} s left "
        f"at the switch; a step took {out['step_s_preparing']:.2f} s while it was built beside training, "
        f"{out['step_s_before']:.2f} s before"
    )
    print(
        f"request 2 -> 4, blocking (anchor): {out['anchor_request_to_step_s']:.2f} s to the first step; "
        f"stall {out['anchor_stall_s']:.2f} s (longest gap {out['anchor_longest_gap_s']:.2f} s, group "
        f"{out['anchor_group_s']:.2f} s); longest gap {out['gap_ratio']:.1f}x ours"
    )
    print(
        f"SIGKILL of one of 2: {out['kill_to_step_s']:.2f} s to the first step on {out['restored_world_size']} "
        f"ranks after the restore; {out['steps_lost']} step(s) lost"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
