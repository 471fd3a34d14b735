"""Writes straight from a page-aligned tensor's own memory (no copy through the host cache): the
file is byte-identical to the copied one on every backend, the capture waits for those writes,
and a storage failure among them is the same typed error with no file left.

The delayed completions and the ENOSPC are INJECTED at the io engine's ``queue_factory`` seam."""

from __future__ import annotations

import errno
import hashlib

import numpy as np
import pytest
from faults import SMALL, faulty, uring_available

from io_engine import Flusher, HostCache, IOConfig, SnapshotFileWriter, StorageWriteError, read_snapshot_file
from io_engine.host_cache import alloc_aligned
from io_engine.ioqueue import default_queue_factory

ALIGN = 4096


def aligned_array(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` random bytes in page-aligned memory (as torch's allocator gives a large tensor
    under ``THP_MEM_ALLOC_ENABLE=1``)."""
    a = np.frombuffer(alloc_aligned(nbytes), dtype=np.uint8)[:nbytes]
    a[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return a


def items():
    """Sizes around the alignment and the writer's piece (a host-cache buffer of 4 chunks), and
    one unaligned array that must be copied."""
    piece = 4 * SMALL["chunk_bytes"]
    sizes = (ALIGN, ALIGN - 1, 3 * piece + 123, 5 * ALIGN + 1, 3 * piece)
    out = [("unaligned", aligned_array(2 * piece + 8, 9)[8:])]
    out += [(f"t{n}", aligned_array(n, seed)) for seed, n in enumerate(sizes)]  # the last one from its source
    out.append(("obj", b"o" * 777, "object"))
    return out


def from_source_expected() -> int:
    """The bytes the writer must take from the sources: the whole-block bulk of each aligned
    array at least one block long; the unaligned one and the short one are copied."""
    return sum(len(a) // ALIGN * ALIGN for k, a, *_ in items() if k.startswith("t") and len(a) >= ALIGN)


def write(path, config, from_source, **kw):
    flusher = Flusher(config, **kw)
    with SnapshotFileWriter(flusher=flusher, cache_bytes=4 * SMALL["chunk_bytes"], from_source=from_source) as w:
        res = w.write(str(path), items())
    return res, hashlib.sha256(path.read_bytes()).hexdigest()


needs_uring = pytest.mark.skipif(not uring_available(), reason="io_uring refused on this machine")
BACKENDS = [
    pytest.param(dict(engine="io_uring", direct=True), marks=needs_uring),
    pytest.param(dict(engine="io_uring", direct=False), marks=needs_uring),
    dict(engine="threads", direct="auto"),
    dict(engine="threads", direct=False),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_source_file_is_identical_to_the_copied_one(tmp_path, backend):
    cfg = IOConfig(**backend, **SMALL)
    copied, want = write(tmp_path / "copied", cfg, from_source=False)
    direct, got = write(tmp_path / "direct", cfg, from_source=True)
    assert copied.from_source_bytes == 0
    assert direct.from_source_bytes == from_source_expected() > 0
    assert got == want  # header, payloads, padding, block checksums, footer: the same bytes
    back = read_snapshot_file(str(tmp_path / "direct"))  # checksums verified
    for key, data, *_ in items():
        assert bytes(back[key][0]) == bytes(memoryview(data).cast("B"))


class DeferredQueue:
    """INJECTED: a real queue whose writes reach the kernel only when completions are waited for,
    as a slow device would take them: a source changed before its write was reaped would reach
    the file."""

    def __init__(self, inner):
        self.inner, self.kind, self.held = inner, inner.kind, []
        self.outstanding = 0  # writes submitted and not yet reported complete

    def submit_write(self, fd, view, offset, token):
        self.outstanding += 1
        self.held.append((fd, view, offset, token))

    def submit_read(self, fd, view, offset, token):
        self.inner.submit_read(fd, view, offset, token)

    def wait(self, timeout):
        held, self.held = self.held, []
        for args in held:
            self.inner.submit_write(*args)
        done = self.inner.wait(timeout)
        self.outstanding -= len(done or ())
        return done

    def close(self):
        self.inner.close()


def test_capture_waits_for_the_writes_from_the_source(tmp_path):
    """``on_captured`` (after which the optimizer step may change the state) comes only after the
    writes from the sources completed: sources zeroed in it never reach the file."""
    cfg = IOConfig(engine="threads", **SMALL)
    sources = items()
    want = {k: bytes(memoryview(d).cast("B")) for k, d, *_ in sources}
    arrays = [d for _, d, *rest in sources if not rest]

    def captured():
        for a in arrays:
            a[:] = 0

    flusher = Flusher(cfg, queue_factory=lambda kind, depth: DeferredQueue(default_queue_factory(kind, depth)))
    with SnapshotFileWriter(flusher=flusher, cache_bytes=4 * SMALL["chunk_bytes"]) as w:
        res = w.write(str(tmp_path / "f"), sources, on_captured=captured)
    assert res.from_source_bytes == from_source_expected()
    assert all(not a.any() for a in arrays)  # the callback ran
    back = read_snapshot_file(str(tmp_path / "f"))
    assert {k: bytes(v[0]) for k, v in back.items()} == want


def test_storage_failure_from_the_source_is_typed_and_leaves_no_file(tmp_path):
    path = tmp_path / "f"
    seen, captured = [], []
    factory = faulty(lambda fd, off: off >= 2 * 4 * SMALL["chunk_bytes"], lambda view: -errno.ENOSPC, seen)
    flusher = Flusher(IOConfig(engine="threads", **SMALL), queue_factory=factory)
    cache = HostCache(4 * SMALL["chunk_bytes"], SMALL["chunk_bytes"])
    with (
        SnapshotFileWriter(flusher=flusher, host_cache=cache) as w,
        pytest.raises(StorageWriteError, match=rf"{path} at offset \d+: .*No space left") as ei,
    ):
        w.write(str(path), items(), on_captured=lambda: captured.append(1))
    assert ei.value.errno == errno.ENOSPC and seen[0].injected >= 1
    assert captured == [1]  # a waiter is never left blocked
    assert not path.exists()
    assert cache.num_free == cache.num_buffers
    cache.close()


def test_a_failure_calls_on_captured_only_after_the_writes_in_flight(tmp_path, monkeypatch):
    """INJECTED: the checksum of the third piece taken from a source raises (as a MemoryError
    could). The writes already handed over still read the sources: ``on_captured`` must come
    after they completed, and the file is removed."""
    import io_engine.writer as writer

    queues = []

    def factory(kind, depth):
        queues.append(DeferredQueue(default_queue_factory(kind, depth)))
        return queues[-1]

    real, calls = writer._Blocks.copy, [0]

    def failing_copy(self, dst, src):
        if src is None and len(dst) == SMALL["chunk_bytes"]:  # a piece from a source (one cache buffer long)
            calls[0] += 1
            if calls[0] == 3:
                raise MemoryError("injected")
        return real(self, dst, src)

    monkeypatch.setattr(writer._Blocks, "copy", failing_copy)
    outstanding_at_capture = []
    flusher = Flusher(IOConfig(engine="threads", **dict(SMALL, queue_depth=64)), queue_factory=factory)
    with SnapshotFileWriter(flusher=flusher, cache_bytes=4 * SMALL["chunk_bytes"]) as w, pytest.raises(MemoryError):
        w.write(
            str(tmp_path / "f"),
            [("big", aligned_array(8 * 4 * SMALL["chunk_bytes"], 3))],
            on_captured=lambda: outstanding_at_capture.append(queues[0].outstanding),
        )
    assert calls[0] == 3
    assert outstanding_at_capture == [0]
    assert not (tmp_path / "f").exists()


def test_a_lost_release_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """INJECTED: the completions of writes from memory are never counted (as a flusher that lost a
    release would do). The writer raises once nothing is in flight, instead of waiting forever,
    and leaves no file."""
    import io_engine.writer as writer

    monkeypatch.setattr(writer.SnapshotFileWriter, "_source_written", lambda self: None)
    with SnapshotFileWriter(config=IOConfig(engine="threads", **SMALL)) as w:
        with pytest.raises(writer.IOEngineError, match="writes from memory never completed"):
            w.write(str(tmp_path / "f"), [("big", aligned_array(4 * ALIGN, 1))])
    assert not (tmp_path / "f").exists()
