"""A plain Hugging Face Accelerate loop (``accelerator.prepare``, ``accumulate``, ``backward``,
``save_state``/``load_state``) with ``import ds_dynatrain``: real ``Accelerator`` objects on a tiny
Llama, DeepSpeed ZeRO-2 on the CPU, 2-3 processes (``tests/workers/accelerate_worker.py``).

The oracle of a resized or resumed run is a static run of the same script with the same global
batch (12 samples a step: 2 per micro-batch x accumulation x world size): every step sees the same
samples, so the losses agree within reduction noise; a loaded state equals the saved one bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch

from tests.conftest import _run, launch, run_plain, running, worker_pids
from tests.test_trainer import GAS_AT, SAVE_AT, STEPS, _trained_samples, assert_same_state

pytestmark = pytest.mark.timeout(600)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "accelerate_worker.py")


def _losses(out: str, world: int) -> dict:
    with open(os.path.join(out, f"losses_{world}.json")) as f:
        got = json.load(f)
    assert got["engine"] == "ElasticEngine"
    return {int(k): v for k, v in got["losses"].items()}


def _static(tmp_path, nproc: int, *args: str) -> dict:
    out = os.path.join(tmp_path, f"static{nproc}")
    os.makedirs(out, exist_ok=True)
    argv = ["--out", out, "--gas", str(GAS_AT[nproc]), "--steps", str(STEPS), *args]
    jobs = run_plain(tmp_path, WORKER, nproc, argv, timeout=240, name=f"static{nproc}")
    for r, job in enumerate(jobs):
        assert job.returncode == 0, f"rank {r}:\n{job.output[-4000:]}"
    return out


def test_a_plain_accelerate_loop_shrunk_3_to_2_online_trains_as_a_static_run_and_every_sample_once(tmp_path):
    """`dynatrain launch --deepspeed_config_file` of the plain loop on 3 processes (its
    ``Accelerator()`` takes DeepSpeed and the config from Accelerate's variables), shrunk to 2 after
    step 3 by its resize schedule: the process that leaves ends with status 0; the others go on in the same loop, the
    accumulation steps 2 -> 3 (the global batch kept); the losses equal the static 2-process
    run's and the epoch's 96 samples are each trained exactly once over all processes."""
    oracle = _losses(_static(tmp_path, 2, "--count"), 2)
    out = os.path.join(tmp_path, "online")
    os.makedirs(out)
    cfg = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3},
    }
    cfg["zero_optimization"] = {"stage": 2}
    cfg["dynatrain"] = {"resize_schedule": [{"step": SAVE_AT, "world_size": 2}]}
    path = os.path.join(tmp_path, "ds.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    # started as `accelerate launch --use_deepspeed --deepspeed_config_file` starts it: Accelerator()
    # takes the config from Accelerate's variables
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "3", "--deepspeed_config_file", path]
    cmd += [WORKER, "--out", out, "--steps", str(STEPS), "--gas", "2", "--count"]
    job = _run(cmd, os.path.join(tmp_path, "job.log"), timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    assert f"resize 3 → 2 after step {SAVE_AT}" in job.output
    assert job.output.count(f"the Accelerate loop goes on at step {SAVE_AT} on 2 processes (3 accumulation") == 2
    assert "left the job at a resize; this process ends (exit status 0)" in job.output
    got = _losses(out, 3)
    assert sorted(got) == list(range(1, STEPS + 1))
    del got[SAVE_AT]  # the loop gathers a step's loss after the step: at the resize, over the 2 that stay
    for s in got:
        assert got[s] == pytest.approx(oracle[s], rel=1e-4), f"step {s}: {got[s]} vs static {oracle[s]}"
    seen = _trained_samples(out)
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}


def test_a_plain_accelerate_loop_refuses_what_would_need_a_joiner_before_it_trains(tmp_path):
    """A grow in the schedule, or the launcher's restart from snapshots: each would start a
    process at the job's step, which a plain loop cannot enter; the engine's build refuses them
    with the reasons, on every rank, and the job ends (no hang, nothing trained)."""
    cfg = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    cfg["dynatrain"] = {
        "resize_schedule": [{"step": 2, "world_size": 3}],
        "max_world_size": 3,
        "snapshot": {"interval_steps": 2, "dir": str(tmp_path / "snap")},
    }
    job = launch(tmp_path, WORKER, 2, cfg, ["--out", str(tmp_path), "--steps", "4", "--gas", "3"])
    assert job.returncode != 0
    assert "a plain Accelerate loop under `dynatrain launch` runs on through shrinks" in job.output
    assert "resize_schedule grows the job (2 -> 3 ranks after step 2)" in job.output
    assert "snapshot.restore_on_failure is on" in job.output
    assert not os.path.exists(os.path.join(tmp_path, "losses_2.json"))


@pytest.mark.slow
def test_accelerate_loop_saves_state_on_2_and_loads_it_on_3(tmp_path):
    """``save_state`` on 2 processes, ``load_state`` on 3: the state loaded equals bitwise the one
    saved, and the losses go on as the 2-process run's."""
    saved = _static(tmp_path, 2, "--save-at", str(SAVE_AT))
    oracle = _losses(saved, 2)
    argv = ["--out", saved, "--gas", str(GAS_AT[3]), "--steps", str(STEPS), "--load-at", str(SAVE_AT)]
    for r, job in enumerate(run_plain(tmp_path, WORKER, 3, argv, timeout=240, name="load3")):
        assert job.returncode == 0, f"rank {r}:\n{job.output[-4000:]}"
    got = _losses(saved, 3)
    assert_same_state(torch.load(os.path.join(saved, "save.pt")), torch.load(os.path.join(saved, "begin.pt")))
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))
    for s in got:
        assert got[s] == pytest.approx(oracle[s], rel=1e-4), f"step {s}: {got[s]} vs uninterrupted {oracle[s]}"


@pytest.mark.slow
def test_dynatrain_resize_of_a_plain_accelerate_loop_refuses_a_grow_and_shrinks_it(tmp_path):
    """`dynatrain resize` against a running plain loop of 3 processes (3 epochs, 24 steps): a grow
    to 4 is refused with the reason (the requester exits non-zero) and training goes on; a shrink to
    2 is served at a later step boundary; then SIGTERM to one of the 2 (a preemption) shrinks it to
    1. The job ends with status 0, the losses equal the static 2-process run's (but at the two
    switch steps, whose loss the loop gathers over the processes that stay) and every sample is
    trained exactly 3 times."""
    import re
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT, background_job, free_port, resize_command

    steps = 3 * STEPS
    oracle = _losses(_static(tmp_path, 2, "--count", "--steps", str(steps)), 2)
    out = os.path.join(tmp_path, "online")
    os.makedirs(out)
    cfg = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    cfg["dynatrain"] = {"max_world_size": 4}
    path = os.path.join(tmp_path, "ds.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    port = free_port()
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "3", "--slots", "4"]
    cmd += ["--store", f"127.0.0.1:{port}", "--config", path, WORKER, "--out", out, "--steps", str(steps)]
    slow = tmp_path / "slow"  # the steps are slowed until the shrink is answered: it lands mid-run
    slow.write_text("")
    cmd += ["--gas", "2", "--count", "--step-sleep", "1", "--sleep-while", str(slow)]
    with background_job(cmd, os.path.join(tmp_path, "job.log")) as job:
        deadline = time.monotonic() + 200
        while sum(1 for _ in _trained_samples(out).elements()) < 24:  # two steps trained
            assert time.monotonic() < deadline and job.poll() is None, "the job did not train"
            time.sleep(0.2)
        grow = subprocess.run(resize_command(f"127.0.0.1:{port}", 4, 120), capture_output=True, text=True, cwd=ROOT)
        shrink = subprocess.run(resize_command(f"127.0.0.1:{port}", 2, 120), capture_output=True, text=True, cwd=ROOT)
        alive = [pid for pid in worker_pids(out) if running(pid)]
        assert len(alive) == 2, alive
        os.kill(max(alive), signal.SIGTERM)  # a preemption notice
        while "on 1 processes" not in open(os.path.join(tmp_path, "job.log")).read():
            assert time.monotonic() < deadline and job.poll() is None, "the preemption was not served"
            time.sleep(0.2)
        slow.unlink()
        rc = job.wait(timeout=240)
    output = open(os.path.join(tmp_path, "job.log")).read()
    assert grow.returncode != 0 and "cannot be entered by a new one" in grow.stdout + grow.stderr, grow
    assert shrink.returncode == 0, shrink.stdout + shrink.stderr
    assert rc == 0, output[-4000:]
    switched = [int(s) for s in re.findall(r"the Accelerate loop goes on at step (\d+) on 2 processes", output)]
    assert len(switched) == 2 and switched[0] == switched[1], output[-4000:]
    preempted = [int(s) for s in re.findall(r"the Accelerate loop goes on at step (\d+) on 1 processes", output)]
    assert len(preempted) == 1 and switched[0] < preempted[0] <= steps - 2, output[-4000:]
    got = _losses(out, 3)
    assert sorted(got) == list(range(1, steps + 1))
    del got[switched[0]], got[preempted[0]]
    for s in got:
        assert got[s] == pytest.approx(oracle[s], rel=1e-4), f"step {s}: {got[s]} vs static {oracle[s]}"
    seen = _trained_samples(out)
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {3}


def test_launch_takes_the_config_by_one_flag_only(tmp_path, capsys):
    """`--config` and Accelerate's `--deepspeed_config_file` name the same thing: both given is a
    refusal (exit 2) before anything starts, and Accelerate's variables are left unset."""
    from ds_dynatrain.cli.main import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2}))
    before = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    argv = ["launch", "--nproc", "1", "--config", str(path), "--deepspeed_config_file", str(path), WORKER]
    assert main(argv) == 2
    assert "--config and --deepspeed_config_file both given" in capsys.readouterr().err
    assert os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") == before
