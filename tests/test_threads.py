"""A worker's share of its host's CPUs (ds_dynatrain/elastic/threads.py): the count, the members
on the same host read from a real TCPStore as the agents write them, and the user's own
OMP_NUM_THREADS left alone. The count a running job sets at each resize is checked against the
same formula on a real job in test_records_job.py."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

from ds_dynatrain.elastic.keys import MEMBER_NODE_KEY
from ds_dynatrain.elastic.threads import host_cpus, one_thread_unless_fixed, share_cpus, threads_per_worker


@pytest.mark.parametrize(
    "cpus,workers,expected", [(2, 1, 2), (2, 2, 1), (2, 3, 1), (16, 3, 5), (16, 4, 4), (1, 1, 1), (64, 8, 8)]
)
def test_threads_per_worker(cpus, workers, expected):
    assert threads_per_worker(cpus, workers) == expected


@pytest.mark.parametrize("cpus,workers", [(0, 1), (4, 0), (-1, 2)])
def test_impossible_counts_are_refused(cpus, workers):
    with pytest.raises(ValueError, match=str(cpus if cpus < 1 else workers)):
        threads_per_worker(cpus, workers)


@pytest.fixture
def store():
    st = tdist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    for member, node in {"g0r0": 0, "g0r1": 0, "g1r2": 1, "g1r3": 0}.items():
        st.set(MEMBER_NODE_KEY.format(member), str(node))
    return st


@pytest.fixture
def threads_restored(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


def test_share_counts_the_generation_members_on_this_host(store, threads_restored):
    cpus = host_cpus()
    assert share_cpus(store, ["g0r0", "g0r1", "g1r2"], "g0r0") == max(1, cpus // 2)
    assert torch.get_num_threads() == max(1, cpus // 2)
    assert share_cpus(store, ["g0r0", "g1r2"], "g0r0") == cpus  # the other member runs on node 1
    assert torch.get_num_threads() == cpus
    assert share_cpus(store, ["g0r0", "g0r1", "g1r2", "g1r3"], "g1r2") == cpus  # alone on node 1
    assert share_cpus(store, ["g0r0"], "g9r9") is None  # a member no agent placed: left alone
    one_thread_unless_fixed()
    assert torch.get_num_threads() == 1


def test_the_users_omp_num_threads_wins(store, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(before))
    assert share_cpus(store, ["g0r0", "g0r1", "g1r3"], "g0r0") is None
    one_thread_unless_fixed()
    assert torch.get_num_threads() == before
    assert os.environ["OMP_NUM_THREADS"] == str(before)
