"""Hugging Face Trainer with ``import ds_dynatrain``: real ``Trainer`` objects (transformers, accelerate)
on a tiny Llama, DeepSpeed ZeRO on the CPU, 1-3 processes (``tests/workers/trainer_worker.py``).

The oracle of a resume is the uninterrupted run that saved the checkpoint: the gathered fp32 master
weights and Adam moments right after the load equal, bitwise, those gathered at the save, whatever
the two world sizes; and the losses of the steps after it equal that run's within reduction noise
(the global batch is kept: per-device batch x accumulation x world size is 12 in every run, so
every optimizer step sees the same samples).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import signal
import sys

import pytest
import torch

from tests.conftest import assert_no_gloo_thread, run_plain

# several Trainer jobs per test (the shared uninterrupted run is built inside the first test's time):
# beside a CPU-heavy job they took over the suite's default 240 s
pytestmark = pytest.mark.timeout(900)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "trainer_worker.py")
GAS_AT = {1: 6, 2: 3, 3: 2}  # accumulation steps at each world size: a global batch of 12
STEPS, SAVE_AT = 8, 3  # 8 steps of 12 samples: the whole epoch of 96


def _trainer(tmp_path, nproc: int, name: str, *args: str, ok: bool = True):
    out = os.path.join(tmp_path, name)
    os.makedirs(out, exist_ok=True)
    jobs = run_plain(
        tmp_path,
        WORKER,
        nproc,
        ["--out", out, "--dump", out, "--gas", str(GAS_AT[nproc]), *args],
        timeout=240,
        name=name,
    )
    if ok:
        for r, job in enumerate(jobs):
            assert job.returncode == 0, f"{name} rank {r} failed:\n{job.output[-4000:]}"
    return out, jobs


def _losses(out: str) -> dict:
    with open(os.path.join(out, "losses.json")) as f:
        got = json.load(f)
    return {int(k): v for k, v in got["losses"].items()}, got["engine"]


def assert_same_state(a: dict, b: dict) -> None:
    """The gathered fp32 master, moments and working weights of every parameter equal bitwise."""
    names = sorted(k for k in a if not k.startswith("__"))
    assert names == sorted(k for k in b if not k.startswith("__"))
    for n in names:
        for key in ("fp32", "exp_avg", "exp_avg_sq", "param"):
            assert torch.equal(a[n][key], b[n][key]), f"{n}.{key} differs"
    assert a["__global_steps__"] == b["__global_steps__"]
    assert set(a["__step__"]) == set(b["__step__"])


def _uninterrupted(tmp_path, stage: int, nproc: int, plain: bool, *extra: str) -> str:
    """The run that saves at step SAVE_AT and goes on to STEPS: the oracle of every resume."""
    args = ["--steps", str(STEPS), "--save-steps", str(SAVE_AT), "--stage", str(stage), *extra]
    saved, _ = _trainer(tmp_path, nproc, "saved", *args, *(["--plain"] if plain else []))
    assert _losses(saved)[1] == ("DeepSpeedEngine" if plain else "ElasticEngine")
    return saved


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory):
    """The uninterrupted ZeRO-2 run of 2 ranks with snapshots and an evaluation every SAVE_AT steps
    (shared by the tests that need it)."""
    return _uninterrupted(tmp_path_factory.mktemp("zero2"), 2, 2, False, "--eval-steps", str(SAVE_AT))


def _check_resume(tmp_path, stage: int, save_np: int, load_np: int, plain_save: bool, saved: str = None) -> None:
    saved = saved or _uninterrupted(tmp_path, stage, save_np, plain_save)
    oracle, _ = _losses(saved)
    checkpoint = os.path.join(saved, f"checkpoint-{SAVE_AT}")
    resumed, _ = _trainer(
        tmp_path, load_np, "resumed", "--steps", str(STEPS), "--stage", str(stage), "--resume", checkpoint
    )
    got, engine = _losses(resumed)
    assert engine == "ElasticEngine"
    assert_same_state(
        torch.load(os.path.join(saved, f"save{SAVE_AT}.pt")), torch.load(os.path.join(resumed, "begin.pt"))
    )
    after = [s for s in range(SAVE_AT + 1, STEPS + 1)]
    assert [s for s in got if s > SAVE_AT] == after
    for s in after:
        assert got[s] == pytest.approx(oracle[s], rel=1e-4), f"step {s}: {got[s]} vs uninterrupted {oracle[s]}"


def test_the_trainer_processes_end_with_no_gloo_thread_alive(zero2_run):
    """Trainer leaves the engine to the interpreter's exit: after the library's exit hooks no gloo
    thread is left to outlive it (one that did aborted finished processes, status -6)."""
    files = sorted(f for f in os.listdir(zero2_run) if f.startswith("threads_"))
    assert len(files) == 2, files
    for f in files:
        assert_no_gloo_thread(os.path.join(zero2_run, f))


def test_trainer_resumes_a_zero2_snapshot_of_2_ranks_on_3(tmp_path, zero2_run):
    _check_resume(tmp_path, stage=2, save_np=2, load_np=3, plain_save=False, saved=zero2_run)


@pytest.mark.slow
def test_a_resume_with_another_global_batch_is_warned_about(tmp_path, zero2_run):
    """12 samples a step saved, 8 resumed (2 processes x 2 x 2): Trainer's skip by step count then
    repeats samples, and the load says so (a warning, the run goes on: a changed batch can be meant)."""
    checkpoint = os.path.join(zero2_run, f"checkpoint-{SAVE_AT}")
    args = ["--steps", str(SAVE_AT + 1), "--resume", checkpoint, "--gas", "2"]
    out = os.path.join(tmp_path, "resumed")
    os.makedirs(out)
    jobs = run_plain(tmp_path, WORKER, 2, ["--out", out, *args], timeout=240, name="resumed")
    assert [j.returncode for j in jobs] == [0, 0], jobs[0].output[-3000:]
    assert "was saved with a global batch of 12 samples and this engine trains 8" in jobs[0].output
    assert "global batch of" not in jobs[1].output  # said once, by rank 0


@pytest.mark.slow  # make test keeps the kill mid-flush of the snapshot engine (test_snapshot_engine.py)
def test_a_kill_during_a_snapshot_resumes_from_the_last_durable_checkpoint(tmp_path, zero2_run):
    """``save_total_limit=1``, every rank SIGKILLed (a real kill; the seam picks the moment) while
    checkpoint-4 flushes, after Trainer's rotation: checkpoint-2 is still there and complete, and
    ``resume_from_checkpoint=True`` on 3 ranks passes over checkpoint-4 and continues from it."""
    from ds_dynatrain.frontends.trainer import incomplete_reason

    args = ["--steps", str(STEPS), "--save-steps", "2", "--save-total-limit", "1"]
    out, jobs = _trainer(tmp_path, 2, "killed", *args, "--kill-at", "4", ok=False)
    assert [j.returncode for j in jobs] == [-9, -9], jobs[0].output[-3000:]
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
    assert incomplete_reason(os.path.join(out, "checkpoint-2")) is None
    assert "latest" in incomplete_reason(os.path.join(out, "checkpoint-4"))
    at_2 = torch.load(os.path.join(out, "save2.pt"))

    _, jobs = _trainer(tmp_path, 3, "killed", *args, "--resume", "last")
    assert "not resuming from" in jobs[0].output and "checkpoint-4: incomplete" in jobs[0].output
    assert_same_state(at_2, torch.load(os.path.join(out, "begin.pt")))
    got, oracle = _losses(out)[0], _losses(zero2_run)[0]
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(3, STEPS + 1):
        assert got[s] == pytest.approx(oracle[s], rel=1e-4), f"step {s}: {got[s]} vs uninterrupted {oracle[s]}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,save_np,load_np,plain_save",
    [
        (2, 2, 1, False),
        (2, 2, 3, True),
        (3, 2, 3, False),
        (3, 2, 1, False),
        (2, 2, 1, True),
        (3, 2, 3, True),
        (1, 2, 3, False),
        (1, 2, 1, True),
        (3, 2, 1, True),
    ],
)
def test_trainer_resumes_at_another_world_size(tmp_path, stage, save_np, load_np, plain_save):
    _check_resume(tmp_path, stage, save_np, load_np, plain_save)


def _trained_samples(out: str) -> collections.Counter:
    seen = collections.Counter()
    for path in glob.glob(os.path.join(out, "samples_*.jsonl")):
        with open(path) as f:
            for line in f:
                seen.update(json.loads(line))
    return seen


def test_trainer_resized_2_3_2_online_trains_as_a_static_run_and_every_sample_once(tmp_path, zero2_run):
    """`dynatrain launch` of a Trainer script (its config named by its own --deepspeed, as users
    start Trainer scripts), resized 2 -> 3 after step 3 (a joiner) and 3 -> 2 after step 6, the
    global batch kept (12 = 2 x 2 x 3 = 3 x 2 x 2): the losses equal the static 2-process run's;
    the epoch's 96 samples are each trained exactly once over all processes; Trainer's saves at
    the resize steps (save_steps 3) are there and complete."""
    from ds_dynatrain.frontends.trainer import incomplete_reason
    from tests.conftest import _run

    # micro-batch at most 3: 3 x 2 accumulation steps on 2 processes, 2 x 2 on 3 (3 does not divide the
    # 4 samples of a rank there): Trainer's per-device batch follows the engine's both ways
    cfg = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 2}}
    cfg["dynatrain"] = {"resize_schedule": [{"step": 3, "world_size": 3}, {"step": 6, "world_size": 2}]}
    cfg["dynatrain"]["max_world_size"] = 3
    path = os.path.join(tmp_path, "ds.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    out = os.path.join(tmp_path, "out")
    os.makedirs(out)
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--slots", "3", WORKER]
    cmd += ["--deepspeed", path, "--out", out, "--steps", str(STEPS), "--gas", "3", "--save-steps", str(SAVE_AT)]
    cmd += ["--eval-steps", str(SAVE_AT)]
    job = _run(cmd, os.path.join(tmp_path, "launch.log"), timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    assert "resize 2 → 3 after step 3" in job.output and "resize 3 → 2 after step 6" in job.output
    assert job.output.count("the training loop resumes at step 3 on 3 processes") == 3
    got, oracle = _losses(out)[0], _losses(zero2_run)[0]
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        assert got[s] == pytest.approx(oracle[s], rel=1e-4), f"step {s}: {got[s]} vs static {oracle[s]}"
    with open(os.path.join(out, "losses.json")) as f, open(os.path.join(zero2_run, "losses.json")) as g:
        evals, static_evals = json.load(f)["eval"], json.load(g)["eval"]
    assert sorted(evals) == sorted(static_evals) == ["3", "6", "8"]  # and at the end (max_steps)
    for s in evals:
        assert evals[s] == pytest.approx(static_evals[s], rel=1e-5), f"evaluation at step {s}"
    seen = _trained_samples(out)
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {1}
    for step in (3, 6):
        assert incomplete_reason(os.path.join(out, f"checkpoint-{step}")) is None


@pytest.mark.slow
def test_trainer_grown_by_dynatrain_resize_and_shrunk_by_a_preemption(tmp_path):
    """`dynatrain resize` 2 -> 3 against a running Trainer job (3 epochs, 24 steps), then SIGTERM to
    one of the 3 (a preemption) -> 2: the job ends with status 0; the logged losses of every step
    equal the static 2-process run's; each sample is trained exactly 3 times over all processes."""
    import re
    import subprocess
    import time

    from tests.conftest import ROOT, background_job, free_port, resize_command, running, worker_pids

    steps = 3 * STEPS
    static, _ = _trainer(tmp_path, 2, "static", "--steps", str(steps))
    oracle = _losses(static)[0]
    out = os.path.join(tmp_path, "online")
    os.makedirs(out)
    cfg = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    cfg["dynatrain"] = {"max_world_size": 3}
    path = os.path.join(tmp_path, "ds.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    slow = tmp_path / "slow"  # the steps are slowed until the preemption is served: both land mid-run
    slow.write_text("")
    port = free_port()
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--slots", "3"]
    cmd += ["--store", f"127.0.0.1:{port}", WORKER, "--deepspeed", path, "--out", out, "--steps", str(steps)]
    cmd += ["--gas", "3", "--step-sleep", "1", "--sleep-while", str(slow)]
    log_path = os.path.join(tmp_path, "job.log")
    with background_job(cmd, log_path) as job:
        deadline = time.monotonic() + 300
        while sum(_trained_samples(out).values()) < 24:  # two steps trained
            assert time.monotonic() < deadline and job.poll() is None, "the job did not train"
            time.sleep(0.2)
        grow = subprocess.run(resize_command(f"127.0.0.1:{port}", 3, 150), capture_output=True, text=True, cwd=ROOT)
        assert grow.returncode == 0, grow.stdout + grow.stderr
        alive = [pid for pid in worker_pids(out) if running(pid)]
        while len(alive) < 3:  # the joiner has trained a micro-batch
            assert time.monotonic() < deadline and job.poll() is None, "the joiner did not train"
            time.sleep(0.2)
            alive = [pid for pid in worker_pids(out) if running(pid)]
        os.kill(max(alive), signal.SIGTERM)  # a preemption notice
        while "resumes at step" not in open(log_path).read().split("preemption of")[-1]:
            assert time.monotonic() < deadline and job.poll() is None, "the preemption was not served"
            time.sleep(0.2)
        slow.unlink()
        rc = job.wait(timeout=300)
    output = open(log_path).read()
    assert rc == 0, output[-4000:]
    grown = set(re.findall(r"the training loop resumes at step (\d+) on 3 processes", output))
    shrunk = set(re.findall(r"the training loop resumes at step (\d+) on 2 processes", output))
    assert len(grown) == 1 and len(shrunk) == 1 and int(min(grown)) < int(min(shrunk)) <= steps - 2, output[-4000:]
    got = _losses(out)[0]
    assert sorted(got) == list(range(1, steps + 1))
    for s in got:
        assert got[s] == pytest.approx(oracle[s], rel=1e-4), f"step {s}: {got[s]} vs static {oracle[s]}"
    seen = _trained_samples(out)
    assert sorted(seen) == list(range(96)) and set(seen.values()) == {3}
