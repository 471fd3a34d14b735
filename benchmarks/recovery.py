"""In-place recovery against the restart from a snapshot, and what the peer replicas cost.

    python -m benchmarks.recovery [--json] [--dir DIR] [--seed N]

One run, on this machine: ``examples/train_lm.py`` (the demo's 3.3 M-parameter Llama), ZeRO-2,
gloo, global batch 12, 4 workers under ``dynatrain launch``. Four jobs:

* **planned shrink** (replicas off): ``resize_schedule`` 4 -> 3 after step 10; its resize record's
  ``seconds`` is the planned shrink's downtime.
* **replicas, interval 1**: after step 10 a random member (ranks 1-3) is SIGKILLed at a random
  moment of the next step (a delay drawn in ``[0, step_s)``). ``kill_to_step_s``: from the kill to
  the first step record on the survivors; ``steps_lost``, ``detect_s`` and the phases from the
  recovery record. ``kill_to_step_s`` = ``detection_s`` (the rest of the interrupted step, up to
  the survivors' failed collective) + the recovery + the first step on the new world.
* **throughput**: jobs of 16 steps with replicas off, every step and every 10 steps, run in turn
  ``--rounds`` times (the machine's speed drifts between jobs); ``step_s_*`` are the medians over
  the rounds of each job's median ``step_s`` (steps 3-16).
* **restart** (the anchor: replicas off, ``snapshot.interval_steps`` 4, ``restore_on_failure``):
  the same kill; ``anchor_kill_to_step_s`` to the first step after the restore,
  ``anchor_steps_lost`` from the restore record.

Ratios: ``speedup = anchor_kill_to_step_s / kill_to_step_s`` (goal >= 10); ``vs_shrink =
(kill_to_step_s - first_step_s) / (2 * planned_shrink_s + detection_s)`` (the goal "kill -> next
step <= 2x a planned shrink's downtime plus the detection time", both sides without the step
trained on the new world; <= 1 meets it); the throughput costs ``overhead_on1 = step_s_on1 /
step_s_off - 1`` and ``overhead_on10`` (goal <= 5 %). Times in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time

from benchmarks.elastic import Job

KILL_AFTER = 10


def _median_step(job: Job, until_step: int) -> float:
    """Median ``step_s`` of steps 3 .. ``until_step`` on 4 ranks (the first two warm up)."""
    steps = job.poll()
    return statistics.median(
        r["step_s"] for r in steps if r["event"] == "step" and 2 < r["step"] <= until_step and r["world_size"] == 4
    )


def _pids(work: str, name: str) -> list:
    """The worker pids of job ``name`` (the agent's children, read from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(c.endswith(b"train_lm.py") for c in cmd) and f"DYNATRAIN_BENCH={name}".encode() in env:
            member = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"DYNATRAIN_MEMBER=")), "")
            out.append((member, int(d)))
    return sorted(out)


def _kill_job(work: str, name: str, dynatrain: dict, rng: random.Random, event: str) -> dict:
    os.environ["DYNATRAIN_BENCH"] = name
    job = Job(work, name, dynatrain, KILL_AFTER + 12, nproc=4)
    try:
        _, rec = job.wait_for(lambda r: r["event"] == "step" and r["step"] >= KILL_AFTER)
        step_s = _median_step(job, KILL_AFTER)
        members = [m for m in _pids(work, name) if m[0] != "g0r0"]
        victim, pid = rng.choice(members)
        delay = rng.uniform(0.0, step_s)
        time.sleep(delay)
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        i, what = job.wait_for(lambda r: r["event"] == event, timeout=600)
        _, first = job.wait_for(lambda r: r["event"] == "step", after=i, timeout=600)
    finally:
        job.finish()
    return {
        "victim": victim,
        "kill_delay_s": delay,
        "kill_to_step_s": first["time"] - t0,
        "first_step_s": first["step_s"],
        "record": what,
    }


def _plain_job(work: str, name: str, dynatrain: dict, steps: int) -> Job:
    os.environ["DYNATRAIN_BENCH"] = name
    job = Job(work, name, dynatrain, steps, nproc=4)
    job.wait_for(lambda r: r["event"] == "step" and r["step"] >= steps)
    job.finish()
    return job


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--dir", default=None, help="keep the jobs' files here (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0, help="seed of the victim and the moment of the kill")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the throughput jobs (off, interval 1, 10)")
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    work = a.dir or tempfile.mkdtemp(prefix="dt-bench-recovery-")
    os.makedirs(work, exist_ok=True)
    try:
        shrink = _plain_job(work, "shrink", {"resize_schedule": [{"step": KILL_AFTER, "world_size": 3}]}, 14)
        resize = next(r for r in shrink.poll() if r["event"] == "resize")
        on1 = _kill_job(work, "on1", {"recovery": {"peer_replicas": 1, "interval_steps": 1}}, rng, "recovery")
        snaps = os.path.join(work, "snaps")
        anchor = _kill_job(
            work, "restart", {"snapshot": {"interval_steps": 4, "dir": snaps, "keep_last": 2}}, rng, "restore"
        )
        kinds = {
            "off": {},
            "on1": {"peer_replicas": 1, "interval_steps": 1},
            "on10": {"peer_replicas": 1, "interval_steps": 10},
        }
        runs = {k: [] for k in kinds}
        for i in range(a.rounds):
            for k, rec_cfg in kinds.items():
                job = _plain_job(work, f"{k}-{i}", {"recovery": rec_cfg} if rec_cfg else {}, 16)
                runs[k].append(_median_step(job, 16))
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    step = {k: statistics.median(v) for k, v in runs.items()}
    rec = on1["record"]
    detection = on1["kill_to_step_s"] - rec["seconds"] - on1["first_step_s"]
    out = {
        "planned_shrink_s": resize["seconds"],
        "kill_to_step_s": on1["kill_to_step_s"],
        "detection_s": detection,
        "first_step_s": on1["first_step_s"],
        "steps_lost": rec["steps_lost"],
        "recovery_s": rec["seconds"],
        "recovery_phases": {
            k: rec[k] for k in ("detect_s", "release_s", "plan_s", "group_s", "transfer_s", "rebuild_s")
        },
        "victim": on1["victim"],
        "kill_delay_s": on1["kill_delay_s"],
        "anchor_kill_to_step_s": anchor["kill_to_step_s"],
        "anchor_steps_lost": anchor["record"]["lost_steps"],
        "speedup": anchor["kill_to_step_s"] / on1["kill_to_step_s"],
        "vs_shrink": (on1["kill_to_step_s"] - on1["first_step_s"]) / (2 * resize["seconds"] + detection),
        "step_s_off": step["off"],
        "step_s_on1": step["on1"],
        "step_s_on10": step["on10"],
        "step_s_runs": runs,
        "overhead_on1": step["on1"] / step["off"] - 1.0,
        "overhead_on10": step["on10"] / step["off"] - 1.0,
    }
    if a.json:
        print(json.dumps(out))
        return 0
    print(
        f"SIGKILL of {out['victim']} (one of 4) {out['kill_delay_s']:.2f} s into step {KILL_AFTER + 1}: "
        f"{out['kill_to_step_s']:.2f} s to the next step on 3 ranks, {out['steps_lost']} step(s) lost "
        f"(recovery {out['recovery_s']:.2f} s: detect {rec['detect_s']:.2f} of which release {rec['release_s']:.2f}, "
        f"plan {rec['plan_s']:.2f}, group {rec['group_s']:.2f}, "
        f"transfer {rec['transfer_s']:.3f}, rebuild {rec['rebuild_s']:.2f})"
    )
    print(
        f"restart from the snapshot (anchor): {out['anchor_kill_to_step_s']:.2f} s, "
        f"{out['anchor_steps_lost']} step(s) lost; ratio {out['speedup']:.1f}x (goal >= 10)"
    )
    print(
        f"kill -> next step = detection {detection:.2f} s (the interrupted step up to its failed collective) + "
        f"recovery {out['recovery_s']:.2f} s + the first step {out['first_step_s']:.2f} s; planned shrink 4 -> 3: "
        f"{out['planned_shrink_s']:.2f} s; (kill -> step - first step) / (2 x shrink + detection) = "
        f"{out['vs_shrink']:.2f} (goal <= 1)"
    )
    spread = {k: f"{min(v):.3f}-{max(v):.3f}" for k, v in runs.items()}
    print(
        f"step time over {a.rounds} rounds (medians; range): replicas off {step['off']:.3f} s ({spread['off']}), "
        f"interval 1 {step['on1']:.3f} s ({spread['on1']}; {100 * out['overhead_on1']:+.1f} %), "
        f"interval 10 {step['on10']:.3f} s ({spread['on10']}; {100 * out['overhead_on10']:+.1f} %; goal <= 5 %)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
