"""The main job (examples/train_lm.py, a transformers Llama on the standard library's sources)
under ``dynatrain launch``, resized by the config's schedule 2 -> 3 -> 1 -> 2, with snapshots,
with the shipped ZeRO-2 and ZeRO-3 configs (``configs/zero2_elastic.json``,
``configs/zero3_elastic.json``).

Oracle: the same job run without resizes (``--static``): identical world-size-independent inputs,
so the losses may differ only by floating-point reduction order.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import ROOT, launch, read_jsonl

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(ROOT, "examples", "train_lm.py")
ARGS = ["--steps", "12", "--layers", "1", "--hidden", "64", "--seq-len", "32"]


def job_config(tmp_path, name, config="zero2_elastic.json"):
    with open(os.path.join(ROOT, "configs", config)) as f:
        cfg = json.load(f)
    cfg["scheduler"]["params"]["total_num_steps"] = 12
    cfg["dynatrain"] = {
        "resize_schedule": [{"step": 3, "world_size": 3}, {"step": 6, "world_size": 1}, {"step": 9, "world_size": 2}],
        "max_world_size": 3,
        "snapshot": {"interval_steps": 4, "dir": str(tmp_path / f"{name}_snapshots"), "keep_last": 2},
        "metrics_path": str(tmp_path / f"{name}.jsonl"),
        "spawn_lookahead_steps": 2,
    }
    return cfg


# ZeRO-3 resizes are also covered, state bitwise, by test_resize_zero3; the whole main job under ZeRO-3 is slow
@pytest.fixture(
    scope="module",
    params=["zero2_elastic.json", pytest.param("zero3_elastic.json", marks=pytest.mark.slow)],
    ids=["zero2", "zero3"],
)
def main_job(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("main_job")
    el = launch(tmp, SCRIPT, 2, job_config(tmp, "elastic", request.param), ARGS, timeout=240, name="elastic")
    st = launch(
        tmp, SCRIPT, 2, job_config(tmp, "static", request.param), ARGS + ["--static"], timeout=240, name="static"
    )
    return tmp, el, st


def test_job_resizes_three_times_and_finishes(main_job):
    tmp, el, _ = main_job
    assert el.returncode == 0, el.output[-5000:]
    recs = read_jsonl(tmp / "elastic.jsonl")
    resizes = [r for r in recs if r["event"] == "resize"]
    assert [(r["from"], r["to"], r["step"]) for r in resizes] == [(2, 3, 3), (3, 1, 6), (1, 2, 9)]
    for r in resizes:
        for k in ("bytes_moved", "seconds", "plan_s", "transfer_s", "rebuild_s"):
            assert r[k] >= 0, (k, r)
        assert r["bytes_moved"] > 0
        # the moments move in the background beside the rebuild: only plan, group and rebuild add up
        assert r["seconds"] >= r["plan_s"] + r["group_s"] + r["rebuild_s"] - 1e-6
        assert r["seconds"] >= r["transfer_s"] - 1e-6
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert [r["world_size"] for r in steps] == [2] * 3 + [3] * 3 + [1] * 3 + [2] * 3
    assert {r["threads"] for r in steps} == {1}  # the tests' OMP_NUM_THREADS=1 is the user's choice: kept
    assert "resize 2 \u2192 3 after step 3" in el.output
    # the joiners started ahead (spawn_lookahead_steps) warmed up on a synthetic batch before they joined
    assert "joiner warmed up in" in el.output
    # 3 -> 1: two of the three members leave; which ones is the planner's choice (the rank
    # assignment that keeps the most optimizer state in place), one of them the joiner of step 3
    import re

    joiner = re.findall(r"agent: starting joiner (g1r\d)", el.output)
    left = re.findall(r"member (g\d+r\d+) left the job after step 6", el.output)
    assert len(joiner) == 1 and len(set(left)) == 2 and set(left) <= {"g0r0", "g0r1", joiner[0]}, (joiner, left)


def test_losses_follow_static_run(main_job):
    tmp, el, st = main_job
    assert st.returncode == 0, st.output[-5000:]
    a = {r["step"]: r for r in read_jsonl(tmp / "elastic.jsonl") if r["event"] == "step"}
    b = {r["step"]: r for r in read_jsonl(tmp / "static.jsonl") if r["event"] == "step"}
    assert sorted(a) == sorted(b)
    # only reduction order differs (see tests/test_resize_state.py); a data-position or optimizer
    # state error moves this loss by > 1e-2
    for s in a:
        assert abs(a[s]["loss"] - b[s]["loss"]) <= 1e-4 * abs(b[s]["loss"]), (s, a[s], b[s])
        assert a[s]["lr"] == pytest.approx(b[s]["lr"], rel=1e-12)
    assert all(r["world_size"] == 2 for r in b.values())


def _partition_bytes(path) -> int:
    """Bytes of the fp32 master partitions one rank saved in ``path`` (a snapshot's
    ``*optim_states.pt``; ZeRO-1/2 ``single_partition_of_fp32_groups``, ZeRO-3
    ``fp32_flat_groups``), padding included."""
    from ds_dynatrain.checkpoint.saved_file import SavedFile

    f = SavedFile(str(path))
    try:
        sd = f.tree["optimizer_state_dict"]
        return sum(r.nbytes for r in sd.get("single_partition_of_fp32_groups") or sd["fp32_flat_groups"])
    finally:
        f.close()


def test_each_resize_found_its_new_partitions_touched_ahead(main_job):
    """``warm_switch_steps`` (2) steps before each scheduled resize the ranks that stay touch the
    memory of their new partitions (fp32 master and AdamW's two moments) in the background; the
    resize frees it just before allocating them. Oracle: the master partitions each rank saved
    at that world size (the snapshots of steps 8, on 1 rank, and 12, on 2)."""
    tmp, el, _ = main_job
    resizes = {r["to"]: r for r in read_jsonl(tmp / "elastic.jsonl") if r["event"] == "resize"}
    d = tmp / "elastic_snapshots"
    (one,) = (d / "global_step8").glob("*optim_states.pt")
    two = sorted((d / "global_step12").glob("*optim_states.pt"))
    assert resizes[1]["prepared_bytes"] == 3 * _partition_bytes(one), resizes[1]
    assert resizes[2]["prepared_bytes"] == 3 * _partition_bytes(two[0]) == 3 * _partition_bytes(two[1]), resizes[2]
    # world 3 saved nothing: its partitions are a third of world 1's, padding apart
    assert resizes[3]["prepared_bytes"] == pytest.approx(resizes[1]["prepared_bytes"] / 3, rel=0.01), resizes[3]
    assert all(r["prepared_touch_s"] > 0 for r in resizes.values())
    # the moments' new partitions (fp32 training: the master is not moved) were received into
    # that memory as it was: two of its three partition tensors
    assert all(r["partitions_held_bytes"] == 2 * r["prepared_bytes"] // 3 for r in resizes.values()), resizes
    # a grow's joiners each received every working parameter (fp32: half the bytes of the two
    # moments the plan covers, padding apart) beside the moments; a shrink sends none
    for r in resizes.values():
        params = (r["to"] - r["from"]) * (r["bytes_moved"] + r["bytes_kept"]) // 2 if r["to"] > r["from"] else None
        assert r.get("params_bytes") == params and (params is None) == (r.get("params_s") is None), r
    # each grow's joiner held its engine's partitions and, at ZeRO-2, the flat fp32 copy of the
    # working parameters (about a third of world 1's three partitions), unless the survivors'
    # switch had begun when it got there (this model's steps take milliseconds, a joiner's start
    # seconds): touching it then would only have made them wait
    import re

    said = re.findall(
        r"joiner holds (\d+) MiB touched|joiner holds no memory for its engine: its generation", el.output
    )
    flat = 0 if "ZeRO stage 3" in el.output else resizes[1]["prepared_bytes"] / 3
    want = [(resizes[w]["prepared_bytes"] + flat) / 2**20 for w in (3, 2)]
    assert len(said) == 2, said
    assert all(not h or abs(int(h) - w) <= 1 for h, w in zip(said, want)), (said, want)
    # a joiner that held them received its moments into two of its three partition tensors
    received = [int(m) for m in re.findall(r"joiner receives its partitions into (\d+) MiB", el.output)]
    holders = [w for h, w in zip(said, (3, 2)) if h]
    assert len(received) == len(holders), (received, said)
    assert all(abs(m - 2 * resizes[w]["prepared_bytes"] / 3 / 2**20) <= 1 for m, w in zip(received, holders)), received


def test_snapshots_committed_and_pruned(main_job):
    tmp, el, _ = main_job
    d = tmp / "elastic_snapshots"
    assert (d / "latest").read_text() == "global_step12"
    tags = sorted(x.name for x in d.iterdir() if x.is_dir())
    assert tags == ["global_step12", "global_step8"], tags  # keep_last 2, no temporary directories
    # the step-8 snapshot was taken on one rank (world size 1), the step-12 one on two
    assert len(list((d / "global_step8").glob("*optim_states.pt"))) == 1
    assert len(list((d / "global_step12").glob("*optim_states.pt"))) == 2


@pytest.mark.slow
def test_job_ending_before_a_scheduled_grow_finishes(tmp_path):
    """Joiners started ahead of a grow the job never reaches are stopped; the job ends with 0."""
    cfg = job_config(tmp_path, "short")
    cfg["dynatrain"]["resize_schedule"] = [{"step": 6, "world_size": 3}]
    cfg["dynatrain"]["spawn_lookahead_steps"] = 3
    job = launch(
        tmp_path,
        SCRIPT,
        2,
        cfg,
        ["--steps", "4", "--layers", "1", "--hidden", "64", "--seq-len", "32"],
        timeout=180,
        name="short",
    )
    assert job.returncode == 0, job.output[-4000:]
    # the joiner is named after the rank the planner gives it (rank 1: old rank 1 moves to rank 2)
    assert "agent: starting joiner g1r1" in job.output
    assert "agent: stopping joiner g1r1: generation 1 will not be formed" in job.output
    steps = [r for r in read_jsonl(tmp_path / "short.jsonl") if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
