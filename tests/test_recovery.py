"""In-place recovery from a worker killed without notice (``recovery.peer_replicas``).

The planning is tested pure (ring placement, the recovery step, the split plan against the plan it
splits); the replica transport on real gloo groups in one process (a refresh cut by a failure
never serves a torn replica); the whole path with real jobs: a member of 4 kills itself with
SIGKILL at a seam-chosen moment (the kill is real), the survivors go on without a restart, and
their gathered fp32 master, moments, step and later losses equal bitwise those of a job that
resized 4 -> 3 at the reported step, removing the same member (the oracle).
"""

from __future__ import annotations

import gc
import os
import re
import threading
import weakref
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as tdist
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_dynatrain.planner.plan import plan_transition
from ds_dynatrain.planner.recovery import (
    STAND_IN,
    Offer,
    RecoveryNotPossibleError,
    holders,
    recovery_step,
    replica_ring,
    split_recovery_plan,
)
from ds_dynatrain.transition import replicas as transport
from ds_dynatrain.transition.replicas import ReplicaSet
from ds_dynatrain.vps.layout import ParamMeta, ZeroLayout
from tests.conftest import WORKERS, assert_no_gloo_thread, launch, read_jsonl
from tests.workers.common import base_config

WORKER = os.path.join(WORKERS, "recovery_worker.py")


# ---------------------------------------------------------------------- planning (pure)
def test_replica_ring_puts_every_holder_on_another_host():
    members = [f"m{i}" for i in range(6)]
    nodes = {m: i // 3 for i, m in enumerate(members)}  # m0-m2 on host 0, m3-m5 on host 1
    ring = replica_ring(members, nodes)
    held_by = holders(ring)
    assert sorted(ring) == sorted(members)
    assert all(nodes[m] != nodes[h] for m, h in held_by.items())
    assert replica_ring(members, {}) == tuple(members)  # one host each: rank order


def test_recovery_step_is_the_newest_step_every_copy_has():
    offers = [Offer("a", (4, 5), "d", (4, 5)), Offer("b", (4, 5), "a", (4,)), Offer("c", (4, 5), "b", (4, 5))]
    assert recovery_step(offers, ["d"]) == (5, {"d": "a"})
    torn = [Offer("a", (4, 5), "d", (4,)), *offers[1:]]  # a's replica of d at 5 was cut by the failure
    assert recovery_step(torn, ["d"]) == (4, {"d": "a"})


def test_recovery_step_refuses_when_a_holder_died_too():
    offers = [Offer("a", (4, 5), "d", (4, 5)), Offer("c", (4, 5), "b", (4, 5))]
    with pytest.raises(RecoveryNotPossibleError, match="replica of e"):
        recovery_step(offers, ["d", "e"])  # e's holder (say b) is not among the survivors
    with pytest.raises(RecoveryNotPossibleError, match="no step is common"):
        recovery_step([Offer("a", (6,), "d", (5,))], ["d"])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    world=st.integers(3, 6),
    dead=st.data(),
)
def test_split_recovery_plan_moves_every_element_once_from_a_live_holder(sizes, world, dead):
    groups = tuple((ParamMeta(f"g{g}.w", (n,), "float32"),) for g, n in enumerate(sizes))
    layout = ZeroLayout(world, groups)
    members = tuple(f"m{i}" for i in range(world))
    gone = dead.draw(st.lists(st.sampled_from(members), min_size=1, max_size=world // 2, unique=True))
    ring = replica_ring(members, {})
    held_by = holders(ring)
    if any(held_by[d] in gone for d in gone):
        return  # not recoverable: recovery_step refuses it
    survivors = tuple(m for m in members if m not in gone)
    plan = plan_transition(layout, layout.with_world_size(len(survivors)), members, survivors)
    live, from_replicas = split_recovery_plan(plan, {d: held_by[d] for d in gone})
    assert len(live.table) + len(from_replicas.table) == len(plan.table)
    both = np.concatenate([live.table, from_replicas.table])
    assert sorted(map(tuple, both)) == sorted(map(tuple, plan.table))
    for m in from_replicas.old_members:
        assert m in survivors or m.startswith(STAND_IN)
    for row in from_replicas.transfers:
        assert plan.old_members[row.src] in gone
        assert from_replicas.old_members[row.src] == held_by[plan.old_members[row.src]]


# ---------------------------------------------------------------------- the transport (real gloo)
def _ring_of_sets(n: int, timeout_s: float = 3.0):
    store = tdist.HashStore()
    ring = tuple(f"m{i}" for i in range(n))
    groups = {}

    def build(i):
        groups[i] = tdist.ProcessGroupGloo(tdist.PrefixStore("t", store), i, n, timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=build, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return [
        ReplicaSet(m, ring, [5, 3], ("fp32", "exp_avg"), torch.float32, (lambda i=i: groups[i]), timeout_s)
        for i, m in enumerate(ring)
    ]


def _state(i: int, step: int):
    return [{k: torch.full((n,), float(100 * i + step + j)) for j, k in enumerate(("fp32", "exp_avg"))} for n in (5, 3)]


def test_a_refresh_cut_by_a_failure_never_serves_a_torn_replica():
    """m0's refresh of step 3 fails before its payload is posted: m1's slot of step 3 stays torn
    and is never offered, the replica of step 2 serves intact. Then the sets are closed (as a
    recovery closes them) and dropped, and their groups must be gone with them, by reference
    counting alone: a gloo group left with a receive that never completed keeps one of gloo's
    threads spinning, a whole core, for as long as the group object lives, so neither the failed
    refresh's error nor the wait that raised it may hold it in a reference cycle."""
    gc.disable()  # a cycle would keep the groups alive until a collection
    try:
        sets = _ring_of_sets(3)
        for step in (1, 2):
            for i, rs in enumerate(sets):
                rs.capture(step, _state(i, step), {"step": step})
                rs.start(step)
            for rs in sets:
                rs.wait()
        # complete replicas of 1 and 2: m1 holds m0's
        assert sets[1].offer() == Offer("m1", (1, 2), "m0", (1, 2))
        assert torch.equal(sets[1].replica_at(2)[1]["exp_avg"], _state(0, 2)[1]["exp_avg"])

        def fail(step):  # INJECTED: m0's refresh thread fails before its payload is posted
            if threading.current_thread() is sets[0]._thread:
                raise RuntimeError("injected: m0 died before sending step 3")

        transport.fault_hook = fail
        try:
            sets[0].capture(3, _state(0, 3), {"step": 3})
            sets[0].start(3)
            for i, rs in enumerate(sets[1:], 1):
                rs.capture(3, _state(i, 3), {"step": 3})
                rs.start(3)
            errors = [rs.settle(10.0) for rs in sets]
        finally:
            transport.fault_hook = None
        assert errors[0] is not None and errors[1] is not None  # m0 failed; m1 never got the payload
        offer = sets[1].offer()
        assert 3 not in offer.replica and offer.replica == (2,)  # the torn slot is not offered
        assert recovery_step([offer, sets[2].offer()], ["m0"])[0] == 2
        assert torch.equal(sets[1].replica_at(2)[0]["fp32"], _state(0, 2)[0]["fp32"])  # the older one intact
        groups = [weakref.ref(rs._group) for rs in sets]
        for rs in sets:
            rs.close()
        sets.clear()  # the last references (fail keeps the list)
        del rs
        assert [g() is None for g in groups] == [True] * 3
    finally:
        gc.enable()


# ---------------------------------------------------------------------- jobs
def _config(stage: int, out: str, **extra) -> dict:
    cfg = base_config(stage, os.path.join(out, "metrics.jsonl"))
    cfg["train_batch_size"] = 24  # 3 micro-batches of 2 per rank on 4 ranks, 4 on 3
    cfg["dynatrain"]["recovery"] = {"peer_replicas": 1, "interval_steps": 1, "timeout_s": 30}
    cfg["dynatrain"].update(extra)
    return cfg


def _run(tmp_path, name: str, stage: int, args, bf16: bool = False, **extra):
    out = os.path.join(tmp_path, name)
    os.makedirs(out)
    cfg = _config(stage, out, **extra)
    if bf16:
        cfg["bf16"] = {"enabled": True}  # the master moves; the working parameters are set from it
    job = launch(tmp_path, WORKER, 4, cfg, ["--out", out, *args], timeout=240, name=name)
    return job, out


def _same_state(a: str, b: str) -> None:
    sa, sb = torch.load(os.path.join(a, "final.pt")), torch.load(os.path.join(b, "final.pt"))
    assert sa.keys() == sb.keys()
    for name in sb:
        if name.startswith("__"):
            assert sa[name] == sb[name], name
            continue
        for kind in sb[name]:
            assert torch.equal(sa[name][kind], sb[name][kind]), f"{name} {kind} differs from the oracle"


def _losses(out: str) -> dict:
    """Step -> the job's mean loss, as a member of the last world saw it (every member sees the same)."""
    import glob
    import json

    with open(sorted(glob.glob(os.path.join(out, "losses_*.json")))[0]) as f:
        return json.load(f)


SLOW = pytest.mark.slow


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "stage,victim,point",
    [
        # make test-slow (the suite's time): every kill point of this matrix; a kill during a resize
        # transfer (recovered in place from the old generation), two dead peers falling back to
        # the snapshot and a refresh cut by a failure stay in make test
        pytest.param(2, "g0r2", "step", marks=SLOW),  # inside the optimizer step: survivors past their update go back
        pytest.param(3, "g0r1", "forward", marks=SLOW),  # ZeRO-3 gathers parameters in forward: it surfaces there
        pytest.param(3, "g0r3", "step", marks=SLOW),  # ZeRO-3's optimizer step
        pytest.param(2, "g0r2", "between", marks=SLOW),  # right after a step: its refresh may be cut
        pytest.param(2, "g0r1", "forward", marks=SLOW),
        pytest.param(1, "g0r3", "backward", marks=SLOW),  # ZeRO-1 reduces in the last backward
        pytest.param(1, "g0r2", "refresh", marks=SLOW),  # during the replica refresh of step 4
        pytest.param(2, "g0r0", "backward", marks=SLOW),  # rank 0 (the store's host agent survives)
        pytest.param(2, "g0r1", "flush", marks=SLOW),  # right after step 4, its snapshot being flushed
        pytest.param(2, "g0r2", "step-bf16", marks=SLOW),  # bf16 working parameters, fp32 master
    ],
)
def test_a_kill_recovers_in_place_as_a_resize_at_the_recovered_step(tmp_path, stage, victim, point):
    extra = {}
    if point == "flush":  # a snapshot every 2 steps: the one of step 4 is flushing at the kill
        extra = {"snapshot": {"interval_steps": 2, "dir": os.path.join(tmp_path, "snaps")}}
    bf16 = point.endswith("-bf16")
    point = point.removesuffix("-bf16")
    kill = f"{victim}:4:{'between' if point == 'flush' else point}"
    job, out = _run(tmp_path, "killed", stage, ["--steps", "7", "--kill", kill], bf16=bf16, **extra)
    assert job.returncode == 0, job.output[-4000:]
    assert "restarting the job" not in job.output and "restored" not in job.output
    recs = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r["event"] == "recovery"]
    assert len(recs) == 1, job.output[-3000:]
    rec = recs[0]
    assert rec["dead"] == [victim] and rec["from"] == 4 and rec["to"] == 3
    assert rec["steps_lost"] <= 1 and rec["step"] in (3, 4)
    if point == "refresh":
        assert rec["step"] == 3  # the replica of step 4 was cut: the one of step 3 served
    elif point not in ("between", "flush"):
        assert rec["step"] == 4 and rec["steps_lost"] == 0
    oracle_args = ["--steps", "7", "--oracle", f"{rec['step']}:{victim[-1]}"]
    oracle, oracle_out = _run(tmp_path, "oracle", stage, oracle_args, bf16=bf16)
    assert oracle.returncode == 0, oracle.output[-3000:]
    _same_state(out, oracle_out)
    assert _losses(out) == _losses(oracle_out)


@pytest.mark.multiprocess
@pytest.mark.slow  # make test keeps the restart from a snapshot after a SIGKILL (test_refill.py)
def test_two_dead_holding_each_others_replica_fall_back_to_the_snapshot(tmp_path):
    snaps = os.path.join(tmp_path, "snaps")
    # g0r2 holds g0r1's replica; both die right after step 4 returns, before any other collective
    kills = ["--kill", "g0r1:4:between", "--kill", "g0r2:4:between"]
    job, out = _run(tmp_path, "both", 2, ["--steps", "6", *kills], snapshot={"interval_steps": 2, "dir": snaps})
    assert job.returncode == 0, job.output[-4000:]
    assert "no survivor holds a complete replica of g0r1" in job.output
    # the snapshot of step 4 may not have been flushed by the dead: the one of step 2 serves then
    assert re.search(r"restarting the job on 2 ranks from snapshot global_step[24] ", job.output), job.output[-3000:]
    events = [r["event"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
    assert "recovery" not in events and "restore" in events


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=SLOW)])
def test_a_kill_during_a_resize_transfer_recovers_in_place_from_the_old_generation(tmp_path, stage):
    # every member resizes 4 -> 3 after step 4 (g0r3 must leave); g0r1 dies as that transfer starts
    args = ["--steps", "7", "--oracle", "4:3", "--kill", "g0r1:4:transfer"]
    job, out = _run(tmp_path, "resizing", stage, args)
    assert job.returncode == 0, job.output[-4000:]
    assert "restarting the job" not in job.output
    recs = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r["event"] == "recovery"]
    assert len(recs) == 1, job.output[-3000:]
    rec = recs[0]
    # the old generation's copies serve: g0r1's from its holder, g0r3's too when it had left
    assert rec["dead"] == ["g0r1"] and rec["from"] == 4 and rec["to"] == 2 and rec["step"] in (3, 4)
    # the processes that ended normally (not the dead one) left no gloo thread to the interpreter:
    # the survivors let go of the failed generation's groups and of the new generation's formation
    # begun before the death (it waited for the dead member; cancelled at exit), the one that left
    # of its old groups. Where the dead member had arrived at that formation before dying, the
    # others are inside gloo's rendezvous with it, which nothing cancels: their exit names it
    ended = sorted(f for f in os.listdir(out) if f.startswith("threads_"))
    assert ended == ["threads_g0r0", "threads_g0r2", "threads_g0r3"], ended
    for f in ended:
        assert_no_gloo_thread(os.path.join(out, f), job.output, member=f[len("threads_") :])
    oracle, oracle_out = _run(tmp_path, "oracle", stage, ["--steps", "7", "--oracle", f"{rec['step']}:1,3"])
    assert oracle.returncode == 0, oracle.output[-3000:]
    _same_state(out, oracle_out)
    assert _losses(out) == _losses(oracle_out)


@pytest.mark.multiprocess
@pytest.mark.slow  # the restart path: make test covers it after a SIGKILL (test_refill.py)
def test_replicas_older_than_the_snapshot_fall_back_to_it(tmp_path):
    snaps = os.path.join(tmp_path, "snaps")
    # replicas of steps 4 and 8, a snapshot every step: the death after step 6 finds the snapshot of
    # step 5 (or 6) newer than the replicas of step 4
    recovery = {"peer_replicas": 1, "interval_steps": 4, "timeout_s": 30}
    snapshot = {"interval_steps": 1, "dir": snaps}
    job, out = _run(
        tmp_path, "older", 2, ["--steps", "8", "--kill", "g0r2:6:between"], recovery=recovery, snapshot=snapshot
    )
    assert job.returncode == 0, job.output[-4000:]
    assert "the replicas (step 4) are older than the latest snapshot (step " in job.output, job.output[-3000:]
    assert re.search(r"restarting the job on \d ranks from snapshot global_step[56] ", job.output), job.output[-3000:]
    events = [r["event"] for r in read_jsonl(os.path.join(out, "metrics.jsonl"))]
    assert "recovery" not in events and "restore" in events


def test_peer_replicas_are_refused_without_zero():
    from ds_dynatrain.config import check_elastic_config, load_ds_config
    from ds_dynatrain.errors import ConfigError

    cfg = _config(0, "/nonexistent")
    ds_cfg, dt_cfg = load_ds_config(cfg)
    with pytest.raises(ConfigError, match="peer_replicas needs zero_optimization.stage 1, 2 or 3"):
        check_elastic_config(ds_cfg, dt_cfg, 4, elastic=True)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_rss_stays_flat_over_50_refreshes(tmp_path):
    import json

    job, out = _run(tmp_path, "rss", 2, ["--steps", "56", "--rss"])
    assert job.returncode == 0, job.output[-3000:]
    for path in [os.path.join(out, f) for f in os.listdir(out) if f.startswith("rss_")]:
        with open(path) as f:
            rss = dict(json.loads(line) for line in f)
        grown = rss[56] - rss[6]  # the replica buffers and the group exist from the first refreshes on
        assert grown < 8 << 20, f"{path}: RSS grew by {grown / 2**20:.1f} MiB over 50 refreshes"
