"""The host cache: bounded, aligned, reused across snapshots so host memory stays flat."""

import threading
import time

import numpy as np
import pytest

from io_engine import HostCache, HostCacheError, HostCacheTimeoutError, IOConfig, SnapshotFileWriter, read_snapshot_file
from io_engine.host_cache import buffer_address

KIB = 1 << 10


def test_buffers_are_page_aligned_and_viewable():
    with HostCache(64 * KIB, 16 * KIB) as cache:
        assert cache.num_buffers == 4 and cache.total_bytes == 64 * KIB
        bufs = [cache.acquire() for _ in range(4)]
        for b in bufs:
            assert buffer_address(b.view) % 4096 == 0 and b.nbytes == 16 * KIB
            b.numpy()[:3] = [1, 2, 3]
            assert bytes(b.view[:3]) == b"\x01\x02\x03"
        for b in bufs:
            cache.release(b)


def test_fifty_write_cycles_keep_host_memory_flat(tmp_path):
    cache = HostCache(64 * KIB, 16 * KIB)
    ids = {id(b._mmap) for b in cache._buffers}
    rng = np.random.default_rng(0)
    cfg = IOConfig(chunk_bytes=16 * KIB, queue_depth=4)
    with SnapshotFileWriter(host_cache=cache, config=cfg) as w:
        for i in range(50):
            items = [
                (f"t{j}", rng.integers(0, 256, int(n), dtype=np.uint8))
                for j, n in enumerate(rng.integers(0, 40 * KIB, 5))
            ]
            items.append(("o", b"state %d" % i, "object"))
            w.write(str(tmp_path / "f"), items)
            assert (cache.num_buffers, cache.total_bytes, cache.num_free) == (4, 64 * KIB, 4)
            assert {id(b._mmap) for b in cache._buffers} == ids  # the same buffers, reused
    assert cache.acquired_total > 50 * 4  # they really cycled
    got = read_snapshot_file(str(tmp_path / "f"))
    assert bytes(got["t0"][0]) == items[0][1].tobytes()
    cache.close()


def test_acquire_beyond_the_bound_times_out():
    with HostCache(32 * KIB, 16 * KIB) as cache:
        held = [cache.acquire(timeout=0), cache.acquire(timeout=0)]
        t0 = time.monotonic()
        with pytest.raises(HostCacheTimeoutError, match="no host buffer free after 0.050 s"):
            cache.acquire(timeout=0.05)
        assert time.monotonic() - t0 >= 0.05
        assert cache.try_acquire() is None
        threading.Timer(0.05, cache.release, args=(held[0],)).start()
        assert cache.acquire(timeout=5) is held[0]  # a release wakes a waiter


def test_release_misuse_is_refused():
    with HostCache(32 * KIB, 16 * KIB) as a, HostCache(16 * KIB, 16 * KIB) as b:
        buf = a.acquire()
        a.release(buf)
        with pytest.raises(HostCacheError, match="double release"):
            a.release(buf)
        with pytest.raises(HostCacheError):
            b.release(a.acquire())


def test_close_is_safe_half_built_and_twice():
    calls = []

    def pin(view):
        if len(calls) == 2:
            raise MemoryError("injected: pinning failed on the third buffer")
        calls.append(view)
        return len(calls)

    unpinned = []
    with pytest.raises(MemoryError):
        HostCache(64 * KIB, 16 * KIB, pin=pin, unpin=unpinned.append)
    assert unpinned == [1, 2]  # what was pinned got unpinned
    HostCache.__new__(HostCache).close()  # nothing built at all
    cache = HostCache(32 * KIB, 16 * KIB)
    cache.close()
    cache.close()
    with pytest.raises(HostCacheError, match="closed"):
        cache.acquire(timeout=0)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        HostCache(64 * KIB, 1000)
    with pytest.raises(ValueError, match="at least one buffer"):
        HostCache(8 * KIB, 16 * KIB)
