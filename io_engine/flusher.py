"""Writing buffers at file offsets: io_uring + O_DIRECT, with logged fallbacks.

The flusher executes a write plan it does not interpret: a list of ``(buffer, file offset)``
extents. It splits large buffers into ``chunk_bytes`` operations (8 MiB), keeps ``queue_depth``
(32) of them in flight, and at the end truncates the file to its logical size and fsyncs it.

O_DIRECT needs length and offset aligned to the block (4096 bytes) and the buffer's address to
what the file asks (:attr:`WriteSession.memory_alignment`: often 512 bytes, at most the block;
:mod:`~io_engine.dio_align`). Offsets must be aligned by the caller (the format places every
extent on a block). Buffers from the host cache are aligned and padded already; any other buffer
with an unaligned address or length is copied into a zero-padded aligned bounce buffer (a slow
path, for small odd pieces). The zero padding
past an extent's end is either overwritten by nothing (extents never share a block) or cut off by
the final ``ftruncate``, so a file written with and without O_DIRECT is byte-identical.

Errors never leave a silent partial file: the first failure (ENOSPC, EIO, short write) is raised
as a :class:`~io_engine.errors.StorageWriteError` naming the file and offset, after every write
still in flight has completed, and :meth:`Flusher.write_file` removes the partial file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Tuple

from .backend import FileChannel, IOBackend, IOConfig, Op
from .errors import StorageWriteError
from .format import align_up
from .host_cache import alloc_aligned, buffer_address
from .ioqueue import QueueFactory
from .preallocate import reserve


@dataclass(frozen=True)
class WriteReport:
    """What one file write did. ``nbytes``: logical file size in bytes; ``seconds``: wall time
    from open to fsync; ``engine``: ``"io_uring"``/``"threads"``; ``direct``: O_DIRECT used at the
    end; ``fallbacks``: fallback messages of the backend so far."""

    path: str
    nbytes: int
    seconds: float
    engine: str
    direct: bool
    fallbacks: Tuple[str, ...] = ()

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / (1 << 30)


def as_byte_view(buffer) -> memoryview:
    """``buffer`` as a 1-D, format ``'B'`` memoryview without copying.

    Raises ``ValueError`` when the buffer is not C-contiguous (a copy would be needed).
    """
    view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return view.cast("B")


class WriteSession:
    """Writes into one file: :meth:`write` any number of extents, then :meth:`finish`.

    Leaving the ``with`` block without :meth:`finish` aborts (waits for in-flight writes, closes;
    the incomplete file stays for the caller to remove). Single-threaded.
    """

    def __init__(self, backend: IOBackend, path: str):
        self.path = path
        self._backend = backend
        self._cfg = backend.config
        self._t0 = time.perf_counter()
        self._channel = FileChannel(backend, path, write=True)
        self._end = 0
        self._finished = False

    @property
    def engine(self) -> str:
        return self._channel.engine

    @property
    def direct(self) -> bool:
        return self._channel.direct

    @property
    def memory_alignment(self) -> int:
        """Bytes a buffer's address must be a multiple of to be written without a bounce copy:
        1 for buffered I/O, the file's O_DIRECT memory alignment otherwise (at most the block)."""
        return self._channel.memory_alignment

    @property
    def in_flight(self) -> int:
        return len(self._channel._inflight)

    def reserve(self, nbytes: int) -> bool:
        """Allocate the file's first ``nbytes`` bytes before writing them, where it is written with
        O_DIRECT (:mod:`~io_engine.preallocate`: the writes then share the inode lock); returns
        whether it did. Raises :class:`StorageWriteError` when the device has no room."""
        if not self._channel.direct:
            return False  # buffered writes lock nothing per write; on tmpfs a reservation is a page-zeroing pass
        return reserve(self._channel.fd, align_up(nbytes, self._cfg.alignment), self.path)

    def write(self, buffer, offset: int, on_release: Optional[Callable[[], None]] = None) -> None:
        """Queue ``buffer`` (any C-contiguous buffer) to be written at byte ``offset``.

        ``offset`` must be a multiple of the alignment (``ValueError`` otherwise). ``buffer`` must
        not change until ``on_release()`` is called (exactly once, when every byte of it was
        written or the write failed). May block while ``queue_depth`` writes are in flight.
        Raises :class:`StorageWriteError` for any earlier failure in this file.
        """
        align, chunk = self._cfg.alignment, self._cfg.chunk_bytes
        try:
            view = as_byte_view(buffer)
            if offset < 0 or offset % align:
                raise ValueError(f"{self.path}: offset {offset} is not a multiple of {align}")
            n = len(view)
            keep = None
            if n and self._channel.direct and (n % align or buffer_address(view) % self._channel.memory_alignment):
                keep = alloc_aligned(align_up(n, align))  # zero-filled bounce buffer
                keep[:n] = view
                view = memoryview(keep)[: align_up(n, align)]
        except BaseException:
            if on_release is not None:
                on_release()
            raise
        if keep is not None and on_release is not None:
            on_release()  # the caller's buffer is free now
            on_release = None
        self._end = max(self._end, offset + n)
        starts = range(0, len(view), chunk)
        if not starts:
            if on_release is not None:
                on_release()
            return
        pending = [len(starts)]

        def chunk_released() -> None:
            pending[0] -= 1
            if pending[0] == 0 and on_release is not None:
                on_release()

        submitted = 0
        try:
            for s in starts:
                self._channel.submit(Op(True, view[s : s + chunk], offset + s, on_release=chunk_released, keep=keep))
                submitted += 1
        finally:
            for _ in range(len(starts) - submitted):  # never submitted: released right here
                chunk_released()

    def drain(self) -> None:
        """Wait until every queued write completed; raise the first error."""
        self._channel.drain()

    def reap_one(self) -> None:
        """Wait for at least one completion (frees buffers); raise the first error, if any."""
        self._channel._reap()
        self._channel._raise_if_failed()

    def finish(self, logical_size: Optional[int] = None) -> WriteReport:
        """Wait for all writes, truncate to ``logical_size`` bytes (default: end of the furthest
        extent), fsync, close. Raises :class:`StorageWriteError` on any failure."""
        size = self._end if logical_size is None else logical_size
        ch = self._channel
        try:
            ch.drain()
            for what, fn in (("ftruncate", lambda: os.ftruncate(ch.fd, size)), ("fsync", lambda: os.fsync(ch.fd))):
                try:
                    fn()
                except OSError as e:
                    raise StorageWriteError(self.path, f"{what} failed", offset=size, errno=e.errno) from e
            report = WriteReport(
                self.path, size, time.perf_counter() - self._t0, ch.engine, ch.direct, tuple(self._backend.fallbacks)
            )
        except BaseException:
            ch.abort()
            raise
        ch.close()
        self._finished = True
        return report

    def abort(self) -> None:
        """Wait for in-flight writes (ignoring errors) and close; the file is left incomplete."""
        self._channel.abort()

    def __enter__(self) -> "WriteSession":
        return self

    def __exit__(self, *exc) -> None:
        if not self._finished:
            self.abort()


class Flusher:
    """Writes extents into files. See the module docstring.

    ``config`` (an :class:`IOConfig`) sets engine, O_DIRECT, queue depth, chunk size, alignment,
    timeout. ``backend`` shares fallback decisions with readers; otherwise one is built from
    ``config``, ``queue_factory`` and ``opener`` (the seams that inject refusals in tests).
    """

    def __init__(
        self,
        config: Optional[IOConfig] = None,
        *,
        backend: Optional[IOBackend] = None,
        queue_factory: Optional[QueueFactory] = None,
        opener=None,
    ):
        self.backend = backend or IOBackend(config, queue_factory=queue_factory, opener=opener)
        self.config = self.backend.config

    def open(self, path: str) -> WriteSession:
        """Create (or truncate) ``path`` and return a session writing into it.
        Raises :class:`StorageWriteError` when it cannot be opened."""
        return WriteSession(self.backend, path)

    def write_file(
        self, path: str, extents: Iterable[Tuple[object, int]], logical_size: Optional[int] = None
    ) -> WriteReport:
        """Write ``extents`` (``(buffer, byte offset)`` pairs) into a new file at ``path`` (its
        size reserved first, :meth:`WriteSession.reserve`), truncate it to ``logical_size``
        (default: end of the furthest extent) and fsync it.

        Raises ``ValueError`` when an offset is unaligned or two extents share a block, and
        :class:`StorageWriteError` on storage failure (the partial file is removed).
        """
        align = self.config.alignment
        extents = [(as_byte_view(b), off) for b, off in extents]
        spans = sorted((off, align_up(off + len(v), align)) for v, off in extents if len(v))
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"{path}: extents [{a0}, {a1}) and [{b0}, {b1}) share a block")
        session = self.open(path)
        try:
            session.reserve(max(logical_size or 0, spans[-1][1] if spans else 0))
            for view, off in extents:
                session.write(view, off)
            return session.finish(logical_size)
        except BaseException:
            session.abort()
            _unlink_quietly(path)
            raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
