"""Batch arithmetic (``ds_dynatrain.batch``): a hand-written table, a brute-force oracle, refusals."""

import pytest

from ds_dynatrain.batch import BatchSplit, split_global_batch
from ds_dynatrain.errors import DynatrainError, ResizeRefusedError

# (train_batch_size, configured micro, world size, max_world_size) -> (micro, accumulation), by hand
SPLITS = [
    ((32, 4, 4, None), (4, 2)),  # micro divides the per-rank share of 8
    ((32, 4, 2, None), (4, 4)),  # shrink: accumulation absorbs it
    ((32, 4, 8, None), (4, 1)),  # grow to exactly one micro-batch per rank
    ((32, 4, 16, None), (2, 1)),  # per-rank share 2 < micro 4: micro shrinks
    ((32, 4, 32, None), (1, 1)),
    ((24, 4, 3, None), (4, 2)),
    ((36, 8, 3, None), (6, 2)),  # share 12: 8, 7 do not divide it, 6 does
    ((30, 4, 3, None), (2, 5)),  # share 10: 4, 3 do not divide it, 2 does
    ((14, 5, 2, None), (1, 7)),  # share 7 is prime: micro falls to 1
    ((12, 1, 4, None), (1, 3)),
    ((7, 4, 7, None), (1, 1)),
    ((1, 1, 1, None), (1, 1)),
    ((16, 2, 4, 4), (2, 2)),  # world size equal to max_world_size is allowed
    ((16, 16, 1, 8), (16, 1)),
]


@pytest.mark.parametrize("args, expected", SPLITS, ids=[str(a) for a, _ in SPLITS])
def test_split_table(args, expected):
    tb, mb, ws, max_ws = args
    split = split_global_batch(tb, mb, ws, max_ws)
    assert split == BatchSplit(world_size=ws, micro_batch=expected[0], gradient_accumulation_steps=expected[1])
    assert split.train_batch_size == tb


def test_split_against_brute_force():
    """Every small case: the global batch is kept, and the micro-batch is the largest divisor of the
    per-rank share that does not exceed the configured one."""
    cases = 0
    for tb in range(1, 49):
        for ws in range(1, 13):
            if tb % ws:
                continue
            share = tb // ws
            for mb in range(1, 13):
                best = max(d for d in range(1, mb + 1) if share % d == 0)
                split = split_global_batch(tb, mb, ws)
                assert (split.world_size, split.micro_batch, split.gradient_accumulation_steps) == (
                    ws,
                    best,
                    share // best,
                ), (tb, mb, ws)
                assert split.micro_batch * split.gradient_accumulation_steps * ws == tb
                cases += 1
    assert cases > 1000


REFUSALS = [
    ((32, 4, 0, None), r"world size 0 refused: a job needs at least one rank"),
    ((32, 4, -1, None), r"world size -1 refused"),
    ((32, 4, 5, 4), r"world size 5 refused: above max_world_size=4"),
    ((32, 4, 3, None), r"world size 3 refused: the global batch train_batch_size=32 is not divisible"),
    ((10, 2, 4, 8), r"world size 4 refused: the global batch train_batch_size=10 is not divisible"),
    ((0, 4, 1, None), r"must be positive"),
    ((32, 0, 1, None), r"must be positive"),
    ((-8, 2, 1, None), r"must be positive"),
]


@pytest.mark.parametrize("args, match", REFUSALS, ids=[str(a) for a, _ in REFUSALS])
def test_split_refusals(args, match):
    with pytest.raises(ResizeRefusedError, match=match) as info:
        split_global_batch(*args)
    assert isinstance(info.value, DynatrainError) and isinstance(info.value, ValueError)


def test_a_tp_or_pipeline_job_names_its_dp_size():
    with pytest.raises(ResizeRefusedError, match=r"^DP size 3 refused: the global batch train_batch_size=32"):
        split_global_batch(32, 4, 3, what="DP size")


@pytest.mark.parametrize(
    "batch, micro, at_most, max_ws, expected",
    [
        (12, 2, 3, None, 3),
        (12, 2, 5, None, 4),
        (12, 2, 4, 3, 3),
        (8, 2, 3, None, 2),
        (7, 1, 6, None, 1),
        (12, 2, 0, None, 0),
    ],
)
def test_largest_world_size(batch, micro, at_most, max_ws, expected):
    """After a failure or a preemption: the largest size the live processes can serve."""
    from ds_dynatrain.batch import largest_world_size

    assert largest_world_size(batch, micro, at_most, max_ws) == expected
