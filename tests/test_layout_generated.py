"""The layout computed from metadata alone equals what DeepSpeed's real engines build, for
generated models.

``tests/test_layout_vs_deepspeed.py`` checks hand-made models; this test draws a fixed sample of
models from a hypothesis strategy (``derandomize=True``: the same sample on every run of one
hypothesis version), builds each one as real parameters in a worker and runs
``deepspeed.initialize`` on world sizes 1-4. Models
have random shapes (1-element and odd sizes), 1-3 parameter groups with interleaved members in a
shuffled group order (sometimes a group of fewer elements than ranks), frozen parameters, a tied
pair, fp32 or bf16, ``round_robin_gradients`` and ``parameter_alignment`` on or off, ZeRO stage 1
or 2. Every rank's fragments (parameter, start, length, offset in the partition) from
``ZeroLayout.fragments`` must equal where DeepSpeed put each parameter's data in the flat buffer
(``engine_storage_fragments``), and the partition sizes must agree.
"""

from __future__ import annotations

import itertools
import json
import math
import os

import pytest
from conftest import WORKERS, run_plain
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.multiprocess

N_CASES = 12


@st.composite
def generated_models(draw) -> dict:
    """One model description as ``tests/workers/generated_layout_worker.py`` reads it."""
    n = draw(st.integers(3, 8))
    params = [
        {"name": f"p{i}", "shape": draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)), "frozen": False}
        for i in range(n)
    ]
    n_groups = draw(st.integers(1, min(3, n)))
    # each group gets one trainable parameter of its own, the others go anywhere (interleaved)
    owner = list(range(n_groups)) + [draw(st.integers(0, n_groups - 1)) for _ in range(n - n_groups)]
    owner = draw(st.permutations(owner))
    trainable_of = {g: owner.index(g) for g in range(n_groups)}  # the one that stays trainable
    for i, p in enumerate(params):
        p["frozen"] = i not in trainable_of.values() and draw(st.integers(0, 3)) == 0
    if draw(st.booleans()):  # a group of fewer elements than the largest world size
        small = n_groups - 1
        params[trainable_of[small]]["shape"] = [draw(st.integers(1, 3))]
    groups = []
    for g in range(n_groups):
        members = [i for i in range(n) if owner[i] == g]
        groups.append(draw(st.permutations(members)) if draw(st.booleans()) else members)
    tie = None
    if draw(st.booleans()):
        of = draw(st.sampled_from(sorted(i for i, p in enumerate(params) if not p["frozen"])))
        tie = {"alias": "tied", "of": of, "position": draw(st.integers(0, n))}
    return {
        "stage": draw(st.sampled_from([1, 2])),
        "dtype": draw(st.sampled_from(["float32", "bfloat16"])),
        "round_robin": draw(st.booleans()),
        "parameter_alignment": draw(st.booleans()),
        "params": params,
        "tie": tie,
        "groups": groups,
    }


def features(case: dict) -> dict:
    """What makes a model awkward for a layout."""

    def trainable_numel(g):
        return sum(math.prod(case["params"][i]["shape"]) for i in g if not case["params"][i]["frozen"])

    return {
        "stage": case["stage"],
        "dtype": case["dtype"],
        "round_robin": case["round_robin"],
        "parameter_alignment": case["parameter_alignment"],
        "groups": len(case["groups"]),
        "tie": case["tie"] is not None,
        "frozen": any(p["frozen"] for p in case["params"]),
        "small_group": any(trainable_numel(g) < 4 for g in case["groups"]),
        "shuffled": any(g != sorted(g) for g in case["groups"]),
    }


def sample_cases(n: int, pool: int = 300) -> list:
    """``n`` models, the same on every run, chosen from the first ``pool`` distinct models the
    strategy yields (derandomized) to cover as many pairs of :func:`features` values as they can
    (greedily: each next model adds the most pairs not yet covered; the earliest wins a tie).
    Hypothesis tries the simplest models first; a pairwise-covering choice spreads the sample
    over the combinations of settings instead."""
    seen = []

    @settings(
        derandomize=True,
        database=None,
        max_examples=pool,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(generated_models())
    def collect(case):
        if case not in seen:
            seen.append(case)

    collect()
    pairs = [set(itertools.combinations(sorted(features(c).items()), 2)) for c in seen]
    chosen, covered = [], set()
    for _ in range(min(n, len(seen))):
        best = max((i for i in range(len(seen)) if i not in chosen), key=lambda i: (len(pairs[i] - covered), -i))
        chosen.append(best)
        covered |= pairs[best]
    return [dict(seen[i], name=f"case{k:02d}") for k, i in enumerate(chosen)]


def test_sample_covers_the_awkward_cases():
    cases = sample_cases(N_CASES)
    assert len(cases) == N_CASES
    assert cases == sample_cases(N_CASES), "the sample must be the same on every draw"
    numels = [math.prod(p["shape"]) for c in cases for p in c["params"]]
    assert 1 in numels and any(x % 2 for x in numels if x > 1)
    assert {len(c["groups"]) for c in cases} >= {1, 2, 3}
    assert any(any(p["frozen"] for p in c["params"]) for c in cases)
    assert any(c["tie"] for c in cases)
    for key, values in (
        ("stage", {1, 2}),
        ("dtype", {"float32", "bfloat16"}),
        ("round_robin", {True, False}),
        ("parameter_alignment", {True, False}),
    ):
        assert {c[key] for c in cases} == values, key
    assert any(features(c)["small_group"] and len(c["groups"]) > 1 for c in cases)  # a group smaller than 4 ranks
    interleaved = [
        c
        for c in cases
        if len(c["groups"]) > 1
        and any(max(g) > min(h) and max(h) > min(g) for g in c["groups"] for h in c["groups"] if g is not h)
    ]
    assert interleaved


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``(cases, {world_size: {rank: result}})``: one start of 4 processes runs every world size
    from 1 to 4, each on a process group of its own (process start-up, not the engines, is what
    costs time here)."""
    tmp = tmp_path_factory.mktemp("generated")
    cases = sample_cases(N_CASES)
    (tmp / "cases.json").write_text(json.dumps(cases))
    jobs = run_plain(
        tmp,
        os.path.join(WORKERS, "generated_layout_worker.py"),
        4,
        [str(tmp / "cases.json"), str(tmp)],
        timeout=180,
        name="generated",
    )
    assert all(j.returncode == 0 for j in jobs), "\n".join(j.output[-3000:] for j in jobs if j.returncode)
    by_ws = {ws: {r: json.loads((tmp / f"ws{ws}_rank{r}.json").read_text()) for r in range(ws)} for ws in range(1, 5)}
    return {c["name"]: c for c in cases}, by_ws


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_generated_layouts_equal_deepspeed(results, world_size):
    cases, by_ws = results
    held = {name: 0 for name in cases}
    for rank, result in by_ws[world_size].items():
        assert sorted(result) == sorted(cases)
        for name, r in result.items():
            where = f"{name} {json.dumps(cases[name])}: rank {rank} of {world_size}"
            assert r["expected"] == r["actual"], where
            assert r["expected_partition_numel"] == r["actual_partition_numel"], where
            assert r["tied"], where
            held[name] += sum(f[3] for f in r["actual"])
    for name, r in result.items():  # not vacuous: the ranks hold every trainable element between them
        assert held[name] == r["trainable_numel"], name
