"""Helpers for multi-process tests: every job runs in its own session with a hard timeout, and
its whole process group is killed when the test ends, passes or not (no stray workers)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional, Sequence

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# the tests start their own jobs on this host: a SLURM step or a Kubernetes Indexed Job they run in
# must not place those jobs' agents on several nodes (dynatrain launch reads these variables)
for _name in [n for n in os.environ if n.startswith("SLURM_") or n == "JOB_COMPLETION_INDEX"]:
    del os.environ[_name]
# the suite builds no DeepSpeed op: a JIT build (FusedAdam for an Adam config without "torch_adam",
# the CPU shared-memory collective) takes minutes on a fresh 2-core machine and nothing here needs
# one; under a path whose parent is a file, any such build fails at once, naming the directory
_NO_OP_BUILDS = tempfile.mkdtemp(prefix="dt-no-op-builds-")
open(os.path.join(_NO_OP_BUILDS, "not-a-directory"), "w").close()
os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(_NO_OP_BUILDS, "not-a-directory", "torch_extensions")


@dataclass
class Job:
    returncode: Optional[int]  # None: the job ran past its timeout
    output: str


def skip_unless_torch_computes_fp16() -> None:
    """The fp16 runs need torch to run the model in fp16 on this CPU (forward and backward). They do
    not need mkldnn's fp16 kernels: where DeepSpeed's CPU accelerator reports fp16 unsupported for
    want of them, the workers override that check at a seam (``tests/workers/common.py``
    ``allow_cpu_fp16``); set ``DT_TEST_MKLDNN_FP16=0`` to have mkldnn report them missing on any CPU.
    Where torch itself cannot compute the model in fp16, the run is skipped, naming the reason."""
    import torch
    from workers.common import Tokens
    from workers.groups_worker import GroupsLM

    try:
        torch.manual_seed(0)
        model = GroupsLM().half()
        model(Tokens(n=2)[:]).backward()
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch cannot train the model in fp16 on this CPU: {err}")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session``) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _env() -> dict:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd: Sequence[str], log_path: str, timeout: float, env: Optional[dict] = None) -> Job:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env or _env(), start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = -9
        finally:
            kill_group(proc)
    with open(log_path) as f:
        out = f.read()
    if rc == -9:
        pytest.fail(f"job timed out after {timeout:.0f} s: {' '.join(cmd)}\n{out[-4000:]}")
    return Job(rc, out)


def launch(
    tmp_path,
    script: str,
    nproc: int,
    config: dict,
    args: Sequence[str] = (),
    timeout: float = 180,
    name: str = "job",
    unset: Sequence[str] = (),
) -> Job:
    """``dynatrain launch`` a worker script with ``config`` (written to ``tmp_path``), in the tests'
    environment less the variables named in ``unset``."""
    cfg_path = os.path.join(tmp_path, f"{name}_config.json")
    with open(cfg_path, "w") as f:
        json.dump(config, f)
    cmd = [
        sys.executable,
        "-m",
        "ds_dynatrain.cli",
        "launch",
        "--nproc",
        str(nproc),
        "--allow-oversubscribe",  # CPU workers: the tests grow jobs past the host's --nproc on purpose
        "--config",
        cfg_path,
        script,
        *args,
    ]
    env = {k: v for k, v in _env().items() if k not in unset}
    return _run(cmd, os.path.join(tmp_path, f"{name}.log"), timeout, env)


def resize_command(store: str, world_size: int, timeout_s: float = 150) -> List[str]:
    """The argv of ``dynatrain resize --store STORE --world-size N --timeout T`` in this interpreter."""
    cli = [sys.executable, "-m", "ds_dynatrain.cli", "resize", "--store", store]
    return cli + ["--world-size", str(world_size), "--timeout", str(timeout_s)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plain(
    tmp_path, script: str, nproc: int, args: Sequence[str], timeout: float = 180, name: str = "plain"
) -> List[Job]:
    """Start ``nproc`` ranks of a plain (torch env://) DeepSpeed script; wait for all."""
    port = free_port()
    procs = []
    logs = []
    for r in range(nproc):
        env = _env()
        env.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        log = open(os.path.join(tmp_path, f"{name}_rank{r}.log"), "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                start_new_session=True,
            )
        )
    jobs = []
    try:
        for p in procs:
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None  # a rank SIGKILLed by a test's seam returns -9: a timeout is told apart
            jobs.append(rc)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for log in logs:
            log.close()
    out = []
    for r, rc in enumerate(jobs):
        with open(os.path.join(tmp_path, f"{name}_rank{r}.log")) as f:
            out.append(Job(rc, f.read()))
    if any(j.returncode is None for j in out):
        pytest.fail(f"plain job timed out after {timeout:.0f} s:\n{out[0].output[-3000:]}")
    return out


STUCK_FORMATION = "member {}: the formation of the group of "  # GroupCache.close's warning


def assert_no_gloo_thread(path, output: Optional[str] = None, member: Optional[str] = None) -> None:
    """The OS thread names a worker wrote at exit (``workers.common.record_threads_at_exit``) are
    there and none is a gloo thread: no gloo group outlived the interpreter.

    With ``output`` (the job's log) and ``member``: a test where a member dies while the others
    may be forming a group with it. A formation the dead member had arrived at stays inside
    gloo's rendezvous until gloo's timeout, which nothing can cancel: one gloo thread is accepted
    per such formation that ``member``'s exit named in its warning, and none otherwise."""
    with open(path) as f:
        names = f.read().split()
    gloo = [n for n in names if "gloo" in n]
    stuck = output.count(STUCK_FORMATION.format(member)) if output is not None else 0
    assert names and len(gloo) <= stuck, (str(path), names, f"{stuck} formation(s) named stuck at exit")


def read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def worker_pids(out: str) -> list:
    """The pids of the workers that wrote ``out/samples_<pid>.jsonl`` (the test workers' sample counts)."""
    return [int(os.path.basename(p)[len("samples_") : -len(".jsonl")]) for p in glob.glob(f"{out}/samples_*.jsonl")]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


@contextlib.contextmanager
def background_job(cmd: Sequence[str], log_path: str):
    """Start ``cmd`` in its own session with its output in ``log_path``; yield the process, and
    kill its whole process group when the block ends, passed or not."""
    log = open(log_path, "w")
    job = subprocess.Popen(
        list(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=_env(), start_new_session=True
    )
    try:
        yield job
    finally:
        kill_group(job)
        log.close()
