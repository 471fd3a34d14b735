"""The pipeline + ZeRO-1 layout and its plan, checked element by element (pure, no process).

Oracle: a rank's flat partitions built straight from the full tensors: its stage's parameters in
``PipelineModule`` order (tied modules first, then layers by index), laid out by
``ZeroLayout.fragments`` (the 1-D layout proven against DeepSpeed in
``tests/test_layout_vs_deepspeed.py``), with no box geometry. A plan is executed on those
partitions as strided copies; every new rank's partitions must equal the oracle's for the new
layout, every element a parameter owns written exactly once. Layer lists, ties, degrees and stage
bounds are drawn by hypothesis. (The stage order and bounds themselves are checked against a real
``PipelineModule`` in ``tests/test_pipeline_layout_vs_deepspeed.py``.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tp_plan import execute

from ds_dynatrain.errors import LayoutMismatchError
from ds_dynatrain.planner.box_plan import assign_box_members_best, kept_upper_bound
from ds_dynatrain.planner.pp_plan import plan_pp_transition
from ds_dynatrain.vps.layout import ParamMeta
from ds_dynatrain.vps.pipeline import PipelineLayer, PipelineLayout, stage_bounds


def _bounds(n: int, pp: int, draw) -> tuple:
    """Stage bounds with at least one layer per stage."""
    if pp == 1:
        return (0, n)
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=pp - 1, max_size=pp - 1, unique=True)))
    return (0, *cuts, n)


@st.composite
def pipelines(draw):
    n = draw(st.integers(1, 7))
    ties = draw(st.lists(st.sampled_from([None, None, "embed", "other"]), min_size=n, max_size=n))
    tie_shapes = {}
    layers = []
    for i, tie in enumerate(ties):
        if tie is not None:
            shape = tie_shapes.setdefault(tie, tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=2))))
            layers.append(PipelineLayer((ParamMeta(f"tied_modules.{tie}.weight", shape, "float32"),), tie))
            continue
        k = draw(st.integers(1, 2))
        shapes = [tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))) for _ in range(k)]
        layers.append(PipelineLayer(tuple(ParamMeta(f"{i}.w{j}", s, "float32") for j, s in enumerate(shapes))))
    keys = sorted({p.key for layer in layers for p in layer.params})
    groups = tuple((k, g) for k in keys if (g := draw(st.integers(0, 2))))  # optimizer groups 1, 2 or 0
    zero = dict(parameter_alignment=draw(st.booleans()), round_robin=draw(st.booleans()), optimizer_groups=groups)
    out = []
    for _ in range(2):
        pp, dp = draw(st.integers(1, min(3, n))), draw(st.integers(1, 3))
        out.append(PipelineLayout(pp, dp, tuple(layers), _bounds(n, pp, draw), **zero))
    return out[0], out[1]


def partitions(layout: PipelineLayout, full: dict) -> list:
    """Oracle: per global rank, its flat partitions (float64 arrays, NaN where padding)."""
    out = [None] * layout.world_size
    for s in range(layout.pp):
        zl = layout.zero(s)
        for d in range(layout.dp):
            parts = [np.full(zl.partition_numel(b), np.nan) for b in range(zl.num_partitions)]
            for f in zl.fragments(d):
                parts[f.group][f.local : f.local + f.numel] = full[f.key][f.start : f.start + f.numel]
            out[layout.rank(s, d)] = parts
    return out


def _run(old, new, joiners=()):
    rng = np.random.default_rng(7)
    full = {p.key: rng.standard_normal(math.prod(p.shape)) for p in old.params}
    members = [f"m{i}" for i in range(old.world_size)]
    joiners = list(joiners) or [f"j{i}" for i in range(max(0, new.world_size - old.world_size))]
    new_members, k = assign_box_members_best(old, new, members, joiners)
    plan = plan_pp_transition(old, new, members, new_members)
    got, writes = execute(plan, partitions(old, full))
    want = partitions(new, full)
    for r in range(new.world_size):
        for b, (g, w, n) in enumerate(zip(got[r], want[r], writes[r])):
            owned = ~np.isnan(w)
            np.testing.assert_array_equal(g[owned], w[owned], err_msg=f"rank {r} partition {b}")
            assert (n[owned] == 1).all() and (n[~owned] == 0).all(), f"rank {r} partition {b}: writes {n}"
    return plan, members, new_members, k


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_plan_moves_every_element_once(pair):
    old, new = pair
    plan, members, new_members, k = _run(old, new)
    kept = sum(int(k[members.index(m), j]) for j, m in enumerate(new_members) if m in members)
    assert plan.numel_kept == kept <= kept_upper_bound(k)
    # a new layout holds each parameter once per stage that holds it
    held = new.holders().sum(axis=1)
    total = sum(math.prod(p.shape) * int(h) for p, h in zip(new.params, held))
    assert plan.numel_kept + plan.numel_moved == total


def _tied_model():
    """Embedding tied to the head, four blocks and a norm (the pipeline tutorial's shape)."""
    embed = ParamMeta("tied_modules.embed.weight", (16, 4), "float32")
    layers = [PipelineLayer((embed,), "embed")]
    for i in range(1, 5):
        layers.append(
            PipelineLayer((ParamMeta(f"{i}.fc.weight", (4, 4), "float32"), ParamMeta(f"{i}.fc.bias", (4,), "float32")))
        )
    layers.append(PipelineLayer((ParamMeta("5.ln.weight", (4,), "float32"),)))
    layers.append(PipelineLayer((embed,), "embed"))
    return tuple(layers)


def test_pp2_to_pp1_moves_only_what_the_other_stage_held():
    """PP 2 -> 1 at world 2: rank 0 (stage 0) keeps the part of its stage the new DP rank 0
    partition covers; the tied embedding is on both stages, so nobody receives it from afar."""
    layers = _tied_model()
    old = PipelineLayout(2, 1, layers, (0, 3, 7))
    new = PipelineLayout(1, 2, layers, (0, 7))
    plan, _, new_members, _ = _run(old, new)
    assert new_members == ("m0", "m1")
    embed = next(i for i, p in enumerate(new.params) if p.key.startswith("tied"))
    moved = plan.table[~plan.keep_mask]
    assert not (moved[:, 2] == embed).any()  # both old stages held a copy: each new rank keeps its own


def test_tied_weight_goes_only_to_newly_owning_stages():
    layers = _tied_model()
    old = PipelineLayout(1, 2, layers, (0, 7))
    new = PipelineLayout(2, 1, layers, (0, 3, 7))
    plan, _, _, _ = _run(old, new)
    assert old.replicated().sum() == 0 and new.replicated().sum() == 1


@st.composite
def with_empty_layers(draw):
    """A layout of :func:`pipelines` with parameterless layers inserted anywhere (the bounds
    moved with the layers they held)."""
    layout, _ = draw(pipelines())
    at = draw(st.lists(st.integers(0, len(layout.layers)), max_size=4))
    layers, bounds = [], [0]
    for i, layer in enumerate(layout.layers):
        layers += [PipelineLayer(())] * at.count(i)
        if i in layout.parts[1:-1]:  # the empty layers just before a bound: some on either side
            bounds.append(len(layers) - draw(st.integers(0, at.count(i))))
        layers.append(layer)
    layers += [PipelineLayer(())] * at.count(len(layout.layers))
    return PipelineLayout(layout.pp, layout.dp, tuple(layers), (*bounds, len(layers)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(with_empty_layers())
def test_stage_bounds_read_back_from_the_stages_parameters(layout):
    """The split a saved pipeline's stages record (each stage's parameter names, in order) gives
    back stage bounds under which every stage holds exactly those parameters; bounds that differ
    only where parameterless layers lie give the same stages."""
    keys = [[p.key for g in layout.zero(s).groups for p in g] for s in range(layout.pp)]  # group by group
    parts = stage_bounds(layout.layers, keys, layout.optimizer_groups)
    found = layout.with_degrees(layout.pp, layout.dp, parts)
    assert [[p.key for g in found.zero(s).groups for p in g] for s in range(layout.pp)] == keys
    assert parts[0] == 0 and parts[-1] == len(layout.layers)
    assert all(parts[s] <= layout.parts[s] for s in range(layout.pp))  # the earliest split


def test_stage_bounds_refuse_what_no_split_gives():
    layers = tuple(PipelineLayer((ParamMeta(f"{i}.w", (2, 2), "float32"),)) for i in range(4))
    assert stage_bounds(layers, [["0.w", "1.w"], ["2.w", "3.w"]]) == (0, 2, 4)
    with pytest.raises(LayoutMismatchError, match="stage 1's parameter 9.w is not a parameter"):
        stage_bounds(layers, [["0.w", "1.w"], ["2.w", "9.w"]])
    with pytest.raises(LayoutMismatchError, match="parameter 3.w of the model is in no stage"):
        stage_bounds(layers, [["0.w", "1.w"], ["2.w"]])
    with pytest.raises(LayoutMismatchError, match="no split of the 4 layers into 2 stages gives stage 0"):
        stage_bounds(layers, [["2.w", "3.w"], ["0.w", "1.w"]])
    with pytest.raises(LayoutMismatchError, match="gives stage 0"):
        stage_bounds(layers, [["0.w", "2.w"], ["1.w", "3.w"]])  # not contiguous
    with pytest.raises(LayoutMismatchError, match="gives stage 1"):
        stage_bounds(layers, [["0.w"], ["3.w", "1.w", "2.w"]])  # another order
    # with optimizer groups, a stage lists them one after the other
    assert stage_bounds(layers, [["0.w"], ["2.w", "1.w", "3.w"]], (("1.w", 1), ("3.w", 1))) == (0, 1, 4)


def test_bad_bounds_and_models_are_refused():
    layers = _tied_model()
    with pytest.raises(LayoutMismatchError, match="do not split 7 layers into 2 stages"):
        PipelineLayout(2, 1, layers, (0, 7))
    with pytest.raises(LayoutMismatchError, match="stage 1 holds no layer"):
        PipelineLayout(3, 1, layers, (0, 5, 3, 7))
    other = layers[:-1] + (PipelineLayer((ParamMeta("6.x", (2,), "float32"),)),)
    with pytest.raises(LayoutMismatchError, match="different"):
        plan_pp_transition(
            PipelineLayout(1, 2, layers, (0, 7)), PipelineLayout(1, 2, other, (0, 7)), ["a", "b"], ["a", "b"]
        )
    clash = layers + (PipelineLayer((ParamMeta("tied_modules.embed.weight", (3, 3), "float32"),), "embed"),)
    with pytest.raises(LayoutMismatchError, match="two layers give it"):
        PipelineLayout(1, 1, clash, (0, 8))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_plan_cli_with_pipeline_degrees(tmp_path, capsys, tied):
    """``dynatrain plan --pipeline-parallel-from/--pipeline-parallel-to`` on a small Llama config
    seen as a pipeline (embedding, 4 decoder layers, norm, head): the bytes add up to the state
    (a tied embedding/head once per stage holding it), every old rank sends what the new ranks
    receive, the kept bytes reach the upper bound, and impossible layouts are refused with the
    reason and exit status 2."""
    import json

    from ds_dynatrain.cli import main as cli_main

    h, f, v, n = 32, 64, 96, 4
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "head_dim": 8,
        "intermediate_size": f,
        "num_hidden_layers": n,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": v,
        "tie_word_embeddings": tied,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))

    def plan(*args):
        capsys.readouterr()
        rc = cli_main(["plan", "--model-config", str(path), *args])
        out = capsys.readouterr()
        return rc, out.out, out.err

    block = h * h + 2 * 16 * h + h * h + 3 * h * f + 2 * h  # attention, MLP, two norms
    params = n * block + h + v * h * (1 if tied else 2)
    rc, out, err = plan("--from", "2", "--to", "2", "--pipeline-parallel-from", "2", "--pipeline-parallel-to", "1")
    assert rc == 0, err
    assert "PP 2 x DP 1 -> PP 1 x DP 2 (2 -> 2 ranks)" in out
    rc, out, err = plan(
        "--from", "2", "--to", "4", "--pipeline-parallel-from", "1", "--pipeline-parallel-to", "2", "--json"
    )
    assert rc == 0, err
    rep = json.loads(out.strip().splitlines()[-1])
    assert rep["parameters"] == params and rep["zero_stage"] == 1
    assert rep["stage_bounds_from"] == [0, n + 3] and len(rep["stage_bounds_to"]) == 3
    copies = params + (v * h if tied else 0)  # PP 2: the tied pair on the first and the last stage
    assert rep["bytes_moved"] + rep["bytes_kept"] == 12 * copies
    assert rep["bytes_kept"] == rep["bytes_kept_upper_bound"] > 0
    assert sum(r["bytes_received"] for r in rep["ranks"]) == rep["bytes_moved"]
    assert sum(r["bytes_sent"] for r in rep["ranks"]) == rep["bytes_moved"]
    refusals = [
        (
            ["--from", "4", "--to", "3", "--pipeline-parallel-from", "2", "--pipeline-parallel-to", "2"],
            "PP degree 2 does not divide world size 3",
        ),
        (
            ["--from", "8", "--to", "8", "--pipeline-parallel-from", "8", "--pipeline-parallel-to", "8"],
            "PP degree 8: the pipeline has 7 layers",
        ),
        (["--from", "2", "--to", "2", "--pipeline-parallel-to", "2", "--zero-stage", "2"], "ZeRO-1"),
        (["--from", "2", "--to", "2", "--pipeline-parallel-to", "2", "--tensor-parallel-to", "2"], "one of the two"),
        (
            ["--from", "2", "--to", "2", "--pipeline-parallel-to", "2", "--partition-method", "profile"],
            "partition method 'profile'",
        ),
    ]
    for args, words in refusals:
        rc, _, err = plan(*args)
        assert rc == 2 and words in err, (args, err)


def test_a_stage_without_an_optimizer_group_the_others_hold_is_refused():
    """DeepSpeed's ZeRO-1 reduces each optimizer group's gradient norm over the stages: a split
    leaving a stage without a group the others hold would hang the next step, so it is refused."""
    from ds_dynatrain.engine.pp_switch import check_stage_groups

    layers = tuple(PipelineLayer((ParamMeta(f"{i}.w", (2, 2), "float32"),)) for i in range(4))
    one = PipelineLayout(2, 1, layers, (0, 2, 4), optimizer_groups=(("1.w", 1), ("3.w", 1)))
    check_stage_groups(one)  # both stages hold groups 0 and 1
    other = one.with_degrees(2, 1, (0, 1, 4))
    with pytest.raises(
        LayoutMismatchError, match=r"stage 1 holds parameters of optimizer groups \[0, 1\] and stage 0 of \[0\]"
    ):
        check_stage_groups(other)
    assert [p.key for p in other.zero(1).groups[1]] == ["1.w", "3.w"]  # group by group, in module order
