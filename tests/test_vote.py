"""The step-boundary vote (``ds_dynatrain.engine.vote``): every rank's vote encoded, the vectors
summed as the all-reduce sums them (float64, in a shuffled order), and the sum decoded exactly, at
64, 1,024 and 4,096 simulated ranks. The oracle is the set of ranks that voted."""

from __future__ import annotations

import random

import numpy as np
import pytest

from ds_dynatrain.engine.vote import StepVote, decode, encode, vote_length
from ds_dynatrain.errors import DynatrainError


def tally(votes, world_size, n_standby, seed=0):
    """Sum the encoded votes in a random order, in float64, as a reduction would."""
    vectors = [np.asarray(encode(v, r, world_size, n_standby), dtype=np.float64) for r, v in enumerate(votes)]
    random.Random(seed).shuffle(vectors)
    total = np.zeros(vote_length(world_size, n_standby), dtype=np.float64)
    for v in vectors:
        total += v
    return decode(total.tolist(), world_size, n_standby)


@pytest.mark.parametrize("world_size", [1, 2, 53, 64, 1024, 4096])
def test_preemptions_and_standby_marks_survive_the_sum_exactly(world_size):
    rng = random.Random(world_size)
    preempted = {world_size - 1, world_size * 15 // 16} | set(rng.sample(range(world_size), min(5, world_size)))
    n_standby = max(1, world_size // 8)
    gone = frozenset(rng.sample(range(n_standby), min(3, n_standby)) + [n_standby - 1])
    votes = [
        StepVote(
            loss_sum=0.5,
            loss_count=2,
            preempted=r in preempted,
            ready=r % 3 == 0,
            failed=r == world_size // 2,
            request=(7, world_size + 2) if r == 0 else None,
            standby_gone=gone if r == 0 else frozenset(),
        )
        for r in range(world_size)
    ]
    t = tally(votes, world_size, n_standby)
    assert t.preempted == frozenset(preempted)
    assert t.standby_gone == gone
    assert t.request == (7, world_size + 2)
    assert t.ready == sum(1 for r in range(world_size) if r % 3 == 0)
    assert t.failed == 1
    assert t.loss_count == 2 * world_size and t.loss == pytest.approx(0.25)


def test_rank_60_of_64_is_not_lost():
    """A single float64 bitmask rounds 2**60 + 2**3 to 2**60: the preemption of rank 3 vanished."""
    votes = [StepVote(preempted=r in (3, 60)) for r in range(64)]
    assert tally(votes, 64, 0).preempted == frozenset({3, 60})
    assert float(2**60) + float(2**3) == float(2**60)  # what the old encoding did


def test_no_request_no_marks():
    t = tally([StepVote() for _ in range(8)], 8, 2)
    assert t.request is None and t.preempted == frozenset() and t.standby_gone == frozenset()
    assert t.ready == 0 and t.failed == 0 and t.loss == 0.0


def test_only_rank_0_votes_requests_and_standby_marks():
    with pytest.raises(ValueError, match="only rank 0"):
        encode(StepVote(request=(0, 2)), 1, 4, 0)
    with pytest.raises(ValueError, match="only rank 0"):
        encode(StepVote(standby_gone=frozenset({0})), 2, 4, 1)
    with pytest.raises(ValueError, match="outside a mask"):
        encode(StepVote(standby_gone=frozenset({5})), 0, 4, 2)


def test_malformed_sums_are_refused_and_each_rank_must_set_only_its_own_bit():
    bad = encode(StepVote(preempted=True), 0, 4, 0)
    twice = [a + b for a, b in zip(bad, bad)]  # the same bit from two ranks: 2 * 2**0 looks like rank 1
    assert decode(twice, 4, 0).preempted == frozenset({1})  # why each rank must set only its own bit
    with pytest.raises(DynatrainError, match="elements, expected"):
        decode(bad[:-1], 4, 0)
    half = list(bad)
    half[6] = 0.5
    with pytest.raises(DynatrainError, match="not a sum of distinct bits"):
        decode(half, 4, 0)
