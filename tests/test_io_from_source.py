"""Writes straight from a tensor's own memory (no copy through the host cache) where its address
suits the file (a page; 512 bytes where the kernel says O_DIRECT takes that, checked against the
kernel's own refusals; any address buffered): the file is byte-identical to the copied one on
every backend, the capture waits for those writes, and a storage failure among them is the same
typed error with no file left.

The delayed completions and the ENOSPC are INJECTED at the io engine's ``queue_factory`` seam."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import struct

import numpy as np
import pytest
from faults import SMALL, QueueWrapper, faulty, uring_available

from io_engine import Flusher, HostCache, IOConfig, SnapshotFileWriter, StorageWriteError, read_snapshot_file
from io_engine.dio_align import dio_memory_alignment, file_memory_alignment
from io_engine.host_cache import alloc_aligned, buffer_address
from io_engine.ioqueue import default_queue_factory

ALIGN = 4096


def aligned_array(nbytes: int, seed: int) -> np.ndarray:
    """``nbytes`` random bytes in page-aligned memory (as torch's allocator gives a large tensor
    under ``THP_MEM_ALLOC_ENABLE=1``)."""
    a = np.frombuffer(alloc_aligned(nbytes), dtype=np.uint8)[:nbytes]
    a[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return a


def items():
    """Sizes around the alignment and the writer's piece (a host-cache buffer of 4 chunks), one
    array 512 bytes past a page (as a parameter inside DeepSpeed's flat buffer lies), one 256 and
    one 8 bytes past a page."""
    piece = 4 * SMALL["chunk_bytes"]
    sizes = (ALIGN, ALIGN - 1, 3 * piece + 123, 5 * ALIGN + 1, 3 * piece)
    out = [("unaligned", aligned_array(2 * piece + 8, 9)[8:]), ("at512", aligned_array(piece + 512, 8)[512:])]
    out.append(("at256", aligned_array(piece + 256, 7)[256:]))  # half of 512: taken only where 256 will do
    out += [(f"t{n}", aligned_array(n, seed)) for seed, n in enumerate(sizes)]  # the last one from its source
    out.append(("obj", b"o" * 777, "object"))
    return out


def from_source_expected(memory_alignment: int) -> int:
    """The bytes the writer must take from the sources: the whole-block bulk of each array at
    least one block long whose address is a multiple of ``memory_alignment``; the others are
    copied."""
    return sum(
        len(a) // ALIGN * ALIGN
        for _, a, *rest in items()
        if not rest and len(a) >= ALIGN and a.ctypes.data % memory_alignment == 0
    )


def kernel_memory_alignment(directory) -> int:
    """The oracle: the smallest power of two ``p`` such that an O_DIRECT write of one block from
    ``p`` bytes past a page succeeds in ``directory`` (the kernel's own answer, by trying)."""
    path = os.path.join(directory, "probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    page = mmap.mmap(-1, 2 * ALIGN)
    try:
        for shift in (1 << k for k in range(13)):
            try:
                os.pwrite(fd, memoryview(page)[shift : shift + ALIGN], 0)
                return shift
            except OSError as e:
                assert e.errno == errno.EINVAL
        raise AssertionError("no O_DIRECT write succeeded")
    finally:
        os.close(fd)
        os.unlink(path)
        page.close()


def expected_alignment(directory, direct: bool) -> int:
    """The address alignment the writer must have used in ``directory``: 1 buffered; with
    O_DIRECT the kernel's (by trying) where ``statx`` reports one, else the block."""
    if not direct:
        return 1
    fd = os.open(os.path.join(directory, "s"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        reported = dio_memory_alignment(fd) is not None
    finally:
        os.close(fd)
        os.unlink(os.path.join(directory, "s"))
    return min(ALIGN, kernel_memory_alignment(directory)) if reported else ALIGN


def direct_supported(directory) -> bool:
    try:
        os.close(os.open(os.path.join(directory, "p"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(os.path.join(directory, "p")):
            os.unlink(os.path.join(directory, "p"))


def test_the_memory_alignment_is_the_one_the_kernel_takes(tmp_path):
    if not direct_supported(tmp_path):
        pytest.skip("O_DIRECT refused here")
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        said = dio_memory_alignment(fd)
        if said is None:
            pytest.skip("the kernel does not report STATX_DIOALIGN here")
        want = kernel_memory_alignment(tmp_path)
        assert said == want
        assert file_memory_alignment(fd, True, ALIGN) == min(want, ALIGN)
        assert file_memory_alignment(fd, False, ALIGN) == 1  # buffered: the kernel copies from anywhere
    finally:
        os.close(fd)
    assert dio_memory_alignment(-1) is None


class Recording(QueueWrapper):
    """A real queue that records each write's buffer address and whether its file is O_DIRECT."""

    def __init__(self, inner):
        super().__init__(inner)
        self.writes = []

    def submit_write(self, fd, view, offset, token):
        self.writes.append((buffer_address(view), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        self.inner.submit_write(fd, view, offset, token)


def recording(queues):
    """A queue factory of :class:`Recording` queues, each appended to ``queues``."""

    def factory(kind, depth):
        queues.append(Recording(default_queue_factory(kind, depth)))
        return queues[-1]

    return factory


def write(path, config, from_source, **kw):
    flusher = Flusher(config, **kw)
    with SnapshotFileWriter(flusher=flusher, cache_bytes=4 * SMALL["chunk_bytes"], from_source=from_source) as w:
        res = w.write(str(path), items())
    return res, hashlib.sha256(path.read_bytes()).hexdigest()


needs_uring = pytest.mark.skipif(not uring_available(), reason="io_uring refused on this machine")
BACKENDS = [
    pytest.param(dict(engine="io_uring", direct=True), marks=needs_uring),
    pytest.param(dict(engine="io_uring", direct=False), marks=needs_uring),
    dict(engine="threads", direct=True),
    dict(engine="threads", direct="auto"),
    dict(engine="threads", direct=False),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_source_file_is_identical_to_the_copied_one(tmp_path, backend):
    if backend["direct"] is not False and not direct_supported(tmp_path):
        pytest.skip("O_DIRECT refused here")
    cfg = IOConfig(**backend, **SMALL)
    copied, want = write(tmp_path / "copied", cfg, from_source=False)
    queues = []
    direct, got = write(tmp_path / "direct", cfg, from_source=True, queue_factory=recording(queues))
    assert direct.report.direct is (backend["direct"] is not False)  # no silent fall back to buffered
    if direct.report.direct:  # every write the kernel got suits it: the oracle is its own acceptance
        kernel = kernel_memory_alignment(tmp_path)
        assert all(is_direct and address % kernel == 0 for address, is_direct in queues[0].writes)
    assert copied.from_source_bytes == 0
    assert direct.from_source_bytes == from_source_expected(expected_alignment(tmp_path, direct.report.direct)) > 0
    assert got == want  # header, payloads, padding, block checksums, footer: the same bytes
    back = read_snapshot_file(str(tmp_path / "direct"))  # checksums verified
    for key, data, *_ in items():
        assert bytes(back[key][0]) == bytes(memoryview(data).cast("B"))


class DeferredQueue(QueueWrapper):
    """INJECTED: a real queue whose writes reach the kernel only when completions are waited for,
    as a slow device would take them: a source changed before its write was reaped would reach
    the file."""

    def __init__(self, inner):
        super().__init__(inner)
        self.held = []
        self.outstanding = 0  # writes submitted and not yet reported complete
        self.addresses = set()  # of every buffer a write was handed to the kernel from

    def submit_write(self, fd, view, offset, token):
        self.outstanding += 1
        self.addresses.add(buffer_address(view))
        self.held.append((fd, view, offset, token))

    def wait(self, timeout):
        held, self.held = self.held, []
        for args in held:
            self.inner.submit_write(*args)
        done = self.inner.wait(timeout)
        self.outstanding -= len(done or ())
        return done


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

    queues = []

    def factory(kind, depth):
        queues.append(DeferredQueue(default_queue_factory(kind, depth)))
        return queues[-1]

    flusher = Flusher(cfg, queue_factory=factory)
    with SnapshotFileWriter(flusher=flusher, cache_bytes=4 * SMALL["chunk_bytes"]) as w:
        res = w.write(str(tmp_path / "f"), sources, on_captured=captured)
    alignment = expected_alignment(tmp_path, res.report.direct)
    assert res.from_source_bytes == from_source_expected(alignment)
    taken = [a for a in arrays if len(a) >= ALIGN and a.ctypes.data % alignment == 0]
    assert {a.ctypes.data for a in taken} <= queues[0].addresses  # handed to the kernel as they are: no bounce copy
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


def test_the_flusher_bounces_only_what_the_file_cannot_take(tmp_path):
    """With O_DIRECT, a buffer 8 bytes past a page is copied into an aligned bounce buffer; one at
    the kernel's alignment past a page goes to the kernel as it is. Both reach the file."""
    if not direct_supported(tmp_path):
        pytest.skip("O_DIRECT refused here")
    kernel = kernel_memory_alignment(tmp_path)
    if kernel <= 8 or kernel >= ALIGN:
        pytest.skip(f"the kernel takes buffers at {kernel} bytes: no address between the cases")
    pages = alloc_aligned(4 * ALIGN)
    pages[:] = np.random.default_rng(5).integers(0, 256, 4 * ALIGN, dtype=np.uint8).tobytes()
    odd, fit = memoryview(pages)[8 : 8 + ALIGN], memoryview(pages)[2 * ALIGN + kernel : 3 * ALIGN + kernel]
    queues = []
    report = Flusher(IOConfig(engine="threads", direct=True, **SMALL), queue_factory=recording(queues)).write_file(
        str(tmp_path / "f"), [(odd, 0), (fit, ALIGN)], logical_size=2 * ALIGN
    )
    handed = {address for address, _ in queues[0].writes}
    assert report.direct and buffer_address(odd) not in handed and buffer_address(fit) in handed
    assert (tmp_path / "f").read_bytes() == bytes(odd) + bytes(fit)


def test_after_a_fall_back_to_buffered_any_address_is_written_from_memory(tmp_path):
    """INJECTED: every O_DIRECT write completes with EINVAL (a file system that refuses O_DIRECT
    only at the first write). The file goes on buffered, and an array 8 bytes past a page, which
    O_DIRECT would not take, is then written from its memory too; the file reads back whole."""
    if not direct_supported(tmp_path):
        pytest.skip("O_DIRECT refused here for real; nothing to inject")
    piece = 4 * SMALL["chunk_bytes"]
    big, odd = aligned_array(8 * piece, 1), aligned_array(piece + 8, 2)[8:]
    seen = []
    refuse = faulty(lambda fd, off: bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), lambda v: -errno.EINVAL, seen)
    flusher = Flusher(IOConfig(engine="threads", **SMALL), queue_factory=refuse)
    with SnapshotFileWriter(flusher=flusher, cache_bytes=piece) as w:
        res = w.write(str(tmp_path / "f"), [("big", big), ("odd", odd)])
    assert seen[0].injected >= 1 and res.report.direct is False
    assert res.from_source_bytes == len(big) + len(odd) // ALIGN * ALIGN
    back = read_snapshot_file(str(tmp_path / "f"))
    assert bytes(back["big"][0]) == big.tobytes() and bytes(back["odd"][0]) == odd.tobytes()


@pytest.mark.parametrize(
    "result, mask, memory, want",
    [
        (0, 0x2000, 512, 512),  # STATX_DIOALIGN reported
        (0, 0x0FFF, 512, None),  # not reported (a kernel before 6.1, a file system that does not say)
        (0, 0x2000, 0, None),  # reported: no O_DIRECT for this file
        (0, 0x2000, 384, None),  # not a power of two: not believed
        (-1, 0x2000, 512, None),  # the call failed
    ],
)
def test_the_memory_alignment_is_believed_only_as_the_kernel_reports_it(monkeypatch, result, mask, memory, want):
    """INJECTED: a fake ``statx`` at ``dio_align``'s seam fills ``struct statx`` as a kernel would
    (native byte order; ``stx_mask`` at 0, ``stx_dio_mem_align`` at 152)."""
    import io_engine.dio_align as dio_align

    def fake_statx(fd, path, flags, request, buf):
        assert path == b"" and flags == dio_align.AT_EMPTY_PATH and request == dio_align.STATX_DIOALIGN
        assert ctypes.sizeof(buf) == 256
        struct.pack_into("=I", buf, 0, mask)
        struct.pack_into("=II", buf, 152, memory, 512)
        return result

    monkeypatch.setattr(dio_align, "_STATX", fake_statx)
    assert dio_align.dio_memory_alignment(3) == want
    assert dio_align.file_memory_alignment(3, True, ALIGN) == (want or ALIGN)
    monkeypatch.setattr(dio_align, "_STATX", None)  # no statx in the C library
    assert dio_align.dio_memory_alignment(3) is None and dio_align.file_memory_alignment(3, True, ALIGN) == ALIGN
