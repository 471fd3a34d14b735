"""The transition engine (``ds_dynatrain.transition``): the XOR pairing schedule and the chunking
of streams (pure), and real multi-process transitions between world sizes 1-4 over gloo, checked
element by element against the values the new layout must hold."""

import json
import os
import random

import pytest
import torch
from conftest import WORKERS, run_plain
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_dynatrain.planner import assign_members, plan_transition
from ds_dynatrain.transition.buffers import allocate_partitions, reused_bytes
from ds_dynatrain.transition.execute import transition_ranks
from ds_dynatrain.transition.schedule import Stream, next_pow2, pair_schedule, peer_at
from ds_dynatrain.vps.layout import ParamMeta, ZeroLayout


@pytest.mark.parametrize("n", range(1, 65))
def test_schedule_pairs_every_pair_exactly_once(n):
    seen = {}
    for s, pairs in enumerate(pair_schedule(n), start=1):
        ranks = [r for pr in pairs for r in pr]
        assert len(ranks) == len(set(ranks)), f"a rank is paired twice in step {s}"
        for i, j in pairs:
            assert peer_at(i, s, n) == j and peer_at(j, s, n) == i  # both sides agree
            assert (i, j) not in seen
            seen[(i, j)] = s
    assert set(seen) == {(i, j) for i in range(n) for j in range(i + 1, n)}
    assert len(pair_schedule(n)) == next_pow2(n) - 1


def test_schedule_covers_every_sender_receiver_of_plans():
    """Walk each process's loop as ``execute_plan`` does (step 1.., peer = rank XOR step) over
    random plans: every (sender, receiver) pair of the plan is met exactly once by the sender and
    once by the receiver, in the same step; nothing is met that the plan does not hold."""
    rnd = random.Random(5)
    for _ in range(80):
        groups = (
            (ParamMeta("a", (rnd.randint(1, 90), 7), "float32"), ParamMeta("b", (1,), "float32")),
            (ParamMeta("c", (rnd.randint(1, 60),), "float32"),),
        )
        a, b = rnd.randint(1, 12), rnd.randint(1, 12)
        old = ZeroLayout(a, groups, False, False, 2)
        olds = tuple(f"m{i}" for i in range(a))
        plan = plan_transition(
            old, old.with_world_size(b), olds, assign_members(olds, b, tuple(f"j{i}" for i in range(max(0, b - a))))
        )
        ranks = transition_ranks(plan)
        n = len(ranks)
        sent, received = {}, {}  # (sender, receiver) -> steps in which each side handled it
        for me, member in enumerate(ranks):
            sends, recvs = plan.sends_of(member), plan.receives_of(member)
            for step in range(1, next_pow2(n)):
                p = peer_at(me, step, n)
                if p is None:
                    continue
                if ranks[p] in sends:
                    sent.setdefault((member, ranks[p]), []).append(step)
                if ranks[p] in recvs:
                    received.setdefault((ranks[p], member), []).append(step)
        want = {(plan.old_members[t.src], plan.new_members[t.dst]) for t in plan.transfers if not plan.is_keep(t)}
        assert set(sent) == set(received) == want
        for pair in want:
            assert len(sent[pair]) == 1 and sent[pair] == received[pair], pair


def test_new_partitions_are_taken_from_the_memory_held_for_them():
    """``allocate_partitions(reuse=...)``: each new partition is a held tensor of its length and
    dtype where one is left (the same object, so the transfer writes into pages already mapped),
    else a new one; only the elements no transfer writes (DeepSpeed's padding) are zeroed, in
    held tensors too, and the rest is left for the transfers (NaN here, as it was)."""
    groups = ((ParamMeta("w", (10, 11), "float32"),), (ParamMeta("b", (7,), "float32"),))
    old = ZeroLayout(2, groups, stage=2)
    plan = plan_transition(old, old.with_world_size(3), ("m0", "m1"), ("m0", "m1", "j0"))
    member = plan.new_members[-1]  # the last rank: its partitions end in padding
    lengths = [plan.new_layout.partition_numel(g) for g in range(plan.new_layout.num_partitions)]
    kinds = ("exp_avg", "exp_avg_sq")
    held = [torch.full((n,), float("nan")) for n in lengths for _ in kinds]
    other = [torch.full((lengths[0],), float("nan"), dtype=torch.float64), torch.full((lengths[0],), float("nan"))]
    parts = allocate_partitions(plan, member, kinds, torch.float32, reuse=held[1:] + other)
    assert parts[0]["exp_avg"] is held[1] and parts[0]["exp_avg_sq"] is other[1]  # fp32, its length
    assert parts[1]["exp_avg"] is held[2] and parts[1]["exp_avg_sq"] is held[3]
    assert reused_bytes(parts, held) == 4 * (lengths[0] + 2 * lengths[1])
    covered = {g: torch.zeros(n, dtype=torch.bool) for g, n in enumerate(lengths)}
    for _, _, _, _, dst_offset, numel, g in plan.rows_into(member).tolist():
        covered[g][dst_offset : dst_offset + numel] = True
    assert any(not bool(c.all()) for c in covered.values())  # there is padding to zero
    for g, by_kind in parts.items():
        for t in by_kind.values():
            assert bool(t[covered[g]].isnan().all()) and bool((t[~covered[g]] == 0).all()), g


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 50))
def test_chunks_cover_the_stream_within_the_bound(sizes, limit):
    parts = {0: {"k": torch.zeros(sum(sizes))}}

    class T:  # a transfer of ``numel`` elements at ``offset``
        def __init__(self, off, n):
            self.group, self.src_offset, self.dst_offset, self.numel = 0, off, off, n

    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    stream = Stream(parts, ("k",), [T(o, n) for o, n in zip(offs, sizes)], "src")
    chunks = stream.chunks(limit)
    assert chunks[0][0] == 0 and chunks[-1][1] == stream.numel
    for (_a0, b0), (a1, _) in zip(chunks, chunks[1:]):
        assert b0 == a1
    for a, b in chunks:
        assert 0 < b - a <= limit
        pieces = list(stream.pieces(a, b))
        assert sum(p.numel() for p, _ in pieces) == b - a
        # a range is either inside one slice (sent without a copy) or whole slices smaller than the bound
        if len(pieces) > 1:
            assert all(p.numel() < limit for p, _ in pieces)


def _run_workers(tmp_path, args, timeout: float):
    """``transition_worker.py`` on 4 processes with ``args`` (``--out`` added); returns the jobs."""
    return run_plain(
        tmp_path, os.path.join(WORKERS, "transition_worker.py"), 4, [*args, "--out", str(tmp_path)], timeout=timeout
    )


def _results(tmp_path, rank: int) -> list:
    """The list of results ``transition_worker.py`` wrote for ``rank``."""
    return json.loads((tmp_path / f"rank{rank}.json").read_text())


def test_transitions_between_1_and_4_processes(tmp_path):
    jobs = _run_workers(tmp_path, ["--mode", "all"], timeout=200)
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-3000:]
    by_case = {}
    for r in range(4):
        for res in _results(tmp_path, r):
            by_case.setdefault(res["case"], []).append(res)
    assert len(by_case) == 36
    transitions = set()
    for case, res in by_case.items():
        done = [x for x in res if not x.get("skipped")]
        assert done and all(x["ok"] for x in done), f"case {case}: {done}"
        assert sum(x["sent"] for x in done) == sum(x["received"] for x in done)
        transitions.add(done[0]["transition"])
        if done[0]["inflight"] == 64:  # 8 fp32 elements per message each way
            assert all(x["peak_staging"] <= 64 for x in done)
            assert max(x["messages"] for x in done) > 10
    assert len(transitions) == 12


@pytest.mark.parametrize(
    "background", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["foreground", "background"]
)
def test_peer_dying_mid_transition_fails_the_others_fast(tmp_path, background):
    jobs = _run_workers(tmp_path, ["--mode", "die", "--victim", "1"] + (["--background"] if background else []), 90)
    assert jobs[1].returncode == 17  # the victim vanished as injected
    res = _results(tmp_path, 0)[0]
    assert "error" in res, res
    assert "member p1" in res["error"] and "step" in res["error"] and "chunk" in res["error"]
    assert res["seconds"] < 30  # well within the 30 s wait timeout: a closed connection is noticed at once


def test_parameters_go_to_the_joiners_from_their_holders_only(tmp_path):
    """After a grow the joiners (ranks 1 and 3 of 4) receive each tensor from holder ``k mod 2``
    (ranks 0 and 2); the holders, whose values differ, keep their own. Oracle: the values each
    holder made, element by element, in four dtypes and an empty tensor."""
    jobs = _run_workers(tmp_path, ["--mode", "spread"], timeout=90)
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-3000:]
    for r in range(4):
        (res,) = _results(tmp_path, r)
        assert res == {"ok": True, "rank": r}, res


def test_flat_in_place_reuses_the_buffer_the_parameters_live_in():
    from ds_dynatrain.zero.rebuild import flat_in_place

    old = torch.arange(1.0, 25.0)
    old[10:12] = 0  # padding after the first parameter, as DeepSpeed lays it out
    old[20:] = 0  # tail padding of the old world size
    a, b = old[0:10].view(2, 5), old[12:20]
    flat = flat_in_place([a, b], 11, [2, 0])
    want = torch.cat([a.reshape(-1), torch.zeros(2), b, torch.zeros(2)])
    assert flat is not None and flat.data_ptr() == old.data_ptr() and torch.equal(flat, want)
    assert flat_in_place([b, a], 4, [0, 2]) is None  # another order: DeepSpeed must copy
    assert flat_in_place([a, b], 13, [2, 0]) is None  # the buffer is too short for the new padding
    assert flat_in_place([a.clone(), b], 4, [2, 0]) is None
