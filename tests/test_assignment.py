"""Rank assignment: the planner's choice keeps the most elements in place; checked against an
exhaustive search over every assignment on small cases (an independent oracle)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_dynatrain.planner import assign_members, assign_members_best, plan_transition
from ds_dynatrain.vps.layout import ParamMeta, ZeroLayout


def layout(sizes, ws, rr=False, stage=2):
    params = (tuple(ParamMeta(f"p{i}", (n,), "float32") for i, n in enumerate(sizes)),)
    if stage == 3:
        return ZeroLayout(ws, params, stage=3, sub_group_size=12)
    return ZeroLayout(ws, params, round_robin=rr)


def brute_force_best_kept(old, new, members, joiners, must_leave=()):
    candidates = [m for m in members if m not in must_leave]
    best = -1
    n_stay = min(len(candidates), new.world_size)
    for stay in itertools.permutations(candidates, n_stay):
        for slots in itertools.combinations(range(new.world_size), n_stay):
            out = [None] * new.world_size
            for s, m in zip(slots, stay):
                out[s] = m
            it = iter(joiners)
            out = [o if o is not None else next(it) for o in out]
            best = max(best, plan_transition(old, new, members, out).numel_kept)
    return best


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    old_ws=st.integers(1, 4),
    new_ws=st.integers(1, 4),
    rr=st.booleans(),
    leave_first=st.booleans(),
    stage=st.sampled_from([2, 3]),
)
def test_best_assignment_keeps_the_maximum(sizes, old_ws, new_ws, rr, leave_first, stage):
    old, new = layout(sizes, old_ws, rr, stage), layout(sizes, new_ws, rr, stage)
    members = [f"m{i}" for i in range(old_ws)]
    must_leave = ["m0"] if leave_first and old_ws > 1 else []
    staying = min(old_ws - len(must_leave), new_ws)
    joiners = [f"j{i}" for i in range(new_ws - staying)]
    ours = assign_members_best(old, new, members, joiners, must_leave)
    assert sorted(ours) == sorted([m for m in ours if m in members] + joiners)
    assert not set(ours) & set(must_leave)
    kept = plan_transition(old, new, members, ours).numel_kept
    assert kept == brute_force_best_kept(old, new, members, joiners, must_leave)
    if not must_leave:
        assert kept >= plan_transition(old, new, members, assign_members(members, new_ws, joiners)).numel_kept


def test_shrink_64_to_48_keeps_two_thirds_instead_of_three_percent():
    params = tuple(ParamMeta(f"w{i}", (4096, 4096), "bfloat16") for i in range(96))
    old = ZeroLayout(64, (params,))
    new = old.with_world_size(48)
    members = [f"m{i}" for i in range(64)]
    keep = plan_transition(old, new, members, assign_members(members, 48, []))
    best = plan_transition(old, new, members, assign_members_best(old, new, members, []))
    total = keep.numel_kept + keep.numel_moved
    assert keep.numel_kept / total == pytest.approx(1 / 32, abs=1e-3)
    assert best.numel_kept / total == pytest.approx(2 / 3, abs=1e-3)


def test_assignment_refuses_an_impossible_membership():
    old, new = layout([10, 10], 2), layout([10, 10], 3)
    with pytest.raises(ValueError, match="do not make world size 3"):
        assign_members_best(old, new, ["a", "b"], [])


def test_plan_cli_reports_a_complete_plan(tmp_path, capsys):
    """``dynatrain plan`` on a small Hugging Face config: the per-rank bytes add up to the state.
    The first call runs the command in its own process; the others call the same entry point
    (``ds_dynatrain.cli.main``) here, which saves an interpreter start-up each."""
    from ds_dynatrain.cli import main as cli_main

    def plan(*args):
        capsys.readouterr()
        rc = cli_main(["plan", *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)

    import json
    import subprocess
    import sys

    from conftest import ROOT

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ds_dynatrain.cli",
            "plan",
            "--model-config",
            str(path),
            "--from",
            "4",
            "--to",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    rep = json.loads(run.stdout.strip().splitlines()[-1])
    n = rep["parameters"]
    assert n == 64 * 256 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 176 + 2 * 64) + 64
    assert rep["bytes_moved"] + rep["bytes_kept"] == 12 * n
    staying = [r for r in rep["ranks"] if r["rank"] is not None]
    assert [r["rank"] for r in staying] == [0, 1, 2] and len(rep["ranks"]) == 4
    assert sum(r["bytes_received"] for r in staying) == rep["bytes_moved"]
    assert sum(r["bytes_sent"] for r in rep["ranks"]) == rep["bytes_moved"]
    assert sum(r["bytes_kept"] for r in staying) == rep["bytes_kept"]
    z3 = plan("--model-config", str(path), "--from", "4", "--to", "3", "--zero-stage", "3", "--json")
    assert z3.returncode == 0, z3.stderr
    rep3 = json.loads(z3.stdout.strip().splitlines()[-1])
    assert rep3["zero_stage"] == 3 and rep3["parameters"] == n
    assert rep3["bytes_moved"] + rep3["bytes_kept"] == 12 * n
    staying3 = [r for r in rep3["ranks"] if r["rank"] is not None]
    assert sum(r["bytes_received"] for r in staying3) == rep3["bytes_moved"]
    # the rebuild partitions the bf16 working parameters afresh from whole copies
    assert all(r["peak_extra_bytes"] >= 2 * n for r in staying3)
    bad = plan("--model-config", str(path), "--from", "4", "--to", "3", "--zero-stage", "0")
    assert bad.returncode == 2 and "--zero-stage 0" in bad.stderr
    fp32 = plan("--model-config", str(path), "--from", "4", "--to", "3", "--dtype", "fp32", "--json")
    rep32 = json.loads(fp32.stdout.strip().splitlines()[-1])
    assert rep32["bytes_moved"] + rep32["bytes_kept"] == 8 * n  # fp32 training moves the moments only
    same = plan("--model-config", str(path), "--from", "3", "--to", "3", "--json")
    assert all(r["peak_extra_bytes"] == 0 for r in json.loads(same.stdout.strip().splitlines()[-1])["ranks"])
    missing = plan("--model-config", str(tmp_path / "nope.json"), "--from", "2", "--to", "1")
    assert missing.returncode == 2 and "no such file" in missing.stderr


# ---------------------------------------------------------------------- the next generation's members
def test_recent_members_taken_back_at_a_grow_when_the_others_stand_by():
    from ds_dynatrain.planner import recent_members

    history = [("a", "b", "c", "d"), ("a", "c")]
    # 4 -> 2 left b and d standing by; the grow back to 4 takes the first generation again
    assert recent_members(history, ("a", "c"), ("b", "d"), 4) == ("a", "b", "c", "d")
    # d is gone (not standing by): no recent generation fits
    assert recent_members(history, ("a", "c"), ("b",), 4) is None
    # the current generation is never "recent"
    assert recent_members(history, ("a", "b", "c", "d"), (), 4) is None


def test_recent_members_at_a_shrink_hold_only_processes_that_stay():
    from ds_dynatrain.planner import recent_members

    history = [("a", "c"), ("a", "b", "c", "d")]
    assert recent_members(history, ("a", "b", "c", "d"), (), 2) == ("a", "c")
    assert recent_members(history, ("a", "b", "c", "d"), (), 2, must_leave=("c",)) is None
    # the latest fitting generation wins
    assert recent_members([("b", "d"), ("a", "c"), ("a", "b", "c", "d")], ("a", "b", "c", "d"), (), 2) == ("a", "c")


def test_next_members_recalls_standby_before_new_joiners_and_names_joiners_by_rank():
    from ds_dynatrain.planner import next_members

    old = layout([10, 7, 3], 2)
    out = next_members(old, ("a", "b"), ("s",), [("a", "b")], 4, (), joiner_name=lambda r: f"new{r}")
    assert set(out[:4]) >= {"a", "b", "s"} and len(out) == 4
    joiner = [m for m in out if m not in ("a", "b", "s")]
    assert joiner == [f"new{out.index(joiner[0])}"]
    # the staying processes hold the ranks that keep the most in place (the best assignment)
    best = assign_members_best(old, old.with_world_size(4), ("a", "b"), ("s", "j"))
    assert [m if m in ("a", "b") else None for m in out] == [m if m in ("a", "b") else None for m in best]


def test_next_members_at_a_preemption_leaves_the_preempted_out():
    from ds_dynatrain.planner import next_members

    old = layout([10, 7, 3], 3)
    out = next_members(old, ("a", "b", "c"), (), [("a", "b", "c")], 2, ("b",), joiner_name=lambda r: f"new{r}")
    assert sorted(out) == ["a", "c"]
    # a grow while one member leaves: the other stays, joiners fill the rest, named by their rank
    grown = next_members(layout([10, 7, 3], 2), ("a", "b"), (), [("a", "b")], 3, ("b",), lambda r: f"new{r}")
    assert "a" in grown and "b" not in grown
    assert sorted(m for m in grown if m != "a") == sorted(f"new{r}" for r, m in enumerate(grown) if m != "a")
