"""Jobs started by the common launchers other than ``dynatrain launch``: ``torchrun``, DeepSpeed's
launcher (``deepspeed``, which passes ``--local_rank=N``) and ``accelerate launch``. Each runs on
two processes with snapshots, and the same launcher loads a snapshot on one process and trains
on; a resize is refused there, naming the launcher and what it supports. (``dynatrain launch`` is
tested throughout the suite.)

Real launchers, real DeepSpeed engines (ZeRO-2, gloo), real files. Oracles:

* the state gathered with DeepSpeed's ``safe_get_full_*`` right after the load on one process
  equals, bitwise, the state the two-process job gathered at the snapshot's step (fp32 master,
  Adam moments and step, working parameters, LR, step counter);
* the losses after the load follow the two-process job's own steps after the snapshot (same
  global batch; only the reduction order differs: a lost moment, a wrong LR or a step off by one
  moves them by far more than 1e-5 relative), for the main job (``examples/train_lm.py``) too;
* every snapshot committed, ``latest`` naming the last; the processes' ranks as the launcher set
  them.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from conftest import ROOT, WORKERS, _env, _run, free_port, read_jsonl

WORKER = os.path.join(WORKERS, "launcher_worker.py")
MAIN_JOB = os.path.join(ROOT, "examples", "train_lm.py")
STEPS = 4
SNAPSHOT_STEP = 2


def _config(d, snapshots: bool) -> str:
    from workers.common import base_config

    cfg = base_config(2, str(d / "metrics.jsonl"))
    if snapshots:
        cfg["dynatrain"]["snapshot"] = {"interval_steps": SNAPSHOT_STEP, "dir": str(d / "snapshots")}
    path = d / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _torchrun(nproc: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def _deepspeed(nproc: int) -> list:
    # on the CPU accelerator --num_gpus is the number of processes on this host
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(free_port()),
    ]


def _accelerate(nproc: int) -> list:
    common = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    # several processes: accelerate's multi-process launcher (torchrun underneath); one: its simple
    # launcher, which sets no rank variables (a lone process)
    several = ["--multi_gpu", "--main_process_port", str(free_port())] if nproc > 1 else []
    return [sys.executable, "-m", "accelerate.commands.launch", *several, "--num_processes", str(nproc), *common]


def _job(launcher: list, script: str, args: list, log: str, timeout: float = 200):
    job = _run([*launcher, script, *args], log, timeout, _env())
    assert job.returncode == 0, job.output[-5000:]
    return job


def _save_and_load(tmp_path, launcher) -> tuple:
    """The worker on two processes (snapshots every 2 steps, state gathered at step 2, a resize
    tried at the end), then on one process loading the step-2 snapshot; both under ``launcher``."""
    two, one = tmp_path / "two", tmp_path / "one"
    two.mkdir()
    one.mkdir()
    args = ["--deepspeed_config", _config(two, snapshots=True), "--out", str(two), "--steps", str(STEPS)]
    _job(launcher(2), WORKER, args + ["--dump-at", str(SNAPSHOT_STEP), "--try-resize", "1"], str(tmp_path / "two.log"))
    load = f"{two / 'snapshots'}:global_step{SNAPSHOT_STEP}"
    args = ["--deepspeed_config", _config(one, snapshots=False), "--out", str(one), "--steps", str(STEPS)]
    _job(launcher(1), WORKER, args + ["--load", load], str(tmp_path / "one.log"))
    return two, one


def _check_snapshots(d, last: int = STEPS) -> None:
    snaps = [r for r in read_jsonl(d / "metrics.jsonl") if r["event"] == "snapshot"]
    assert [(r["step"], r["ok"]) for r in snaps] == [(s, True) for s in range(SNAPSHOT_STEP, last + 1, SNAPSHOT_STEP)]
    assert (d / "snapshots" / "latest").read_text().strip() == f"global_step{last}"


def _check_continuation(two, one, world_after: int = 1) -> None:
    """Steps after the load on one process against the two-process job's own."""
    ref = {r["step"]: r for r in read_jsonl(two / "metrics.jsonl") if r["event"] == "step"}
    assert sorted(ref) == list(range(1, STEPS + 1)) and {r["world_size"] for r in ref.values()} == {2}
    got = [r for r in read_jsonl(one / "metrics.jsonl") if r["event"] in ("step", "load")]
    load = got[0]
    assert load["event"] == "load" and (load["step"], load["from"], load["to"]) == (SNAPSHOT_STEP, 2, world_after)
    steps = {r["step"]: r for r in got[1:]}
    assert sorted(steps) == list(range(SNAPSHOT_STEP + 1, STEPS + 1))
    for s, r in steps.items():
        assert r["world_size"] == world_after
        assert abs(r["loss"] - ref[s]["loss"]) <= 1e-5 * abs(ref[s]["loss"]), (s, r, ref[s])
        assert r["lr"] == pytest.approx(ref[s]["lr"], rel=1e-12)


def _check_worker(two, one, launcher_name: str) -> None:
    for rank in (0, 1):
        started = json.loads((two / f"started_rank{rank}.json").read_text())
        assert (started["rank"], started["world_size"], started["local_rank_env"]) == (rank, 2, str(rank))
        refused = json.loads((two / f"resize_rank{rank}.json").read_text())
        assert refused["world_size"] == 2 and refused["error"]["type"] == "ResizeRefusedError", refused
        message = refused["error"]["message"]
        assert f"started by {launcher_name}, not by `dynatrain launch`" in message, message
        assert "snapshots and loading a checkpoint at another world size work there" in message, message
    _check_snapshots(two)
    before, after = torch.load(two / f"state_step{SNAPSHOT_STEP}.pt"), torch.load(one / "loaded.pt")
    names = [k for k in before if not k.startswith("__")]
    assert names and sorted(names) == sorted(k for k in after if not k.startswith("__"))
    for name in names:
        for kind in ("fp32", "exp_avg", "exp_avg_sq", "param"):
            assert torch.equal(before[name][kind], after[name][kind]), f"{name}.{kind}"
    for key in ("__step__", "__lr__", "__global_steps__"):
        assert before[key] == after[key], key
    assert after["__global_steps__"] == SNAPSHOT_STEP
    _check_continuation(two, one)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_torchrun_saves_on_two_processes_and_loads_on_one(tmp_path):
    two, one = _save_and_load(tmp_path, _torchrun)
    _check_worker(two, one, "torchrun")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_accelerate_launch_saves_on_two_processes_and_loads_on_one(tmp_path):
    two, one = _save_and_load(tmp_path, _accelerate)
    _check_worker(two, one, "accelerate launch")
    # one process: accelerate's simple launcher sets no rank variables, so the worker is a job of one
    assert "[dynatrain] no launcher: a job of one process" in (tmp_path / "one.log").read_text()
    assert json.loads((one / "started_rank0.json").read_text())["local_rank_env"] == "0"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_deepspeed_launcher_runs_the_main_job_saves_on_two_processes_and_loads_on_one(tmp_path):
    """``deepspeed --num_gpus 2 examples/train_lm.py --deepspeed_config CFG``: the main job takes
    the launcher's ``--local_rank=N``; then ``--num_gpus 1`` with ``--load`` goes on from step 2."""
    with open(os.path.join(ROOT, "configs", "zero2_elastic.json")) as f:
        cfg = json.load(f)
    two, one = tmp_path / "two", tmp_path / "one"
    for d in (two, one):
        d.mkdir()
        cfg["dynatrain"] = {"metrics_path": str(d / "metrics.jsonl")}
        if d is two:
            cfg["dynatrain"]["snapshot"] = {"interval_steps": SNAPSHOT_STEP, "dir": str(d / "snapshots")}
        (d / "config.json").write_text(json.dumps(cfg))
    data = os.path.join(ROOT, "README.md")  # a small text (the standard library's sources take longer to read)
    small = ["--steps", str(STEPS), "--layers", "1", "--hidden", "64", "--seq-len", "32", "--data", data]
    job = _job(
        _deepspeed(2), MAIN_JOB, ["--deepspeed_config", str(two / "config.json"), *small], str(tmp_path / "two.log")
    )
    assert "--local_rank=1" in job.output  # DeepSpeed's launcher passed it (its log shows the command)
    _check_snapshots(two)
    load = ["--load", str(two / "snapshots"), "--load-tag", f"global_step{SNAPSHOT_STEP}"]
    _job(
        _deepspeed(1),
        MAIN_JOB,
        ["--deepspeed_config", str(one / "config.json"), *small, *load],
        str(tmp_path / "one.log"),
    )
    _check_continuation(two, one)


def test_other_launchers_are_named_from_the_variables_they_set():
    """The variables are those each launcher's source sets in its workers (torch's
    ``torch/distributed/run.py``, DeepSpeed's ``launcher/launch.py``, accelerate's ``utils/launch.py``)."""
    from ds_dynatrain.elastic.launch_env import (
        LaunchContext,
        enter_lone_process,
        lone_process,
        other_launcher,
        started_elsewhere,
    )

    ranks = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    torchrun = dict(ranks, TORCHELASTIC_RUN_ID="none", LOCAL_WORLD_SIZE="2")
    accelerate = dict(torchrun, ACCELERATE_MIXED_PRECISION="no")  # its multi-process launcher is torchrun's
    deepspeed = dict(ranks, CROSS_RANK="0", CROSS_SIZE="1", LOCAL_SIZE="2")
    assert other_launcher(torchrun) == "torchrun"
    assert other_launcher(accelerate) == "accelerate launch"
    assert other_launcher(deepspeed) == "DeepSpeed's launcher (deepspeed)"
    assert other_launcher(ranks) == "a launcher other than `dynatrain launch`"
    assert other_launcher({}) == "no launcher"
    # the end of a refusal's "this process was ...": each says it once
    assert started_elsewhere(torchrun) == "started by torchrun, not by `dynatrain launch`"
    assert started_elsewhere(ranks) == "started by a launcher other than `dynatrain launch`"
    assert started_elsewhere({}) == "started without a launcher, not by `dynatrain launch`"
    assert not any(map(lone_process, (torchrun, accelerate, deepspeed, ranks)))
    assert not lone_process({"OMPI_COMM_WORLD_SIZE": "4"}) and not lone_process({"SLURM_NTASKS": "2"})
    ours = LaunchContext("127.0.0.1", 29400, "g0r0", 0, 0, 1, 0, joiner=False).worker_environ()
    assert not lone_process({k: v for k, v in ours.items() if k not in ("RANK", "WORLD_SIZE")})
    # accelerate's one-process launcher sets only its own variables; a lone process under srun -n 1
    assert lone_process({"ACCELERATE_MIXED_PRECISION": "no"}) and lone_process({"SLURM_NTASKS": "1"})
    env = {"LOCAL_RANK": "3"}
    enter_lone_process(env)
    assert env == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "1"}


def test_a_resize_schedule_outside_dynatrain_launch_is_refused_before_anything_starts(monkeypatch):
    """In this process, with the variable torchrun sets in its workers: ``initialize`` refuses the
    schedule before any process group or engine exists, naming the launcher and its limits."""
    import torch.distributed as tdist
    from workers.common import TinyLM, base_config

    import ds_dynatrain

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    cfg = base_config(2)
    cfg["dynatrain"]["resize_schedule"] = [{"step": 2, "world_size": 1}]
    model = TinyLM()
    with pytest.raises(
        ds_dynatrain.ConfigError,
        match=r"^dynatrain.resize_schedule: this process was started by torchrun, not by `dynatrain launch`; "
        r"jobs started by other launchers .* resizes, joins and the restart of a job after a worker died need "
        r"`dynatrain launch`$",
    ):
        ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert not tdist.is_initialized()
