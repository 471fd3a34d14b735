"""The elastic device manager: process groups built in the background and reused, standby
processes, `dynatrain join`, and a job over two hosts (network namespaces).

Real jobs under ``dynatrain launch`` (TinyLM, ZeRO-2, gloo). Oracles: the resize records and
per-step world sizes in the metrics; the group-reuse flag of every resize against the membership
history; each process's open file descriptors, OS threads and RSS after the first and the last
cycle; the final state of a resized job against a static run with the same global batch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
from conftest import ROOT, WORKERS, free_port, read_jsonl, resize_command
from test_elastic_requests import _close, _finish, _static_final, _steps, _wait_for_step

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(WORKERS, "elastic_worker.py")


def _config(metrics: str, **dynatrain) -> dict:
    from workers.common import base_config

    cfg = base_config(2, metrics)
    cfg["dynatrain"].update(dynatrain)
    return cfg


def _launch(tmp_path, name, cfg, steps, launch_args=(), worker_args=(), sleep=0.05, prefix=(), env=None):
    cfg_path = tmp_path / f"{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    log = open(tmp_path / f"{name}.log", "w")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, **(env or {}))
    cmd = [
        *prefix,
        sys.executable,
        "-m",
        "ds_dynatrain.cli",
        *launch_args,
        "--config",
        str(cfg_path),
        SCRIPT,
        "--out",
        str(tmp_path),
        "--steps",
        str(steps),
        "--step-sleep",
        str(sleep),
        *worker_args,
    ]
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    return job, log


def _resources(tmp_path):
    out = {}
    for f in os.listdir(tmp_path):
        if f.startswith("res_"):
            out[f[4:]] = read_jsonl(tmp_path / f)
    return out


@pytest.mark.slow  # soak-like: make soak runs 100 such cycles
@pytest.mark.timeout(600)
def test_ten_cycles_4_2_4_reuse_groups_with_resources_flat(tmp_path):
    """Twenty `dynatrain resize` requests, 4 -> 2 -> 4 ten times, with standby processes: no hang,
    every grow takes the same processes back, every resize after the first reuses a cached group,
    and each process's fds, threads and memory stay flat. Then a shrink to 2, a preemption of one
    of the two (a blocking shrink to 1 while two processes stand by) and a grow to 3: the grow
    takes the standby processes back, still without starting a new one."""
    from ds_dynatrain.elastic.requests import request_resize

    port = free_port()
    cfg = _config(str(tmp_path / "cyc.jsonl"), standby=True, log_interval_steps=10)
    # the job's end is held (--until) until the test ends it: its 400 steps can never run out
    # before the 22 requests are served, however slow the machine
    until = tmp_path / "cyc.until"
    until.write_text("")
    job, log = _launch(
        tmp_path,
        "cyc",
        cfg,
        400,
        ["launch", "--nproc", "4", "--store", f"127.0.0.1:{port}"],
        ["--resources", "--until", str(until)],
        sleep=0.0,
    )
    answers = []
    try:
        _wait_for_step(tmp_path / "cyc.jsonl", 2, job)
        for _ in range(10):
            for ws in (2, 4):
                answers.append(request_resize("127.0.0.1", port, ws, 120.0))
        answers.append(request_resize("127.0.0.1", port, 2, 120.0))
        standing = set(
            re.findall(
                r"member (g0r\d) left the job after step \d+ .*; it stands by", (tmp_path / "cyc.log").read_text()
            )[-2:]
        )
        victim = sorted({"g0r0", "g0r1", "g0r2", "g0r3"} - standing)[0]
        os.kill(int((tmp_path / f"pid_{victim}").read_text()), signal.SIGTERM)
        _wait_for_step(tmp_path / "cyc.jsonl", 1, job)
        deadline = time.monotonic() + 120
        while not any(r["to"] == 1 for r in read_jsonl(tmp_path / "cyc.jsonl") if r["event"] == "resize"):
            assert time.monotonic() < deadline and job.poll() is None, "the preemption did not shrink the job"
            time.sleep(0.2)
        answers.append(request_resize("127.0.0.1", port, 3, 120.0))
        _wait_for_step(tmp_path / "cyc.jsonl", max(r["step"] for r in _steps(tmp_path / "cyc.jsonl")) + 3, job)
        job.send_signal(signal.SIGTERM)  # the job ends at the next step boundary (every member preempted)
    finally:
        until.unlink(missing_ok=True)
        rc = _finish(job, log, timeout=300)
    out = (tmp_path / "cyc.log").read_text()
    assert rc == 128 + signal.SIGTERM, out[-4000:]
    assert len(answers) == 22 and all(a["ok"] for a in answers)
    recs = read_jsonl(tmp_path / "cyc.jsonl")
    resizes = [r for r in recs if r["event"] == "resize"]
    assert [(r["from"], r["to"]) for r in resizes] == [(4, 2), (2, 4)] * 10 + [(4, 2), (2, 1), (1, 3)]
    # the first shrink forms a new 2-group, its grow takes the standby pair back into the launch
    # group; from then on every switch reuses one of those two groups
    assert [r["group_reused"] for r in resizes[:21]] == [False] + [True] * 20, [r["group_reused"] for r in resizes]
    # every request was prepared in the background and served in order; the preemption was not a request
    assert [r.get("request") for r in resizes] == list(range(21)) + [None, 21]
    assert f"member {victim}: preemption notice" in out
    resizes = resizes[:20]
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > resizes[-1]["step"] + 2
    assert "agent: starting joiner" not in out  # no new process: the standby ones came back
    res = _resources(tmp_path)
    assert sorted(res) == ["g0r0", "g0r1", "g0r2", "g0r3"]
    grow_steps = [r["step"] + 1 for r in resizes if r["to"] == 4]
    for member, rows in res.items():
        by_step = {r["step"]: r for r in rows}
        first, last = by_step[grow_steps[0]], by_step[grow_steps[-1]]
        assert last["fds"] <= first["fds"], (member, first, last)
        assert last["threads"] <= first["threads"], (member, first, last)
        assert last["rss"] - first["rss"] < 64 << 20, (member, first, last)


def _netns(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: 10.77.0.1 (host a) and 10.77.0.2 (host b), each
    with a hosts file that names them ``<tag>n1`` and ``<tag>n2`` (``ip netns exec`` shows
    ``/etc/netns/<ns>/hosts`` as ``/etc/hosts`` to what it runs: the names resolve only there)."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = f"dt{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    made = _netns("netns", "add", a)
    if made.returncode != 0:
        pytest.skip(f"cannot create network namespaces here: {made.stderr.strip()}")
    etc = [os.path.join("/etc/netns", ns) for ns in (a, b)]
    try:
        for d in etc:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n10.77.0.1 {tag}n1\n10.77.0.2 {tag}n2\n")
        _netns("netns", "add", b)
        for cmd in (
            ["link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y"],
            ["link", "set", f"{tag}x", "netns", a],
            ["link", "set", f"{tag}y", "netns", b],
            ["-n", a, "addr", "add", "10.77.0.1/24", "dev", f"{tag}x"],
            ["-n", b, "addr", "add", "10.77.0.2/24", "dev", f"{tag}y"],
            ["-n", a, "link", "set", f"{tag}x", "up"],
            ["-n", b, "link", "set", f"{tag}y", "up"],
            ["-n", a, "link", "set", "lo", "up"],
            ["-n", b, "link", "set", "lo", "up"],
        ):
            r = _netns(*cmd)
            assert r.returncode == 0, (cmd, r.stderr)
        yield {"a": (a, f"{tag}x", "10.77.0.1"), "b": (b, f"{tag}y", "10.77.0.2"), "names": f"{tag}n[1-2]"}
    finally:
        _netns("netns", "del", a)
        _netns("netns", "del", b)
        for d in etc:
            shutil.rmtree(d, ignore_errors=True)


def _srun_env(job_id: int, nodelist: str, node: int) -> dict:
    """What ``srun --nodes=2 --ntasks-per-node=1`` sets in its task on node ``node`` (the variables
    ``dynatrain launch`` reads, and a few it must not be misled by)."""
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
    }


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_two_hosts_under_srun_join_while_a_resize_is_pending(tmp_path, two_hosts):
    """`dynatrain launch --nproc 1 --slots 2` on two hosts (namespaces, traffic only over their
    veth) as `srun --ntasks-per-node=1` starts it: no --nnodes, --node-rank or --store; each agent
    reads its node rank, the node count and node 0's name (a compressed hostlist, the names
    resolved by the hosts' own hosts files) from the SLURM variables, the store's port from the
    job id. A `dynatrain resize` to 3 and, while it is pending, a `dynatrain join` from host b:
    both are served, in order (2 -> 3 -> 4), the join's worker under host b's joining agent. Then a
    shrink to 2. The steps go on, every agent exits 0, and the final state equals a static run's."""
    from ds_dynatrain.elastic.cluster_env import SLURM_PORT_BASE

    (ns_a, if_a, _), (ns_b, if_b, _) = two_hosts["a"], two_hosts["b"]
    job_id = 4000 + os.getpid() % 5000
    port = SLURM_PORT_BASE + job_id % 10000  # the documented rule (a fresh namespace: the port is free)
    cfg = _config(str(tmp_path / "mh.jsonl"))
    first = two_hosts["names"].replace("[1-2]", "1")
    store = f"{first}:{port}"  # what the requesters are told: node 0's name, resolved in either namespace
    node = ["launch", "--nproc", "1", "--slots", "2"]
    in_a, in_b = ["ip", "netns", "exec", ns_a], ["ip", "netns", "exec", ns_b]
    env_a = {"GLOO_SOCKET_IFNAME": if_a, **_srun_env(job_id, two_hosts["names"], 0)}
    env_b = {"GLOO_SOCKET_IFNAME": if_b, **_srun_env(job_id, two_hosts["names"], 1)}
    # the job's end is held (--until, every worker) until the last request is answered
    until = tmp_path / "mh.until"
    until.write_text("")
    hold = ["--until", str(until)]
    a, alog = _launch(tmp_path, "host_a", cfg, 24, node, hold, sleep=0.2, prefix=in_a, env=env_a)
    time.sleep(1.0)
    b, blog = _launch(tmp_path, "host_b", cfg, 24, node, hold, sleep=0.2, prefix=in_b, env=env_b)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME=if_a)
    resize = j = None
    jrc = None
    try:
        _wait_for_step(tmp_path / "mh.jsonl", 3, a, timeout=180)
        resize = subprocess.Popen(
            [*in_a, *resize_command(store, 3, 150)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        # the join comes while the resize is pending: wait until the job prepares the resize (its
        # request queued first: a requester's start-up takes seconds on a busy machine), never a
        # fixed sleep; its joiner takes seconds to start, so the join is posted while it is pending
        deadline = time.monotonic() + 150
        while "resize request 0: preparing generation" not in (tmp_path / "host_a.log").read_text():
            assert time.monotonic() < deadline and resize.poll() is None, "the resize was not prepared"
            time.sleep(0.2)
        j, jlog = _launch(
            tmp_path,
            "join_b",
            cfg,
            24,
            ["join", "--nproc", "1", "--store", store],
            hold,
            0.2,
            in_b,
            {"GLOO_SOCKET_IFNAME": if_b},
        )
        rout, rerr = resize.communicate(timeout=200)
        _wait_for_step(tmp_path / "mh.jsonl", 12, a, timeout=180)
        shrink = subprocess.run(
            [*in_b, *resize_command(store, 2, 150)],
            capture_output=True,
            text=True,
            timeout=200,
            cwd=ROOT,
            env=dict(env, GLOO_SOCKET_IFNAME=if_b),
        )
        until.unlink()
        jrc = _finish(j, jlog, timeout=200)
    finally:
        until.unlink(missing_ok=True)
        if resize is not None and resize.poll() is None:
            resize.kill()
        if j is not None and jrc is None:
            jrc = _finish(j, jlog, timeout=30)
        brc = _finish(b, blog, timeout=200)
        arc = _finish(a, alog, timeout=200)
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("host_a", "host_b", "join_b")}
    assert arc == 0 and brc == 0 and jrc == 0, {n: t[-2500:] for n, t in logs.items()}
    assert resize.returncode == 0 and "resized 2 -> 3" in rout, rerr
    assert shrink.returncode == 0 and "resized 4 -> 2" in shrink.stdout, shrink.stderr
    assert f"agent: node 0 of 2, store at {first}:{port} (from SLURM)" in logs["host_a"]
    assert f"agent: node 1 of 2, store at {first}:{port} (from SLURM)" in logs["host_b"]
    assert "asks the job to grow by 1 rank (request" in logs["join_b"]
    assert "agent: starting joiner g2r" in logs["join_b"]  # the join's worker started on host b
    recs = read_jsonl(tmp_path / "mh.jsonl")
    assert [(r["from"], r["to"]) for r in recs if r["event"] == "resize"] == [(2, 3), (3, 4), (4, 2)]
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps[-1] >= 24 and steps == list(range(1, steps[-1] + 1))
    final, _ = _static_final(tmp_path, 2, steps[-1])
    _close(torch.load(tmp_path / "final.pt"), final, "two-host job vs static")


@pytest.mark.slow  # the slot refusal and its message are test_placement's (real TCPStore), in make test
@pytest.mark.timeout(300)
def test_no_free_slot_refuses_and_a_joiner_dying_before_it_joins_gives_the_request_up(tmp_path):
    """A host of 3 slots running 2 workers. A resize to 6 needs 6 slots: `dynatrain resize` refuses
    it with the reason on one line (exit 2) and queues nothing; the same request queued without the
    requester's check (a seam: written into the store's queue as a requester would) is refused by
    the job when it reads it, the 4 new workers having 1 free slot. Then a resize to 3: a joiner
    killed while the job prepares the grow held no state, the request is given up (the requester is
    told why, exit 1 of `dynatrain resize`), training goes on at the old size and the job finishes
    with status 0. Fault injected at a seam: SIGKILL to the joiner's process."""
    from ds_dynatrain.elastic.keys import ANSWER_KEY, REQUEST_COUNT, REQUEST_KEY
    from ds_dynatrain.elastic.membership import connect_store

    port = free_port()
    cfg = _config(str(tmp_path / "jd.jsonl"))
    # the job's end is held (--until) until the request is answered: it is given up because its
    # joiner died, never because the job ran out of steps first
    until = tmp_path / "jd.until"
    until.write_text("")
    launch_args = ["launch", "--nproc", "2", "--slots", "3", "--store", f"127.0.0.1:{port}"]
    job, log = _launch(tmp_path, "jd", cfg, 40, launch_args, ["--until", str(until)], sleep=0.2)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    try:
        _wait_for_step(tmp_path / "jd.jsonl", 2, job)
        big = subprocess.run(
            resize_command(f"127.0.0.1:{port}", 6, 150), capture_output=True, text=True, cwd=ROOT, env=env, timeout=200
        )
        store = connect_store("127.0.0.1", port, 30)
        queued = int(store.add(REQUEST_COUNT, 1)) - 1
        store.set(REQUEST_KEY.format(queued), json.dumps({"world_size": 6}))
        store.wait([ANSWER_KEY.format(queued)], timedelta(seconds=150))
        raw = json.loads(store.get(ANSWER_KEY.format(queued)))
        req = subprocess.Popen(
            resize_command(f"127.0.0.1:{port}", 3, 150),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid_g1r1").exists() and not (tmp_path / "pid_g1r2").exists():
            assert time.monotonic() < deadline and job.poll() is None, "no joiner started"
            time.sleep(0.05)
        pid_file = next(p for p in (tmp_path / "pid_g1r1", tmp_path / "pid_g1r2") if p.exists())
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        rout, rerr = req.communicate(timeout=200)
    finally:
        until.unlink(missing_ok=True)
        rc = _finish(job, log)
    out = (tmp_path / "jd.log").read_text()
    assert rc == 0, out[-4000:]
    assert big.returncode == 2 and big.stdout == "", (big.stdout, big.stderr)
    assert big.stderr.strip().splitlines()[-1] == (
        "dynatrain resize: refused: world size 6 needs 6 slots, but the job's hosts have 3 (node 0: 3); "
        "add hosts with dynatrain join, or launch with --slots or --allow-oversubscribe"
    ), big.stderr
    assert queued == 0 and raw["ok"] is False and not raw["aborted"], raw  # the refused resize queued nothing
    assert raw["message"] == (
        "resize to 6 ranks refused: 4 new workers need a free slot each, but the job's hosts have 1 free "
        "(node 0: 2 of 3 used); add hosts with dynatrain join, or launch with --slots or --allow-oversubscribe"
    ), raw
    assert req.returncode == 1 and "abandoned" in rerr and "died before it joined" in rerr, (rout, rerr)
    assert "died before it joined" in out
    steps = _steps(tmp_path / "jd.jsonl")
    last = steps[-1]["step"]
    assert last >= 40 and [r["step"] for r in steps] == list(range(1, last + 1))
    assert {r["world_size"] for r in steps} == {2}
    assert not [r for r in read_jsonl(tmp_path / "jd.jsonl") if r["event"] in ("resize", "restore")]
