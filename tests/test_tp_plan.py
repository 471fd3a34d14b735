"""The TP + ZeRO layout and the box planner, checked element by element (pure, no process).

Oracle: a rank's flat partitions built straight from the full tensors, by cutting the TP shard
with numpy slicing and laying its flattening out by ``ZeroLayout.fragments`` (the 1-D layout
proven against DeepSpeed in ``tests/test_layout_vs_deepspeed.py``). A plan is then executed on
those partitions, row by row as strided copies, and every new rank's partitions must equal the
oracle's for the new layout; every element of every new partition that a parameter owns must be
written exactly once. Models, degrees and uneven shard sizes are drawn by hypothesis.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tp_oracle import partitions

from ds_dynatrain.errors import LayoutMismatchError
from ds_dynatrain.planner.box_plan import assign_box_members_best, kept_upper_bound
from ds_dynatrain.planner.tp_plan import plan_tp_transition
from ds_dynatrain.vps.layout import ParamMeta
from ds_dynatrain.vps.tensor_parallel import TensorParallelLayout, TpSplit


def _cut(n: int, tp: int, draw) -> tuple:
    """``n`` split into ``tp`` non-negative sizes (uneven, zeros allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=tp - 1, max_size=tp - 1)))
    edges = [0] + cuts + [n]
    return tuple(b - a for a, b in zip(edges, edges[1:]))


@st.composite
def models(draw):
    n = draw(st.integers(1, 6))
    shapes = [tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))) for _ in range(n)]
    dims = [draw(st.sampled_from([None, 0] + ([1] if len(s) > 1 else []))) for s in shapes]
    n_groups = draw(st.integers(1, min(2, n)))
    owner = list(range(n_groups)) + [draw(st.integers(0, n_groups - 1)) for _ in range(n - n_groups)]
    metas = [ParamMeta(f"p{i}", s, "float32") for i, s in enumerate(shapes)]
    groups = tuple(tuple(m for m, o in zip(metas, owner) if o == g) for g in range(n_groups))
    zero = dict(
        stage=draw(st.sampled_from([1, 2, 3])),
        round_robin=draw(st.booleans()),
        parameter_alignment=draw(st.booleans()),
        sub_group_size=draw(st.sampled_from([4, 10**9])),
    )
    degrees = [(draw(st.integers(1, 3)), draw(st.integers(1, 3))) for _ in range(2)]
    layouts = []
    for tp, dp in degrees:
        splits = {}
        for m, d in zip(metas, dims):
            if d is not None and tp > 1:
                splits[m.key] = TpSplit(d, _cut(m.shape[d], tp, draw))
            elif d is not None:
                splits[m.key] = TpSplit(d, (m.shape[d],))
        if zero["stage"] == 3:
            zero["round_robin"] = zero["parameter_alignment"] = False
        layouts.append(TensorParallelLayout(tp, dp, groups, tuple(sorted(splits.items())), **zero))
    return layouts[0], layouts[1]


def execute(plan, old_parts: list) -> list:
    """Run a plan's rows as strided copies; count how often each element is written."""
    new = plan.new_layout
    out, writes = [None] * new.world_size, [None] * new.world_size
    for r in range(new.world_size):
        zl = new.zero_of(r)
        out[r] = [np.full(zl.partition_numel(b), np.nan) for b in range(zl.num_partitions)]
        writes[r] = [np.zeros(zl.partition_numel(b), dtype=int) for b in range(zl.num_partitions)]
    for src, dst, _p, g, so, ss, dg, do, ds, rows, cols in plan.table:
        for k in range(rows):
            out[dst][dg][do + k * ds : do + k * ds + cols] = old_parts[src][g][so + k * ss : so + k * ss + cols]
            writes[dst][dg][do + k * ds : do + k * ds + cols] += 1
    return out, writes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), st.randoms(use_true_random=False))
def test_plan_moves_every_element_once(pair, rnd):
    old, new = pair
    rng = np.random.default_rng(rnd.randint(0, 2**31))
    full = {p.key: rng.standard_normal(math.prod(p.shape)) for p in old.params}
    members = [f"m{i}" for i in range(old.world_size)]
    n_join = max(0, new.world_size - old.world_size)
    joiners = [f"j{i}" for i in range(n_join)]
    new_members, k = assign_box_members_best(old, new, members, joiners)
    plan = plan_tp_transition(old, new, members, new_members)
    got, writes = execute(plan, partitions(old, full))
    want = partitions(new, full)
    for r in range(new.world_size):
        for b, (g, w, n) in enumerate(zip(got[r], want[r], writes[r])):
            owned = ~np.isnan(w)
            np.testing.assert_array_equal(g[owned], w[owned], err_msg=f"rank {r} partition {b}")
            assert (n[owned] == 1).all() and (n[~owned] == 0).all(), f"rank {r} partition {b}: writes {n}"
    # the keeps are exactly the assignment's overlap, and no assignment can keep more
    kept = sum(int(k[members.index(m), j]) for j, m in enumerate(new_members) if m in members)
    assert plan.numel_kept == kept <= kept_upper_bound(k)
    # a new layout holds a cut parameter once, a replicated one once per TP rank
    total = sum(math.prod(p.shape) * (new.tp if new.split(p.key).dim is None else 1) for p in old.params)
    assert plan.numel_kept + plan.numel_moved == total


def test_row_parallel_shard_is_few_boxes():
    """A row-parallel (dimension 1) shard of an 8192 x 8192 weight under ZeRO is at most three
    boxes per fragment, not one interval per row."""
    p = ParamMeta("w", (8192, 8192), "bfloat16")
    layout = TensorParallelLayout(8, 4, ((p,),), (("w", TpSplit(1, (1024,) * 8)),))
    b = layout.boxes()
    assert len(b.param) <= 3 * 8 * 4
    assert int((b.rows * b.cols).sum()) == 8192 * 8192


def test_bad_splits_are_refused():
    p = ParamMeta("w", (6, 4), "float32")
    with pytest.raises(LayoutMismatchError, match="do not tile 6"):
        TensorParallelLayout(2, 1, ((p,),), (("w", TpSplit(0, (3, 2))),))
    with pytest.raises(LayoutMismatchError, match="2 shards at TP 3"):
        TensorParallelLayout(3, 1, ((p,),), (("w", TpSplit(0, (3, 3))),))
    with pytest.raises(LayoutMismatchError, match="no such trainable parameter"):
        TensorParallelLayout(2, 1, ((p,),), (("v", TpSplit(0, (3, 3))),))
    a = TensorParallelLayout(2, 1, ((p,),), (("w", TpSplit(0, (3, 3))),))
    with pytest.raises(LayoutMismatchError, match="ZeRO settings"):
        plan_tp_transition(a, TensorParallelLayout(1, 2, ((p,),), stage=3), ["a", "b"], ["a", "b"])


def test_plan_cli_with_tensor_parallel_degrees(tmp_path, capsys):
    """``dynatrain plan --tensor-parallel-from/--tensor-parallel-to`` on a small GQA Llama config:
    the bytes add up to the state (each copy of a replicated parameter counted), every old rank
    sends what the new ranks receive, the kept bytes reach the upper bound, and impossible
    layouts are refused with the reason and exit status 2."""
    import json

    from ds_dynatrain.cli import main as cli_main

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 48,
        "head_dim": 8,
        "intermediate_size": 101,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "vocab_size": 96,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))

    def plan(*args):
        capsys.readouterr()
        rc = cli_main(["plan", "--model-config", str(path), *args])
        out = capsys.readouterr()
        return rc, out.out, out.err

    rc, out, err = plan(
        "--from", "4", "--to", "4", "--tensor-parallel-from", "2", "--tensor-parallel-to", "1", "--json"
    )
    assert rc == 0, err
    rep = json.loads(out.strip().splitlines()[-1])
    h, f, v = 48, 101, 96
    cut = 2 * (h * h + 2 * 24 * h + h * h + 3 * h * f) + v * h  # q, k, v, o, MLP, head: held once
    whole = v * h + 2 * 2 * h + h  # embedding and norms: once per TP rank
    assert rep["parameters"] == cut + whole
    assert rep["bytes_moved"] + rep["bytes_kept"] == 12 * (cut + whole)  # TP 1: one copy of everything
    assert rep["bytes_kept"] == rep["bytes_kept_upper_bound"] > 0
    assert sum(r["bytes_received"] for r in rep["ranks"]) == rep["bytes_moved"]
    assert sum(r["bytes_sent"] for r in rep["ranks"]) == rep["bytes_moved"]
    rc, out, _ = plan("--from", "4", "--to", "2", "--tensor-parallel-from", "2", "--tensor-parallel-to", "2")
    assert rc == 0 and "TP 2 x DP 2 -> TP 2 x DP 1 (4 -> 2 ranks)" in out
    rc, _, err = plan("--from", "4", "--to", "3", "--tensor-parallel-from", "2", "--tensor-parallel-to", "2")
    assert rc == 2 and "TP degree 2 does not divide world size 3" in err
    rc, _, err = plan("--from", "2", "--to", "2", "--tensor-parallel-from", "0", "--tensor-parallel-to", "1")
    assert rc == 2 and "TP degree 0 and world size 2: both must be >= 1" in err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), st.integers(1, 40), st.randoms(use_true_random=False))
def test_messages_cut_by_rows_move_the_same_elements(pair, limit, rnd):
    """The transfer's messages (``transition.boxes._messages``: a pair's rows cut into messages of
    at most ``limit`` elements, boxes cut by their rows, rows longer than ``limit`` by their
    columns) executed in place of the plan's rows give the same new partitions, every element
    written once."""
    from ds_dynatrain.transition.boxes import _messages

    old, new = pair
    rng = np.random.default_rng(rnd.randint(0, 2**31))
    full = {p.key: rng.standard_normal(math.prod(p.shape)) for p in old.params}
    members = [f"m{i}" for i in range(old.world_size)]
    joiners = [f"j{i}" for i in range(max(0, new.world_size - old.world_size))]
    new_members, _ = assign_box_members_best(old, new, members, joiners)
    plan = plan_tp_transition(old, new, members, new_members)
    t = plan.table
    pieces = []
    for s_, d_ in sorted({(int(a), int(b)) for a, b in t[:, :2]}):
        for msg in _messages(t[(t[:, 0] == s_) & (t[:, 1] == d_)], limit):
            assert int((msg[:, 9] * msg[:, 10]).sum()) <= limit
            pieces.append(msg)
    cut = SimpleNamespace(new_layout=new, table=np.concatenate(pieces) if pieces else t)
    got, writes = execute(cut, partitions(old, full))
    want, _ = execute(plan, partitions(old, full))
    for r in range(new.world_size):
        for g, w, n in zip(got[r], want[r], writes[r]):
            np.testing.assert_array_equal(g, w)
            assert (n <= 1).all()


def test_largest_tp_layout_keeps_the_tp_degree_where_it_can():
    """A preemption's layout: the most processes whose DP size splits the global batch, at the
    current TP degree where it divides them, else the largest smaller one."""
    from ds_dynatrain.engine.tp_resize import largest_tp_layout

    assert largest_tp_layout(4, 1, 3, 2) == (2, 2)  # TP 2 x DP 1 (3 processes: TP 1 x DP 3 cannot split 4)
    assert largest_tp_layout(6, 1, 3, 2) == (3, 1)  # TP 2 cannot divide 3; TP 1 x DP 3 splits 6
    assert largest_tp_layout(8, 1, 7, 4) == (6, 3)  # 7 only at TP 1 (DP 7 cannot split 8); 6 at TP 3 x DP 2
    assert largest_tp_layout(8, 1, 4, 4) == (4, 4)  # the current degree where it divides
    assert largest_tp_layout(4, 1, 0, 2) == (0, 0)
