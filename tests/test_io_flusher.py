"""The flusher: every backend writes byte-identical files; refusals fall back (logged once);
storage failures raise typed errors naming the file and offset and leave no partial file.

Refusals and faults are INJECTED at the seams ``queue_factory`` / ``opener`` of ``IOBackend``
(the real io_uring and O_DIRECT work on this machine; the fakes below pretend they do not).
"""

import errno
import fcntl
import hashlib
import logging
import os
import time

import numpy as np
import pytest
from faults import SMALL, FaultQueue, faulty, refuse_direct_open, refuse_uring, uring_available

from io_engine import (
    BackendUnavailableError,
    Flusher,
    HostCache,
    IOConfig,
    IOTimeoutError,
    ShortWriteError,
    SnapshotFileWriter,
    StorageWriteError,
    read_snapshot_file,
)
from io_engine.ioqueue import UringQueue, default_queue_factory


def _direct_ok(d):
    try:
        os.close(os.open(os.path.join(d, ".probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False


needs_uring = pytest.mark.skipif(not uring_available(), reason="io_uring refused on this machine")


@pytest.fixture
def fallback_log():
    """Records ds_dynatrain.io WARNING lines directly (independent of other loggers' config)."""
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("ds_dynatrain.io")
    h, old = H(level=logging.WARNING), logger.level
    logger.addHandler(h)
    logger.setLevel(logging.WARNING)
    yield records
    logger.removeHandler(h)
    logger.setLevel(old)


# --- injected refusals and faults --------------------------------------------------------------


def is_direct(fd):
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


# --- the items every backend writes ------------------------------------------------------------


def mixed_items():
    rng = np.random.default_rng(7)
    items = [
        (f"t{n}", rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        for n in (0, 1, 511, 512, 513, 4095, 4096, 4097, 70001)
    ]
    items.append(("half", rng.standard_normal(1001).astype(np.float16)))
    items.append(("obj", b"x" * 5000, "object", {"vps": "sched"}))
    items.append(("obj0", b"", "object"))
    return items


def write_with(path, config=None, **backend_kw):
    flusher = Flusher(config or IOConfig(**SMALL), **backend_kw)
    with SnapshotFileWriter(flusher=flusher, cache_bytes=4 * SMALL["chunk_bytes"]) as w:
        res = w.write(str(path), mixed_items(), file_attrs={"rank": 0})
    return res, hashlib.sha256(open(path, "rb").read()).hexdigest()


@needs_uring
def test_every_backend_writes_identical_bytes(tmp_path, fallback_log):
    if not _direct_ok(str(tmp_path)):
        pytest.skip(f"O_DIRECT refused on {tmp_path}; the direct variants cannot be compared")
    cases = {
        "io_uring+direct": (IOConfig(engine="io_uring", direct=True, **SMALL), {}),
        "threads+direct": (IOConfig(engine="threads", direct=True, **SMALL), {}),
        "io_uring+buffered": (IOConfig(engine="io_uring", direct=False, **SMALL), {}),
        "threads+buffered": (IOConfig(engine="threads", direct=False, **SMALL), {}),
        "auto, io_uring refused": (IOConfig(**SMALL), {"queue_factory": refuse_uring}),
        "auto, O_DIRECT refused": (IOConfig(**SMALL), {"opener": refuse_direct_open}),
    }
    expect = {
        "io_uring+direct": ("io_uring", True),
        "threads+direct": ("threads", True),
        "io_uring+buffered": ("io_uring", False),
        "threads+buffered": ("threads", False),
        "auto, io_uring refused": ("threads", True),
        "auto, O_DIRECT refused": ("io_uring", False),
    }
    digests = {}
    for i, (name, (cfg, kw)) in enumerate(cases.items()):
        res, digests[name] = write_with(tmp_path / f"f{i}", cfg, **kw)
        assert (res.report.engine, res.report.direct) == expect[name], name
    assert len(set(digests.values())) == 1, digests
    back = read_snapshot_file(str(tmp_path / "f0"))
    for item in mixed_items():
        assert bytes(back[item[0]][0]) == bytes(memoryview(item[1]).cast("B"))


@needs_uring
def test_uring_refusal_falls_back_and_is_logged_once(tmp_path, fallback_log):
    flusher = Flusher(IOConfig(**SMALL), queue_factory=refuse_uring)
    with SnapshotFileWriter(flusher=flusher, cache_bytes=64 << 10) as w:
        for i in range(3):
            assert w.write(str(tmp_path / f"f{i}"), mixed_items()).report.engine == "threads"
    lines = [m for m in fallback_log if "io_uring refused" in m]
    assert len(lines) == 1 and "ENOSYS" in lines[0]
    assert flusher.backend.fallbacks == lines


def test_direct_refused_at_open_falls_back_and_is_logged_once(tmp_path, fallback_log):
    flusher = Flusher(IOConfig(**SMALL), opener=refuse_direct_open)
    with SnapshotFileWriter(flusher=flusher, cache_bytes=64 << 10) as w:
        for i in range(3):
            assert w.write(str(tmp_path / f"f{i}"), mixed_items()).report.direct is False
    lines = [m for m in fallback_log if "O_DIRECT refused" in m]
    assert len(lines) == 1 and "EINVAL" in lines[0]


def test_direct_refused_on_first_write_retries_buffered(tmp_path, fallback_log):
    if not _direct_ok(str(tmp_path)):
        pytest.skip(f"O_DIRECT refused on {tmp_path} for real; nothing to inject")
    ref, want = write_with(tmp_path / "ref", IOConfig(direct=False, **SMALL))
    seen = []
    factory = faulty(lambda fd, off: is_direct(fd), lambda view: -errno.EINVAL, seen)
    res, got = write_with(tmp_path / "f", IOConfig(**SMALL), queue_factory=factory)
    assert seen[0].injected >= 1 and res.report.direct is False
    assert got == want
    assert len([m for m in fallback_log if "O_DIRECT refused" in m]) == 1


@pytest.mark.parametrize("engine", [pytest.param("io_uring", marks=needs_uring), "threads"])
def test_enospc_halfway_raises_typed_error_and_leaves_no_file(tmp_path, engine):
    path = tmp_path / "f"
    ref, _ = write_with(tmp_path / "ref", IOConfig(engine=engine, **SMALL))
    half = ref.layout.file_size // 2 // 4096 * 4096
    seen = []
    factory = faulty(lambda fd, off: off >= half, lambda view: -errno.ENOSPC, seen)
    flusher = Flusher(IOConfig(engine=engine, **SMALL), queue_factory=factory)
    cache = HostCache(4 * SMALL["chunk_bytes"], SMALL["chunk_bytes"])
    with (
        SnapshotFileWriter(flusher=flusher, host_cache=cache) as w,
        pytest.raises(StorageWriteError, match=rf"{path} at offset \d+: .*No space left") as ei,
    ):
        w.write(str(path), mixed_items())
    assert ei.value.errno == errno.ENOSPC and ei.value.offset >= half
    assert seen[0].injected >= 1
    assert not path.exists()  # never a silent partial file
    assert cache.num_free == cache.num_buffers  # every buffer came back
    cache.close()


def test_short_write_is_an_error(tmp_path):
    seen = []
    factory = faulty(lambda fd, off: off == 8192, lambda view: len(view) // 2, seen)
    flusher = Flusher(IOConfig(**SMALL), queue_factory=factory)
    with pytest.raises(ShortWriteError, match="offset 8192: short write"):
        flusher.write_file(str(tmp_path / "f"), [(bytes(8192), 0), (bytes(8192), 8192)])
    assert not (tmp_path / "f").exists()


def test_forced_io_uring_refused_is_an_error(tmp_path):
    flusher = Flusher(IOConfig(engine="io_uring"), queue_factory=refuse_uring)
    with pytest.raises(BackendUnavailableError, match="io_uring was requested"):
        flusher.write_file(str(tmp_path / "f"), [(b"x", 0)])


def test_forced_direct_refused_is_an_error(tmp_path):
    flusher = Flusher(IOConfig(direct=True), opener=refuse_direct_open)
    with pytest.raises(StorageWriteError, match="O_DIRECT"):
        flusher.write_file(str(tmp_path / "f"), [(b"x", 0)])


@pytest.mark.parametrize("direct", [True, False])
def test_write_file_odd_buffers_and_truncation(tmp_path, direct):
    if direct and not _direct_ok(str(tmp_path)):
        pytest.skip(f"O_DIRECT refused on {tmp_path}")
    a, b = os.urandom(5000), os.urandom(3)  # unaligned lengths -> bounce copies
    rep = Flusher(IOConfig(direct=direct, **SMALL)).write_file(
        str(tmp_path / "f"), [(a, 0), (memoryview(b), 8192)], logical_size=8195
    )
    assert rep.direct is direct and rep.nbytes == 8195
    data = open(tmp_path / "f", "rb").read()
    assert data == a + bytes(8192 - 5000) + b


def test_write_file_refuses_unaligned_offsets_and_shared_blocks(tmp_path):
    f = Flusher()
    with pytest.raises(ValueError, match="share a block"):
        f.write_file(str(tmp_path / "f"), [(b"x" * 10, 0), (b"y", 0)])
    with pytest.raises(ValueError, match="not a multiple"):
        f.write_file(str(tmp_path / "g"), [(b"x", 100)])


def test_io_config_validation():
    for bad in (
        dict(engine="spdk"),
        dict(direct="maybe"),
        dict(queue_depth=0),
        dict(chunk_bytes=1000),
        dict(alignment=3000),
        dict(timeout_s=0),
    ):
        with pytest.raises(ValueError):
            IOConfig(**bad)


def test_hung_storage_times_out_with_a_typed_error(tmp_path):
    """INJECTED: one write never completes. The wait is bounded; the buffer it holds is never
    handed back for reuse (the kernel might still read it)."""

    class Swallow(FaultQueue):
        def submit_write(self, fd, view, offset, token):
            if offset == 20480:  # the second 16 KiB chunk of item "a"
                self.injected += 1  # dropped: its completion never comes
            else:
                self.inner.submit_write(fd, view, offset, token)

    def factory(kind, depth):
        return Swallow(default_queue_factory(kind, depth), None, None)

    cache = HostCache(4 * SMALL["chunk_bytes"], SMALL["chunk_bytes"])
    flusher = Flusher(IOConfig(timeout_s=0.3, **SMALL), queue_factory=factory)
    t0 = time.monotonic()
    with (  # through the cache, whatever the address of the bytes object
        SnapshotFileWriter(flusher=flusher, host_cache=cache, from_source=False) as w,
        pytest.raises(IOTimeoutError, match=rf"{tmp_path / 'f'}: no completion within 0.3 s"),
    ):
        w.write(str(tmp_path / "f"), [("a", bytes(40000))])
    assert time.monotonic() - t0 < 5
    assert not (tmp_path / "f").exists()
    assert cache.num_free == cache.num_buffers - 1
    cache.close()


@needs_uring
def test_uring_wait_releases_the_gil():
    """liburing's io_uring_wait_cqe holds the GIL (a waiting flusher would freeze training, and
    here deadlock); UringQueue.wait must block in poll() instead, letting other threads run."""
    import threading

    q = UringQueue(4)
    r, w = os.pipe()
    try:
        buf = bytearray(8)
        q.submit_read(r, memoryview(buf), 0, 1)
        threading.Timer(0.1, os.write, args=(w, b"ping")).start()  # needs the GIL to run
        t0 = time.monotonic()
        got = q.wait(timeout=5)
        assert got == [(1, 4)] and bytes(buf[:4]) == b"ping"
        assert time.monotonic() - t0 < 2
    finally:
        q.close()
        os.close(r)
        os.close(w)


def test_a_direct_file_is_reserved_whole_before_its_first_write(tmp_path):
    """The reservation (``fallocate``) sizes the file before any byte is written, only with O_DIRECT."""
    for direct in (True, False):
        if direct and not _direct_ok(str(tmp_path)):
            continue
        path = tmp_path / f"f{direct}"
        with Flusher(IOConfig(direct=direct)).open(str(path)) as s:
            reserved = s.reserve(10_000)
            if direct and not reserved:
                pytest.skip("this file system takes O_DIRECT but refuses fallocate")
            assert reserved == direct  # ext4 / XFS / btrfs reserve; buffered files are left alone
            assert os.fstat(s._channel.fd).st_size == (12_288 if direct else 0)  # whole blocks
            s.write(b"a" * 4096, 4096)
            s.finish(5000)
        assert path.read_bytes() == bytes(4096) + b"a" * 904  # unwritten blocks read as zeros


def test_a_file_larger_than_allowed_fails_at_its_reservation_and_is_removed(tmp_path):
    """The process may not grow a file past 1 MiB (RLIMIT_FSIZE, set in a child process): a 4 MiB
    snapshot file fails before its first write, with an error naming the reservation, and no file stays."""
    if not _direct_ok(str(tmp_path)):
        pytest.skip("O_DIRECT refused here: nothing is reserved")
    code = f"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
from io_engine import IOConfig, SnapshotFileWriter, Flusher, StorageWriteError
import numpy as np
with SnapshotFileWriter(flusher=Flusher(IOConfig(direct=True))) as w:
    try:
        w.write({str(tmp_path / "big")!r}, [("t", np.ones(4 << 20, np.uint8))])
    except StorageWriteError as e:
        print("ERR", e.errno, e.offset, e)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"ERR {errno.EFBIG} 0 "), out.stdout
    assert "reserving" in out.stdout and "File too large" in out.stdout
    assert not (tmp_path / "big").exists()


def _failing_fallocate(err):
    """INJECTED: a C library ``fallocate`` that fails with ``err`` (the seam ``preallocate._FALLOCATE``)."""
    import ctypes

    def fallocate(fd, mode, offset, length):
        ctypes.set_errno(err)
        return -1

    return fallocate


def test_a_file_system_without_fallocate_is_written_unreserved_and_a_full_one_fails_before_writing(
    tmp_path, monkeypatch
):
    if not _direct_ok(str(tmp_path)):
        pytest.skip("O_DIRECT refused here: nothing is reserved")
    from io_engine import preallocate

    _, ref = write_with(tmp_path / "ref", IOConfig(direct=False, **SMALL))
    for err in (errno.EOPNOTSUPP, errno.EPERM):  # the file system cannot reserve: written as before
        monkeypatch.setattr(preallocate, "_FALLOCATE", _failing_fallocate(err))
        res, digest = write_with(tmp_path / f"unreserved{err}", IOConfig(direct=True, **SMALL))
        assert res.report.direct and digest == ref
    for err, name in ((errno.ENOSPC, "No space left"), (errno.EDQUOT, "quota")):
        monkeypatch.setattr(preallocate, "_FALLOCATE", _failing_fallocate(err))
        path = tmp_path / f"full{err}"
        with pytest.raises(StorageWriteError, match=rf"{path} at offset 0: reserving \d+ bytes failed.*{name}") as ei:
            write_with(path, IOConfig(direct=True, **SMALL))
        assert ei.value.errno == err
        assert not path.exists()
