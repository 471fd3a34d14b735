"""ZeRO-1/2/3 layouts (``ds_dynatrain.vps.layout``) and the routing planner (``ds_dynatrain.planner``).

Pure metadata: no process group, no engine. The oracle is an element-level model of DeepSpeed's flat
partitions written independently of the interval arithmetic under test: every parameter element gets
a unique id (> 0), and each rank's flat partition is the list of the ids it holds with 0 for padding
(stages 1/2: the group in flat order cut in equal slices; stage 3: each parameter cut in equal
pieces, the pieces of a sub-group concatenated). A plan is checked by *executing* it on such
partitions.
"""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_dynatrain.errors import DynatrainError, LayoutMismatchError
from ds_dynatrain.planner import PLAN_FORMAT_VERSION, Plan, Transfer, assign_members, plan_transition
from ds_dynatrain.vps.layout import Fragment, ParamMeta, ZeroLayout, round_robin_order
from ds_dynatrain.vps.region import Region

DTYPE_ELEMENT_SIZE = {"float32": 4, "bfloat16": 2}


# ---------------------------------------------------------------- generated models


@st.composite
def models(draw):
    """``(groups, settings)``: 1-4 groups of 1-6 parameters, 1-3 dims each; ``settings`` the ZeRO
    keyword arguments of :class:`ZeroLayout` (stage 2 or 3, round robin, alignment, sub-group size)."""
    groups, k = [], 0
    for gi in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(sorted(DTYPE_ELEMENT_SIZE)))  # one dtype per flat group, as DeepSpeed has
        params = []
        for _ in range(draw(st.integers(1, 6))):
            shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
            params.append(ParamMeta(f"g{gi}.p{k}.weight", shape, dtype))
            k += 1
        groups.append(tuple(params))
    stage = draw(st.sampled_from([2, 3]))
    kw = dict(round_robin=draw(st.booleans()), parameter_alignment=draw(st.booleans()), stage=stage)
    if stage == 3:
        kw = dict(stage=3, sub_group_size=draw(st.sampled_from([1, 3, 8, 30, 10**9])))
    return tuple(groups), kw


world_sizes = st.integers(1, 8)


def member_names(prefix, n):
    return tuple(f"{prefix}{i}" for i in range(n))


# ---------------------------------------------------------------- the element-level oracle


def element_ids(groups):
    """``{(group, key): ids}``: a unique id per parameter element, numbered from 1 in model order."""
    out, nxt = {}, 1
    for gi, params in enumerate(groups):
        for p in params:
            n = math.prod(p.shape)
            out[(gi, p.key)] = np.arange(nxt, nxt + n, dtype=np.int64)
            nxt += n
    return out, nxt


def oracle_partitions(groups, world_size, round_robin=False, parameter_alignment=False, stage=2, sub_group_size=10**9):
    """Per partition, a ``(world_size, P)`` array: the ids each rank holds in it (0 = padding).

    Written from DeepSpeed's rules (``stage_1_and_2.py``), element by element: round robin puts
    parameter ``i`` in bucket ``i % world_size`` (buckets in order); with alignment each parameter but
    the last is padded to 16 bytes (4 float32 or 8 bfloat16 elements); the group is padded to a
    multiple of 2 * world_size and cut into equal slices."""
    ids, _ = element_ids(groups)
    if stage == 3:
        return oracle_partitions_zero3(groups, ids, world_size, sub_group_size)
    parts = []
    for gi, params in enumerate(groups):
        order = list(range(len(params)))
        if round_robin:
            order = [i for b in range(world_size) for i in range(len(params)) if i % world_size == b]
        align = 16 // DTYPE_ELEMENT_SIZE[params[0].dtype] if parameter_alignment else 1
        flat = []
        for n, i in enumerate(order):
            flat.extend(ids[(gi, params[i].key)].tolist())
            if n != len(order) - 1:
                while len(flat) % align:
                    flat.append(0)
        while len(flat) % (2 * world_size):
            flat.append(0)
        parts.append(np.asarray(flat, dtype=np.int64).reshape(world_size, -1))
    return parts


def oracle_partitions_zero3(groups, ids, world_size, sub_group_size):
    """Stage 3 (``partition_parameters.py``, ``stage3.py`` ``_create_fp16_sub_groups``): each
    parameter padded with zeros to a multiple of the world size and cut in equal pieces; a
    parameter group's parameters taken in order into sub-groups, closing one when its pieces reach
    ``sub_group_size`` elements (one sub-group when the whole group's pieces fit); a rank's
    partition of a sub-group is its pieces, concatenated."""
    parts = []
    for gi, params in enumerate(groups):
        pieces = []
        for p in params:
            v = ids[(gi, p.key)].tolist()
            v += [0] * ((-len(v)) % world_size)
            pieces.append(np.asarray(v, dtype=np.int64).reshape(world_size, -1))
        if sum(x.shape[1] for x in pieces) <= sub_group_size:
            cut = [pieces]
        else:
            cut, cur = [], []
            for x in pieces:
                cur.append(x)
                if sum(y.shape[1] for y in cur) >= sub_group_size:
                    cut.append(cur)
                    cur = []
            if cur:
                cut.append(cur)
        parts.extend(np.concatenate(c, axis=1) for c in cut)
    return parts


def holder_rank(parts, total_ids):
    """``rank_of[id]``: the rank holding element ``id`` (-1 for ids nobody holds)."""
    rank_of = np.full(total_ids, -1, dtype=np.int64)
    for part in parts:
        for r in range(part.shape[0]):
            held = part[r][part[r] > 0]
            assert (rank_of[held] == -1).all(), "an element is held twice"
            rank_of[held] = r
    return rank_of


# ---------------------------------------------------------------- (1) layouts tile every parameter


@settings(max_examples=150, deadline=None)
@given(models(), world_sizes)
def test_layout_tiles_every_parameter(model, ws):
    groups, kw = model
    layout = ZeroLayout(ws, groups, **kw)
    parts = oracle_partitions(groups, ws, **kw)
    ids, total = element_ids(groups)
    ids_by_key = {key: v for (_, key), v in ids.items()}
    held = np.zeros(total, dtype=np.int64)
    assert layout.num_partitions == len(parts)
    for b in range(layout.num_partitions):
        P = layout.partition_numel(b)
        assert P == parts[b].shape[1]
        if kw["stage"] != 3:
            assert (P * ws) % (2 * ws) == 0
    for r in range(ws):
        frags = layout.fragments(r)
        assert list(frags) == sorted(frags, key=lambda f: (f.group, f.local))
        for b in range(layout.num_partitions):
            P = layout.partition_numel(b)
            expected = np.zeros(P, dtype=np.int64)  # this rank's partition rebuilt from its fragments
            for f in (f for f in frags if f.group == b):
                assert f.numel > 0 and 0 <= f.local and f.local + f.numel <= P
                assert (expected[f.local : f.local + f.numel] == 0).all(), "fragments overlap"
                pid = ids_by_key[f.key]
                assert 0 <= f.start and f.start + f.numel <= pid.size
                expected[f.local : f.local + f.numel] = pid[f.start : f.start + f.numel]
                held[pid[f.start : f.start + f.numel]] += 1
            # exactly the oracle's partition: no padding inside a fragment, nothing missing
            assert expected.tolist() == parts[b][r].tolist()
    assert (held[1:] == 1).all(), "every element is held by exactly one rank"
    # the per-parameter view and the regions agree with the per-rank view
    for gi, params in enumerate(groups):
        for p in params:
            pf = layout.param_fragments(gi, p.key)
            assert [r for r, _ in pf] == sorted(r for r, _ in pf)
            assert sum(f.numel for _, f in pf) == math.prod(p.shape)
            cursor = 0
            for r, f in pf:
                assert f.start == cursor and f.key == p.key and layout.partition_group(f.group) == gi
                assert f in layout.fragments(r)
                cursor += f.numel
            for r in range(ws):
                on_rank = set(v for part in parts for v in part[r].tolist())
                want = [i for i, v in enumerate(ids[(gi, p.key)].tolist()) if v in on_rank]
                assert layout.region(r, p.key) == Region.from_intervals((i, i + 1) for i in want)
    assert ZeroLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout


def test_layout_hand_oracle_round_robin():
    """Sizes 3, 2, 4 (float32): at world size 2 round robin orders them p0, p2, p1 -> 9 elements,
    padded to 12, partitions of 6; at world size 3 the order is p0, p1, p2, partitions of 4."""
    g = ((ParamMeta("p0", (3,), "float32"), ParamMeta("p1", (2,), "float32"), ParamMeta("p2", (2, 2), "float32")),)
    two = ZeroLayout(2, g, round_robin=True)
    assert two.partition_numel(0) == 6
    assert two.fragments(0) == (Fragment(0, "p0", 0, 3, 0), Fragment(0, "p2", 0, 3, 3))
    assert two.fragments(1) == (Fragment(0, "p2", 3, 1, 0), Fragment(0, "p1", 0, 2, 1))
    three = two.with_world_size(3)
    assert three.partition_numel(0) == 4
    assert three.fragments(0) == (Fragment(0, "p0", 0, 3, 0), Fragment(0, "p1", 0, 1, 3))
    assert three.fragments(1) == (Fragment(0, "p1", 1, 1, 0), Fragment(0, "p2", 0, 3, 1))
    assert three.fragments(2) == (Fragment(0, "p2", 3, 1, 0),)
    assert round_robin_order(5, 2) == [0, 2, 4, 1, 3]
    assert round_robin_order(3, 8) == [0, 1, 2]


def test_layout_hand_oracle_alignment():
    """Sizes 5 and 3 (float32) with parameter_alignment: 5 is padded to 8 (16 bytes = 4 elements),
    the last parameter is not padded (11), the group is padded to 12."""
    g = ((ParamMeta("a", (5,), "float32"), ParamMeta("b", (3,), "float32")),)
    two = ZeroLayout(2, g, parameter_alignment=True)
    assert two.partition_numel(0) == 6
    assert two.fragments(0) == (Fragment(0, "a", 0, 5, 0),)
    assert two.fragments(1) == (Fragment(0, "b", 0, 3, 2),)
    # bfloat16 aligns to 8 elements: a at 0..5, b at 8..11, padded to 12 at world size 3
    gb = ((ParamMeta("a", (5,), "bfloat16"), ParamMeta("b", (3,), "bfloat16")),)
    three = ZeroLayout(3, gb, parameter_alignment=True)
    assert three.partition_numel(0) == 4
    assert [three.fragments(r) for r in range(3)] == [
        (Fragment(0, "a", 0, 4, 0),),
        (Fragment(0, "a", 4, 1, 0),),
        (Fragment(0, "b", 0, 3, 0),),
    ]


def test_layout_refusals():
    g = ((ParamMeta("a", (5,), "float32"),),)
    with pytest.raises(ValueError, match="world size must be >= 1"):
        ZeroLayout(0, g)
    with pytest.raises(ValueError, match="parameter group 1 has no trainable parameter"):
        ZeroLayout(2, g + ((),))
    with pytest.raises(ValueError, match="stages 1, 2 and 3"):
        ZeroLayout(2, g, stage=4)
    with pytest.raises(ValueError, match="rank 2 outside world size 2"):
        ZeroLayout(2, g).fragments(2)
    with pytest.raises(KeyError, match="'b'"):
        ZeroLayout(2, g).param_fragments(0, "b")


@pytest.mark.parametrize(
    "groups",
    [
        ((ParamMeta("w", (3,), "float32"), ParamMeta("w", (5,), "float32")),),  # twice in one group
        ((ParamMeta("w", (3,), "float32"),), (ParamMeta("w", (3,), "float32"),)),  # in two groups
    ],
)
def test_layout_refuses_duplicate_keys(groups):
    """A VPS key names one logical tensor; a repeated key would make the planner route the first
    parameter twice and the second never (a silent wrong result), so the layout refuses it."""
    with pytest.raises(ValueError, match="parameter w appears twice in the layout"):
        ZeroLayout(2, groups)
    with pytest.raises(ValueError, match="appears twice"):
        ZeroLayout.from_dict(
            {
                "world_size": 1,
                "stage": 2,
                "round_robin": False,
                "parameter_alignment": False,
                "groups": [[p.to_dict() for p in g] for g in groups],
            }
        )


# ---------------------------------------------------------------- (2), (3) plans, executed


def execute(plan, old_parts, new_shapes):
    """Apply every transfer of ``plan`` to copies of the old partitions; count writes per position."""
    new_parts = [np.zeros(s, dtype=np.int64) for s in new_shapes]
    writes = [np.zeros(s, dtype=np.int64) for s in new_shapes]
    for t in plan.transfers:
        src = old_parts[t.group][t.src, t.src_offset : t.src_offset + t.numel]
        assert src.size == t.numel, f"{t} reads past the old partition"
        assert (src > 0).all(), f"{t} carries padding"
        dst = slice(t.dst_offset, t.dst_offset + t.numel)
        assert t.dst_offset + t.numel <= new_shapes[t.dst_group][1], f"{t} writes past the new partition"
        new_parts[t.dst_group][t.dst, dst] = src
        writes[t.dst_group][t.dst, dst] += 1
    return new_parts, writes


def check_plan(groups, kw, old_ws, new_ws, old_members, new_members):
    old = ZeroLayout(old_ws, groups, **kw)
    new = ZeroLayout(new_ws, groups, **kw)
    plan = plan_transition(old, new, old_members, new_members)
    old_parts = oracle_partitions(groups, old_ws, **kw)
    new_parts = oracle_partitions(groups, new_ws, **kw)
    _, total = element_ids(groups)

    # (2) every element of the new layout arrives exactly once, with the value its old holder had
    got, writes = execute(plan, old_parts, [p.shape for p in new_parts])
    for b in range(len(new_parts)):
        assert got[b].tolist() == new_parts[b].tolist()
        assert (writes[b] == (new_parts[b] > 0)).all(), "an element is received twice or never; padding written"
    assert all(t.numel > 0 for t in plan.transfers)
    assert list(plan.transfers) == sorted(plan.transfers)

    # (3) keeps: an element staying on the same process never travels in a non-keep transfer
    old_rank, new_rank = holder_rank(old_parts, total), holder_rank(new_parts, total)
    same_process = np.zeros(total, dtype=bool)
    same_process[1:] = np.array(old_members)[old_rank[1:]] == np.array(new_members)[new_rank[1:]]
    carried_by_keep = np.zeros(total, dtype=bool)
    for t in plan.transfers:
        carried = old_parts[t.group][t.src, t.src_offset : t.src_offset + t.numel]
        assert (old_rank[carried] == t.src).all() and (new_rank[carried] == t.dst).all()
        assert plan.is_keep(t) == (old_members[t.src] == new_members[t.dst])
        if plan.is_keep(t):
            carried_by_keep[carried] = True
        else:
            assert not same_process[carried].any(), f"{t} moves elements that stay on their process"
    assert (carried_by_keep == same_process).all()
    assert plan.numel_kept == int(same_process.sum())
    assert plan.numel_kept + plan.numel_moved == total - 1

    # the per-member views partition the transfers
    members = set(old_members) | set(new_members)
    sends = [t for m in members for ts in plan.sends_of(m).values() for t in ts]
    recvs = [t for m in members for ts in plan.receives_of(m).values() for t in ts]
    keeps = [t for m in members for t in plan.keeps_of(m)]
    non_keeps = sorted(t for t in plan.transfers if not plan.is_keep(t))
    assert sorted(sends) == non_keeps and sorted(recvs) == non_keeps
    assert sorted(keeps) == sorted(t for t in plan.transfers if plan.is_keep(t))
    for m in members:
        for peer, ts in plan.sends_of(m).items():
            assert all(old_members[t.src] == m and new_members[t.dst] == peer for t in ts)
        for peer, ts in plan.receives_of(m).items():
            assert all(new_members[t.dst] == m and old_members[t.src] == peer for t in ts)
    assert plan.joiners == tuple(m for m in new_members if m not in old_members)
    assert plan.leavers == tuple(m for m in old_members if m not in new_members)
    return plan


@settings(max_examples=250, deadline=None)
@given(models(), world_sizes, world_sizes, st.permutations(member_names("m", 8)))
def test_plan_executes_to_the_new_layout(model, old_ws, new_ws, names):
    groups, kw = model
    old_members = tuple(names[:old_ws])
    new_members = assign_members(old_members, new_ws, member_names("join", max(0, new_ws - old_ws)))
    check_plan(groups, kw, old_ws, new_ws, old_members, new_members)


@settings(max_examples=100, deadline=None)
@given(models(), world_sizes, world_sizes, st.permutations(member_names("m", 16)), st.data())
def test_plan_with_any_rank_assignment(model, old_ws, new_ws, names, data):
    """Ranks reassigned arbitrarily (survivors change rank, joiners anywhere): still exact."""
    groups, kw = model
    old_members = tuple(names[:old_ws])
    new_members = tuple(data.draw(st.permutations(names[: old_ws + new_ws]))[:new_ws])
    check_plan(groups, kw, old_ws, new_ws, old_members, new_members)


def test_plan_same_world_size_is_all_keeps():
    g = ((ParamMeta("a", (5, 3), "float32"), ParamMeta("b", (7,), "float32")), (ParamMeta("c", (2, 2, 2), "bfloat16"),))
    members = member_names("m", 3)
    plan = plan_transition(ZeroLayout(3, g, True, True), ZeroLayout(3, g, True, True), members, members)
    assert all(plan.is_keep(t) and t.src == t.dst and t.src_offset == t.dst_offset for t in plan.transfers)
    assert plan.numel_moved == 0 and plan.numel_kept == 15 + 7 + 8


# ---------------------------------------------------------------- (4) determinism, serialisation


@settings(max_examples=100, deadline=None)
@given(models(), world_sizes, world_sizes, st.data())
def test_plan_is_deterministic_and_round_trips(model, old_ws, new_ws, data):
    groups, kw = model
    old_members = member_names("m", old_ws)
    new_members = assign_members(old_members, new_ws, member_names("j", max(0, new_ws - old_ws)))
    plan = plan_transition(ZeroLayout(old_ws, groups, **kw), ZeroLayout(new_ws, groups, **kw), old_members, new_members)
    again = plan_transition(
        ZeroLayout(old_ws, groups, **kw), ZeroLayout(new_ws, groups, **kw), list(old_members), list(new_members)
    )
    assert again == plan and again.digest() == plan.digest()

    # the same metadata, shuffled and put back in place from fresh objects (as another rank would)
    flat = [(gi, pi, p.to_dict()) for gi, ps in enumerate(groups) for pi, p in enumerate(ps)]
    shuffled = data.draw(st.permutations(flat))
    restored = tuple(
        tuple(ParamMeta.from_dict(d) for gj, _, d in sorted(shuffled, key=lambda x: x[:2]) if gj == gi)
        for gi in range(len(groups))
    )
    other = plan_transition(
        ZeroLayout(old_ws, restored, **kw), ZeroLayout(new_ws, restored, **kw), old_members, new_members
    )
    assert other == plan and other.digest() == plan.digest()

    # to_dict / from_dict, through JSON text
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan and back.digest() == plan.digest()
    assert back.old_layout == plan.old_layout and back.new_layout == plan.new_layout

    # the digest is not blind to who holds what
    if old_ws > 1:
        swapped = (old_members[1], old_members[0]) + old_members[2:]
        assert plan_transition(plan.old_layout, plan.new_layout, swapped, new_members).digest() != plan.digest()


def test_plan_from_dict_refuses_other_versions():
    g = ((ParamMeta("a", (5,), "float32"),),)
    d = plan_transition(ZeroLayout(1, g), ZeroLayout(1, g), ("m0",), ("m0",)).to_dict()
    assert d["version"] == PLAN_FORMAT_VERSION
    d["version"] = PLAN_FORMAT_VERSION + 1
    with pytest.raises(ValueError, match="plan format version"):
        Plan.from_dict(d)
    del d["version"]
    with pytest.raises(ValueError, match="plan format version"):
        Plan.from_dict(d)


def test_plan_refuses_bad_members():
    g = ((ParamMeta("a", (5,), "float32"),),)
    two, one = ZeroLayout(2, g), ZeroLayout(1, g)
    with pytest.raises(ValueError, match="old_members"):
        plan_transition(two, one, ("m0",), ("m0",))
    with pytest.raises(ValueError, match="new_members"):
        plan_transition(two, one, ("m0", "m1"), ("m0", "m1"))
    with pytest.raises(ValueError, match="only one rank per generation"):
        plan_transition(two, two, ("m0", "m0"), ("m0", "m1"))
    with pytest.raises(ValueError, match="only one rank per generation"):
        plan_transition(one, two, ("m0",), ("m1", "m1"))


# ---------------------------------------------------------------- (5) hand-derived plans


def test_hand_plan_shrink_2_to_1():
    """a: 5 elements, b: 3 (float32, no alignment). World size 2: 8 elements, alignment 2*2 = 4 ->
    8, partitions of 4: rank 0 holds a[0:4]; rank 1 holds a[4] at 0 and b[0:3] at 1..3.
    World size 1: alignment 2 -> 8, one partition: a at 0..4, b at 5..7.
    So rank 0 keeps its 4 elements in place, and rank 1 sends all 4 of its elements, contiguous
    on both sides (a[4] -> 4, b -> 5..7), as one transfer."""
    g = ((ParamMeta("a", (5,), "float32"), ParamMeta("b", (3,), "float32")),)
    old, new = ZeroLayout(2, g), ZeroLayout(1, g)
    assert (old.partition_numel(0), new.partition_numel(0)) == (4, 8)
    plan = plan_transition(old, new, ("A", "B"), ("A",))
    assert plan.transfers == (
        Transfer(src=0, dst=0, group=0, src_offset=0, dst_offset=0, numel=4),
        Transfer(src=1, dst=0, group=0, src_offset=0, dst_offset=4, numel=4),
    )
    assert [plan.is_keep(t) for t in plan.transfers] == [True, False]
    assert (plan.numel_kept, plan.numel_moved) == (4, 4)
    assert plan.leavers == ("B",) and plan.joiners == ()
    assert plan.sends_of("B") == {"A": [plan.transfers[1]]}
    assert plan.receives_of("A") == {"B": [plan.transfers[1]]}
    assert plan.keeps_of("A") == [plan.transfers[0]] and plan.keeps_of("B") == []


def test_hand_plan_grow_1_to_2():
    g = ((ParamMeta("a", (5,), "float32"), ParamMeta("b", (3,), "float32")),)
    plan = plan_transition(ZeroLayout(1, g), ZeroLayout(2, g), ("A",), ("A", "C"))
    assert plan.transfers == (
        Transfer(src=0, dst=0, group=0, src_offset=0, dst_offset=0, numel=4),  # kept by A
        Transfer(src=0, dst=1, group=0, src_offset=4, dst_offset=0, numel=4),  # a[4], b -> joiner C
    )
    assert plan.joiners == ("C",) and plan.leavers == ()
    assert plan.sends_of("A") == {"C": [plan.transfers[1]]}


def test_hand_plan_round_robin_2_to_3():
    """p0: 3, p1: 2, p2: 4 elements, round robin (see test_layout_hand_oracle_round_robin).
    Old (ws 2, P 6): r0 = p0[0:3]@0 p2[0:3]@3; r1 = p2[3]@0 p1[0:2]@1.
    New (ws 3, P 4): r0 = p0[0:3]@0 p1[0]@3; r1 = p1[1]@0 p2[0:3]@1; r2 = p2[3]@0."""
    g = ((ParamMeta("p0", (3,), "float32"), ParamMeta("p1", (2,), "float32"), ParamMeta("p2", (2, 2), "float32")),)
    plan = plan_transition(
        ZeroLayout(2, g, round_robin=True), ZeroLayout(3, g, round_robin=True), ("A", "B"), ("A", "B", "C")
    )
    assert plan.transfers == (
        Transfer(0, 0, 0, 0, 0, 3),  # p0, kept
        Transfer(0, 1, 0, 3, 1, 3),  # p2[0:3]
        Transfer(1, 0, 0, 1, 3, 1),  # p1[0]
        Transfer(1, 1, 0, 2, 0, 1),  # p1[1], kept (B stays rank 1) but moves within the partition
        Transfer(1, 2, 0, 0, 0, 1),  # p2[3] -> joiner
    )
    assert [plan.is_keep(t) for t in plan.transfers] == [True, False, False, True, False]


def test_hand_plan_alignment_2_to_3_two_groups():
    """Group 0: a 5, b 3 float32 with alignment (ws 2: a@r0 0..4, b@r1 2..4, P 6; ws 3: P 4,
    a[0:4]@r0, a[4]@r1 0, b@r2 0). Group 1: c 1 element (ws 2: P 1, c@r0; ws 3: P 2, c@r0)."""
    g = ((ParamMeta("a", (5,), "float32"), ParamMeta("b", (3,), "float32")), (ParamMeta("c", (1, 1), "float32"),))
    plan = plan_transition(
        ZeroLayout(2, g, parameter_alignment=True),
        ZeroLayout(3, g, parameter_alignment=True),
        ("A", "B"),
        ("A", "B", "C"),
    )
    assert plan.transfers == (
        Transfer(0, 0, 0, 0, 0, 4),
        Transfer(0, 0, 1, 0, 0, 1),
        Transfer(0, 1, 0, 4, 0, 1),
        Transfer(1, 2, 0, 2, 0, 3),
    )


# ---------------------------------------------------------------- assign_members


@pytest.mark.parametrize(
    "old, ws, joiners, expected",
    [
        (("a", "b", "c", "d"), 2, (), ("a", "b")),
        (("a", "b"), 4, ("x", "y"), ("a", "b", "x", "y")),
        (("a", "b", "c"), 3, (), ("a", "b", "c")),
        (("a",), 1, (), ("a",)),
    ],
)
def test_assign_members(old, ws, joiners, expected):
    assert assign_members(old, ws, joiners) == expected


@pytest.mark.parametrize("old, ws, joiners", [(("a", "b"), 4, ("x",)), (("a", "b"), 1, ("x",)), (("a",), 2, ())])
def test_assign_members_refuses(old, ws, joiners):
    with pytest.raises(ValueError, match="do not make world size"):
        assign_members(old, ws, joiners)


# ---------------------------------------------------------------- (6) layouts of different models


@settings(max_examples=100, deadline=None)
@given(models(), world_sizes, world_sizes, st.data())
def test_mismatch_names_first_differing_parameter(model, old_ws, new_ws, data):
    groups, kw = model
    positions = [(gi, pi) for gi, ps in enumerate(groups) for pi in range(len(ps))]
    picked = sorted(data.draw(st.lists(st.sampled_from(positions), min_size=1, max_size=3, unique=True)))
    change = data.draw(st.sampled_from(["shape", "dtype", "name"]))
    mutated = [list(ps) for ps in groups]
    for gi, pi in picked:
        p = mutated[gi][pi]
        if change == "shape":
            mutated[gi][pi] = ParamMeta(p.key, p.shape + (2,), p.dtype)
        elif change == "dtype":
            mutated[gi][pi] = ParamMeta(p.key, p.shape, "float16" if p.dtype != "float16" else "float32")
        else:
            mutated[gi][pi] = ParamMeta(p.key + ".renamed", p.shape, p.dtype)
    other = tuple(tuple(ps) for ps in mutated)
    first = groups[picked[0][0]][picked[0][1]].key
    for a, b in ((groups, other), (other, groups)):
        with pytest.raises(LayoutMismatchError) as info:
            plan_transition(
                ZeroLayout(old_ws, a, **kw),
                ZeroLayout(new_ws, b, **kw),
                member_names("m", old_ws),
                member_names("n", new_ws),
            )
        msg = str(info.value)
        assert f"parameter group {picked[0][0]}:" in msg
        assert f"{first} " in msg or msg.endswith(first), msg
        for gi, pi in picked[1:]:
            assert groups[gi][pi].key + " " not in msg, msg
        assert isinstance(info.value, DynatrainError)


def test_mismatch_refusals_by_hand():
    a = ParamMeta("layer.0.weight", (4, 3), "float32")
    b = ParamMeta("layer.0.bias", (4,), "float32")
    c = ParamMeta("layer.1.weight", (2, 4), "float32")

    def plan(g1, g2, **kw):
        return plan_transition(ZeroLayout(2, g1, **kw), ZeroLayout(1, g2), ("m0", "m1"), ("m0",))

    with pytest.raises(
        LayoutMismatchError,
        match=r"parameter group 0: layer.0.bias \[4\] float32 differs from "
        r"layer.0.bias \[5\] float32",
    ):
        plan(((a, b, c),), ((a, ParamMeta("layer.0.bias", (5,), "float32"), ParamMeta("x", (1,), "float32")),))
    with pytest.raises(LayoutMismatchError, match="parameter group 0: parameter layer.1.weight is present in only one"):
        plan(((a, b, c),), ((a, b),))
    d = ParamMeta("layer.2.weight", (3,), "float32")
    with pytest.raises(LayoutMismatchError, match="parameter group 1: parameter layer.2.weight is present in only one"):
        plan(((a, b), (c,)), ((a, b), (c, d)))
    with pytest.raises(LayoutMismatchError, match="2 and 1 parameter groups"):
        plan(((a, b), (c,)), ((a, b, c),))
    with pytest.raises(LayoutMismatchError, match="round_robin_gradients or parameter_alignment"):
        plan(((a, b, c),), ((a, b, c),), round_robin=True)


def test_scalars_of_new_partitions_come_from_the_first_old_partition_of_their_group():
    """Stage 3 cuts sub-groups anew at each world size: new partition j of parameter group g takes
    the scalars (Adam's step) of the first old partition of g, whatever the cut."""
    from ds_dynatrain.planner import scalars_for

    groups = (
        tuple(ParamMeta(f"a{i}", (6,), "float32") for i in range(4)),
        tuple(ParamMeta(f"b{i}", (6,), "float32") for i in range(3)),
    )
    old = ZeroLayout(2, groups, stage=3, sub_group_size=6)
    new = old.with_world_size(3)
    plan = plan_transition(old, new, ("m0", "m1"), ("m0", "m1", "j2"))
    # by hand: at 2 ranks each piece is 3 elements, a sub-group closes at 6: a0 a1 | a2 a3 | b0 b1 | b2;
    # at 3 ranks pieces are 2: a0 a1 a2 | a3 | b0 b1 b2
    assert [old.partition_keys(b) for b in range(4)] == [("a0", "a1"), ("a2", "a3"), ("b0", "b1"), ("b2",)]
    assert [new.partition_keys(b) for b in range(3)] == [("a0", "a1", "a2"), ("a3",), ("b0", "b1", "b2")]
    scalars = [{"step": 100}, {"step": 101}, {"step": 200}, {"step": 201}]
    assert scalars_for(plan, scalars) == [{"step": 100}, {"step": 100}, {"step": 200}]
    # stages 1/2: a partition is a parameter group
    z2 = ZeroLayout(2, groups)
    assert scalars_for(
        plan_transition(z2, z2.with_world_size(1), ("m0", "m1"), ("m1",)), [{"step": 3}, {"step": 4}]
    ) == [{"step": 3}, {"step": 4}]
    with pytest.raises(ValueError, match="scalar sets"):
        scalars_for(plan, scalars[:1])
