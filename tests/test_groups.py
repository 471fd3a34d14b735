"""Process groups installed, detached and installed again as ``torch.distributed``'s default
group (``ds_dynatrain.elastic.groups``), in real gloo processes: what ``init_process_group`` and
``destroy_process_group`` would leave, without destroying a cached group.

Oracles: collective results (sums of ranks) on the default group and on ``new_group`` subgroups
after each switch; the identity of the group object (reused, not rebuilt); torch's own state
(``is_initialized``, ``get_rank``, ``get_world_size``).
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from conftest import free_port

pytestmark = pytest.mark.multiprocess


def _worker(rank: int, port: int, out):
    from ds_dynatrain.elastic.groups import GroupCache

    def connect():
        return tdist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))

    master = tdist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False) if rank == 0 else None
    cache = GroupCache(connect, f"m{rank}", "gloo")
    four, two = ("m0", "m1", "m2", "m3"), ("m0", "m1")
    res = {}
    cache.prepare(four, "pg/0", 30)  # background
    assert cache.activate(four, "pg/0", 30) is False
    first = tdist.distributed_c10d._get_default_group()
    t = torch.tensor([float(rank)])
    tdist.all_reduce(t)
    res["sum4"] = t.item()
    sub = tdist.new_group([0, 1])  # a subgroup, as DeepSpeed makes: named "1" on the default store
    if rank < 2:
        t = torch.ones(1)
        tdist.all_reduce(t, group=sub)
        res["sub"] = t.item()
        cache.prepare(two, "pg/1", 30)
        while not cache.ready(two):
            time.sleep(0.01)
        assert cache.activate(two, "pg/1", 30) is False
        t = torch.tensor([float(rank + 1)])
        tdist.all_reduce(t)
        res["sum2"] = (t.item(), tdist.get_world_size(), tdist.get_rank())
    else:
        cache.detach()
        res["detached"] = tdist.is_initialized()
    res["reused"] = cache.activate(four, "pg/2", 30)
    res["same_object"] = tdist.distributed_c10d._get_default_group() is first
    t = torch.tensor([float(rank)])
    tdist.all_reduce(t)
    res["sum4_again"] = (t.item(), tdist.get_world_size(), tdist.get_rank())
    sub = tdist.new_group([2, 3])  # a later subgroup must not meet the first one's store keys
    res["names"] = tdist.distributed_c10d._world.group_count  # 3: the counter went on from "1"
    if rank >= 2:
        t = torch.ones(1) * rank
        tdist.all_reduce(t, group=sub)
        res["sub_again"] = t.item()
    cache.close()
    res["closed"] = tdist.is_initialized()
    out.put((rank, res))
    del master


@pytest.mark.timeout(120)
def test_default_group_switches_and_is_reused():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=100) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    for r in range(4):
        res = got[r]
        assert res["sum4"] == 6.0 and res["reused"] is True and res["same_object"] is True
        assert res["sum4_again"] == (6.0, 4, r)
        assert res["closed"] is False
        assert res["names"] == 3  # subgroups "1" then "2" on the reused group's store, not "1" twice
    for r in (0, 1):
        assert got[r]["sub"] == 2.0 and got[r]["sum2"] == (3.0, 2, r)
    for r in (2, 3):
        assert got[r]["detached"] is False and got[r]["sub_again"] == 5.0


def test_built_group_serves_the_device_types_of_an_init_process_group_gloo_group():
    """A group :func:`build_gloo_group` makes answers for the same device types as the group
    ``init_process_group("gloo")`` makes (the oracle: torch's own), with one backend object for
    all of them: a collective on a CUDA tensor finds gloo on a GPU machine (a group of one here,
    over a ``HashStore``)."""
    from ds_dynatrain.elastic.groups import build_gloo_group

    ours = build_gloo_group(tdist.HashStore(), 0, 1, 30)
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        torch_own = tdist.group.WORLD
        assert sorted(map(str, ours._device_types)) == sorted(map(str, torch_own._device_types))
        backends = {id(ours._get_backend(d)) for d in ours._device_types}
        assert len(backends) == 1
        t = torch.tensor([3.0])
        ours.allreduce([t]).wait()
        assert t.item() == 3.0
    finally:
        tdist.destroy_process_group()
        ours.shutdown()


def test_a_formation_waiting_for_a_member_that_never_comes_ends_when_the_cache_closes():
    """A background build whose member never arrives (one that died after the formation was
    published) waits in the arrival barrier, not inside gloo's rendezvous: closing the cache (at
    exit) cancels it at once, long before its timeout, and its thread is gone. Real TCPStore."""
    import threading

    from ds_dynatrain.elastic.groups import GroupCache, await_members

    port = free_port()
    master = tdist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def connect():
        return tdist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))

    cache = GroupCache(connect, "a", "gloo")
    cache.prepare(("a", "b"), "test/pg/1/0/ab", timeout_s=120)
    b = cache._builds[("a", "b")]
    time.sleep(0.3)
    assert not b.done.is_set()  # still waiting for "b"
    t = time.monotonic()
    cache.close()
    assert time.monotonic() - t < 2.0
    assert b.done.is_set() and not b.thread.is_alive()
    assert b.pg is None and "formation was cancelled" in b.error and "TransitionAbortedError" in b.error
    assert not [th for th in threading.enumerate() if th.name.startswith("dynatrain-group-")]
    # the barrier alone: a rank that does not come within the timeout is named
    store = tdist.PrefixStore("test/alone", connect())
    with pytest.raises(RuntimeError, match=r"ranks \[1, 2\] of 3 did not arrive within 0 s"):
        await_members(store, 0, 3, 0.2, threading.Event())
    del master


def test_a_formation_whose_member_died_inside_gloos_rendezvous_is_named_at_close(monkeypatch, caplog):
    """The one formation closing cannot cancel: members "b" and "c" arrive at two formations
    (their arrival keys are set by hand, the seam) and then never enter gloo's rendezvous, as ones
    that died just after arriving. ``close`` waits :data:`CLOSE_JOIN_S` (shortened here) once for
    both, not once each, names each formation in a warning and returns; each build ends by itself
    at gloo's timeout with its error kept. Real TCPStore, real gloo."""
    import logging

    from ds_dynatrain.elastic import groups
    from ds_dynatrain.elastic.groups import GroupCache

    monkeypatch.setattr(groups, "CLOSE_JOIN_S", 1.5)
    port = free_port()
    master = tdist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

    def connect():
        return tdist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))

    cache = GroupCache(connect, "a", "gloo")
    for other in ("b", "c"):
        prefix = f"test/pg/2/0/a{other}"
        tdist.PrefixStore(prefix, connect()).set("dynatrain-arrived/1", b"1")  # the other member arrived
        cache.prepare(("a", other), prefix, timeout_s=5)  # gloo ends it well after close() gives up
    builds = [cache._builds[("a", other)] for other in ("b", "c")]
    time.sleep(0.5)
    assert not any(b.done.is_set() for b in builds)  # inside gloo's rendezvous, waiting for the other's address
    t = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ds_dynatrain"):
        cache.close()
    assert 1.5 <= time.monotonic() - t < 2.8  # one wait for both (3 s and more waiting for each in turn)
    for other in ("b", "c"):
        said = f"member a: the formation of the group of ['a', '{other}'] is still inside gloo's rendezvous"
        assert said in caplog.text
    for b in builds:
        b.thread.join(15)
        assert not b.thread.is_alive() and b.pg is None and "timeout" in b.error, b.error  # gloo's timeout ended it
    del master
