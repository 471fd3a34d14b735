"""Regions (``ds_dynatrain.vps.region``) against plain Python sets of element indices, and boxes against
numpy indexing of ``np.arange(numel).reshape(shape)``."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_dynatrain.vps.region import Region

SPAN = 48  # elements of the small tensors the generated regions live in

interval = st.tuples(st.integers(0, SPAN), st.integers(0, SPAN)).map(lambda t: (min(t), max(t)))
interval_list = st.lists(interval, max_size=7)


def elements(intervals):
    """Oracle: the set of element indices a list of half-open intervals covers."""
    return {i for a, b in intervals for i in range(a, b)}


def runs(elems):
    """Oracle: the sorted maximal runs ``(start, stop)`` of a set of integers."""
    out = []
    for i in sorted(elems):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((a, b) for a, b in out)


# ---------------------------------------------------------------- construction


@settings(max_examples=150, deadline=None)
@given(interval_list)
def test_from_intervals_normalises(ivs):
    r = Region.from_intervals(ivs)
    assert r.intervals == runs(elements(ivs))
    assert r.size == len(elements(ivs))
    assert bool(r) == bool(elements(ivs))
    assert Region.from_dict(r.to_dict()) == r
    assert hash(Region.from_dict(r.to_dict())) == hash(r)


@pytest.mark.parametrize(
    "intervals",
    [
        ((3, 2),),  # reversed
        ((2, 2),),  # empty
        ((-1, 2),),  # negative
        ((4, 6), (0, 2)),  # unsorted
        ((0, 4), (2, 6)),  # overlapping
        ((0, 4), (4, 6)),  # adjacent: must be merged
        ((0, 4), (5, 6), (5, 9)),  # duplicate start
        ((0, 4), (0, 4)),  # duplicate
    ],
)
def test_constructor_refuses_unnormalised(intervals):
    with pytest.raises(ValueError):
        Region(intervals)
    assert Region.from_intervals([iv for iv in intervals if iv[0] >= 0]).intervals == runs(
        elements(iv for iv in intervals if iv[0] >= 0)
    )


def test_from_intervals_refuses_negative():
    with pytest.raises(ValueError, match="non-negative"):
        Region.from_intervals([(0, 3), (-2, 1)])


def test_full_and_empty():
    assert Region.full(5).intervals == ((0, 5),)
    assert Region.full(0) == Region() and not Region() and Region().size == 0
    assert Region.from_intervals([]) == Region()
    assert Region.from_intervals([(3, 3), (5, 5)]) == Region()


# ---------------------------------------------------------------- set algebra


@settings(max_examples=250, deadline=None)
@given(interval_list, interval_list)
def test_set_operations_match_python_sets(a_ivs, b_ivs):
    a, b = Region.from_intervals(a_ivs), Region.from_intervals(b_ivs)
    sa, sb = elements(a_ivs), elements(b_ivs)
    for result, oracle in (
        (a.union(b), sa | sb),
        (a.intersection(b), sa & sb),
        (a.difference(b), sa - sb),
        (b.difference(a), sb - sa),
    ):
        # the result is normalised (re-validated by the constructor) and covers exactly the oracle set
        assert Region(result.intervals) == result
        assert result.intervals == runs(oracle)
        assert result.size == len(oracle)
    assert a.union(b) == b.union(a)
    assert a.intersection(b) == b.intersection(a)
    # operations return new values and leave their operands unchanged
    assert a == Region.from_intervals(a_ivs) and b == Region.from_intervals(b_ivs)


@settings(max_examples=60, deadline=None)
@given(interval_list, interval_list, interval_list)
def test_set_identities(x, y, z):
    a, b, c = (Region.from_intervals(v) for v in (x, y, z))
    assert a.intersection(b.union(c)) == a.intersection(b).union(a.intersection(c))
    assert a.difference(b.union(c)) == a.difference(b).difference(c)
    assert a.difference(b).union(a.intersection(b)) == a
    assert a.difference(b).intersection(b) == Region()


# ---------------------------------------------------------------- boxes


@st.composite
def boxes(draw):
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 6)) for _ in range(ndim)]
    starts, sizes = [], []
    for n in shape:
        s = draw(st.integers(0, n))
        starts.append(s)
        sizes.append(draw(st.integers(0, n - s)))
    return shape, starts, sizes


@settings(max_examples=250, deadline=None)
@given(boxes())
def test_box_matches_numpy_indexing(box):
    shape, starts, sizes = box
    idx = tuple(slice(s, s + k) for s, k in zip(starts, sizes))
    oracle = np.arange(math.prod(shape)).reshape(shape)[idx].ravel()
    r = Region.box(shape, starts, sizes)
    assert r.intervals == runs(set(oracle.tolist()))
    assert r.size == oracle.size == math.prod(sizes)
    # and the flat positions, read in region order, are the box's elements in row-major order
    flat = np.concatenate([np.arange(a, b) for a, b in r.intervals]) if r else np.empty(0, dtype=np.int64)
    assert flat.tolist() == oracle.tolist()


def test_box_hand_cases():
    # rows 1..2, columns 1..2 of a 3 x 4 matrix: elements 5, 6 and 9, 10
    assert Region.box((3, 4), (1, 1), (2, 2)).intervals == ((5, 7), (9, 11))
    # whole rows merge into one run
    assert Region.box((3, 4), (1, 0), (2, 4)).intervals == ((4, 12),)
    assert Region.box((2, 3, 4), (0, 1, 0), (2, 2, 4)).intervals == ((4, 12), (16, 24))
    assert Region.box((5,), (2,), (3,)).intervals == ((2, 5),)
    assert Region.box((), (), ()) == Region.full(1)
    assert Region.box((3, 4), (1, 1), (0, 2)) == Region()


@pytest.mark.parametrize(
    "shape, starts, sizes",
    [
        ((3, 4), (0, 3), (1, 2)),  # past the end of dimension 1
        ((3, 4), (-1, 0), (1, 1)),  # negative start
        ((3, 4), (0, 0), (1, -1)),  # negative size
        ((3, 4), (0,), (1,)),  # rank mismatch
    ],
)
def test_box_refusals(shape, starts, sizes):
    with pytest.raises(ValueError):
        Region.box(shape, starts, sizes)
