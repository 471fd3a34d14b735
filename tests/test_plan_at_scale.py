"""The vectorised planner (``ds_dynatrain.planner.intersect``, ``ZeroLayout.fragment_table``)
against the reference it replaced, and the geometry of a 405 B-parameter model at thousands of
ranks.

The reference is the planner as it was written first: per parameter, a merge of the two sorted
lists of fragments (``ZeroLayout.pieces``, independent of the fragment table) into raw tuples,
sorted and merged in Python. The fast path must give the same transfers, row for row, in the
same order, on random layouts (ZeRO-1/2 with round robin and alignment, ZeRO-3 with sub-groups,
and plans between a stage-3 and a stage-2 layout as a resharded load makes them).
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_dynatrain.planner import Plan, Transfer, plan_transition
from ds_dynatrain.planner.intersect import shared_transfer_table, transfer_table
from ds_dynatrain.transition.schedule import (
    chunk_ranges,
    exchanges,
    next_pow2,
    peer_at,
    stream_sizes,
    transition_ranks,
)
from ds_dynatrain.vps.layout import ParamMeta, ZeroLayout

# ---------------------------------------------------------------- the reference planner


def reference_transfers(old, new):
    raw = []
    for gi, params in enumerate(old.groups):
        for p in params:
            a, b = old.pieces(gi, p.key), new.pieces(gi, p.key)
            i = j = 0
            while i < len(a) and j < len(b):
                ra, ba, sa, na, la = a[i]
                rb, bb, sb, nb, lb = b[j]
                lo, hi = max(sa, sb), min(sa + na, sb + nb)
                if lo < hi:
                    raw.append((ra, rb, ba, la + lo - sa, lb + lo - sb, hi - lo, bb))
                if sa + na <= sb + nb:
                    i += 1
                else:
                    j += 1
    raw.sort()
    out = []
    for t in raw:
        if out:
            p = out[-1]
            if (p[0], p[1], p[2], p[6]) == (t[0], t[1], t[2], t[6]) and p[3] + p[5] == t[3] and p[4] + p[5] == t[4]:
                p[5] += t[5]
                continue
        out.append(list(t))
    return tuple(Transfer(*t) for t in out)


@st.composite
def layouts(draw):
    """Two layouts of one random model: world sizes 1-9; stage 2 (round robin, alignment) or
    3 (sub-group size); the second at the same stage or, one time in four, the other one."""
    groups, k = [], 0
    for gi in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(["float32", "bfloat16"]))
        params = []
        for _ in range(draw(st.integers(1, 6))):
            shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
            params.append(ParamMeta(f"g{gi}.p{k}", shape, dtype))
            k += 1
        groups.append(tuple(params))
    groups = tuple(groups)

    def one(stage):
        if stage == 3:
            return dict(stage=3, sub_group_size=draw(st.sampled_from([1, 5, 40, 10**9])))
        return dict(stage=2, round_robin=draw(st.booleans()), parameter_alignment=draw(st.booleans()))

    s_old = draw(st.sampled_from([2, 3]))
    s_new = draw(st.sampled_from([s_old, s_old, s_old, 5 - s_old]))
    old = ZeroLayout(draw(st.integers(1, 9)), groups, **one(s_old))
    return old, ZeroLayout(draw(st.integers(1, 9)), groups, **one(s_new))


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_fast_plan_equals_the_reference(pair):
    old, new = pair
    members = tuple(f"m{i}" for i in range(old.world_size))
    news = tuple(f"n{i}" for i in range(new.world_size))
    plan = plan_transition(old, new, members, news, same_settings=False)
    assert plan.transfers == reference_transfers(old, new)
    again = transfer_table(old, new)  # not the remembered one
    assert np.array_equal(again, plan.table) and again.dtype == np.int64


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_fragment_table_holds_the_fragments_of_every_rank(pair):
    for layout in pair:
        t = layout.fragment_table()
        keys = [p.key for g in layout.groups for p in g]
        got = sorted(
            (int(r), int(b), keys[int(i)], int(s), int(n), int(lo))
            for i, r, b, s, n, lo in zip(t.param, t.rank, t.partition, t.start, t.numel, t.local)
        )
        ranks = range(layout.world_size)
        want = sorted((r, f.group, f.key, f.start, f.numel, f.local) for r in ranks for f in layout.fragments(r))
        assert got == want
        # rows in parameter order, then by start: the fragments of each parameter tile it
        numel = layout.param_numels()
        for i, n in enumerate(numel):
            rows = t.param == i
            starts, sizes = t.start[rows], t.numel[rows]
            assert starts[0] == 0 and (starts[1:] == (starts + sizes)[:-1]).all() and starts[-1] + sizes[-1] == n


def test_remembered_table_is_read_only_and_keyed_by_the_layouts():
    g = ((ParamMeta("a", (7, 3), "float32"), ParamMeta("b", (5,), "float32")),)
    old, new = ZeroLayout(3, g, stage=3), ZeroLayout(2, g, stage=3)
    t = shared_transfer_table(old, new)
    assert shared_transfer_table(ZeroLayout(3, g, stage=3), ZeroLayout(2, g, stage=3)) is t  # equal layouts hit
    with pytest.raises(ValueError, match="read-only"):
        t[0, 0] = 1
    assert not np.array_equal(shared_transfer_table(new, old), t)


def test_plan_refuses_a_table_of_the_wrong_shape():
    g = ((ParamMeta("a", (5,), "float32"),),)
    with pytest.raises(ValueError, match="7 columns"):
        Plan(ZeroLayout(1, g), ZeroLayout(1, g), ("m0",), ("m0",), np.zeros((2, 6), dtype=np.int64))


# ---------------------------------------------------------------- the XOR schedule


def test_exchanges_are_the_step_loop_of_the_engine():
    """``exchanges`` equals the loop the transition engine ran before (every step 1..,
    peer = rank XOR step, skipped when the peer has nothing either way), for every process."""
    rnd = np.random.default_rng(3)
    for _ in range(40):
        shapes = [tuple(int(x) for x in rnd.integers(1, 30, size=rnd.integers(1, 3))) for _ in range(4)]
        g = (tuple(ParamMeta(f"p{i}", s, "float32") for i, s in enumerate(shapes)),)
        a, b = (int(x) for x in rnd.integers(1, 11, size=2))
        old = ZeroLayout(a, g, stage=int(rnd.choice([2, 3])))
        olds = tuple(f"m{i}" for i in range(a))
        pool = list(olds) + [f"j{i}" for i in range(b)]
        news = tuple(str(x) for x in rnd.permutation(pool)[:b])
        plan = plan_transition(old, old.with_world_size(b), olds, news)
        ranks = transition_ranks(plan)
        for me, m in enumerate(ranks):
            sends, recvs = plan.sends_of(m), plan.receives_of(m)
            want = []
            for step in range(1, next_pow2(len(ranks))):
                p = peer_at(me, step, len(ranks))
                if p is not None and (ranks[p] in sends or ranks[p] in recvs):
                    want.append((step, p, ranks[p], sends.get(ranks[p], []), recvs.get(ranks[p], [])))
            assert [tuple(e) for e in exchanges(plan, m, ranks)] == want


def test_chunk_ranges_hand_cases():
    assert chunk_ranges([3, 3, 3], 7) == [(0, 6), (6, 9)]  # small slices packed, never over the bound
    assert chunk_ranges([10], 4) == [(0, 4), (4, 8), (8, 10)]  # a large slice cut in pieces
    assert chunk_ranges([2, 9, 1], 4) == [(0, 2), (2, 6), (6, 10), (10, 12)]
    assert chunk_ranges([], 4) == []
    t = Transfer(0, 1, 0, 0, 0, 5)
    assert stream_sizes([t, t._replace(numel=2)], 3) == [5, 5, 5, 2, 2, 2]


# ---------------------------------------------------------------- a 405 B model at thousands of ranks


def llama3_405b_metas():
    """The trainable parameters of a Llama-3-405B-shaped model (126 layers, hidden 16384, 128
    heads of 128, 8 KV heads, MLP 53248, vocabulary 128256, untied head), written from the
    architecture (not read from a model)."""
    h, kv, mlp, vocab = 16384, 8 * 128, 53248, 128256
    out = [ParamMeta("embed", (vocab, h), "bfloat16")]
    for i in range(126):
        for name, shape in (
            ("q", (h, h)),
            ("k", (kv, h)),
            ("v", (kv, h)),
            ("o", (h, h)),
            ("gate", (mlp, h)),
            ("up", (mlp, h)),
            ("down", (h, mlp)),
            ("norm1", (h,)),
            ("norm2", (h,)),
        ):
            out.append(ParamMeta(f"l{i}.{name}", shape, "bfloat16"))
    return tuple(out + [ParamMeta("norm", (h,), "bfloat16"), ParamMeta("lm_head", (vocab, h), "bfloat16")])


@pytest.mark.parametrize("world_size", [960, 1024, 3072, 4096])
def test_zero3_fragments_of_a_405b_model(world_size):
    """Every parameter is partitioned over all ranks: each rank's partition holds a piece of
    ``ceil(numel / world_size)`` elements of every parameter (padding included), and the ranks
    whose piece starts before the parameter's end hold a fragment of it."""
    metas = llama3_405b_metas()
    numel = [math.prod(p.shape) for p in metas]
    assert sum(numel) == 405_853_388_800
    layout = ZeroLayout(world_size, (metas,), stage=3)
    t = layout.fragment_table()
    pieces = [-(-n // world_size) for n in numel]
    holders = [sum(1 for r in range(world_size) if r * k < n) for n, k in zip(numel, pieces)]
    assert len(t.rank) == sum(holders)
    assert np.bincount(t.param, minlength=len(metas)).tolist() == holders
    assert int(t.numel.sum()) == sum(numel)
    assert layout.num_partitions == 1 and layout.partition_numel(0) == sum(pieces)
    # the matrices (>= 16.7 M elements) reach every rank; only the norms leave ranks empty
    assert all(h == world_size for h, n in zip(holders, numel) if n >= 1 << 24)
