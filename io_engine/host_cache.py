"""A bounded pool ("ring") of page-aligned host buffers, reused across snapshots.

Why a fixed pool: the copy of live state into host memory *is* the lazy capture, and it must not
grow host memory with the model or with the number of snapshots taken. The pool is allocated
once (``total_bytes`` split into equal ``buffer_bytes`` buffers) and recycled: a writer acquires a
buffer, fills it, hands it to the flusher and gets it back when the write completed. When every
buffer is in flight, ``acquire`` waits (with a timeout), which is the back-pressure that keeps
capture from outrunning storage.

Why ``mmap.mmap(-1, n)``: anonymous mappings are page aligned (4096 bytes here), which satisfies
O_DIRECT's address alignment without ctypes tricks, and they are returned to the OS on close.
A torch CPU tensor's storage is aligned as O_DIRECT asks (512 bytes on common disks,
:mod:`io_engine.dio_align`) only sometimes (large tensors under ``THP_MEM_ALLOC_ENABLE=1``, and
views into them at such offsets): those of 4 KiB or more the writer writes from their own memory
(with buffered I/O, any address will do); every other payload goes through this pool.

Pinning (``cudaHostRegister``) is the caller's job on GPU machines: pass ``pin``/``unpin`` hooks;
``pin(view)`` is called once per buffer at construction, ``unpin(handle)`` at :meth:`close`.
This module imports neither torch nor CUDA.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections import deque
from typing import Any, Callable, List, Optional

from .errors import HostCacheError, HostCacheTimeoutError

log = logging.getLogger("ds_dynatrain.io")

PAGE_SIZE = mmap.PAGESIZE


def alloc_aligned(nbytes: int) -> mmap.mmap:
    """A zero-filled, page-aligned anonymous mapping of at least ``nbytes`` bytes (whole pages).

    Raises ``ValueError`` for ``nbytes < 0`` and ``OSError``/``MemoryError`` when the mapping fails.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return mmap.mmap(-1, max(PAGE_SIZE, -(-nbytes // PAGE_SIZE) * PAGE_SIZE))


def buffer_address(buf) -> int:
    """Virtual address of the first byte of a non-empty, contiguous buffer-protocol object
    (read-only ones too)."""
    import numpy as np  # local: the package does not need numpy to import

    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class HostBuffer:
    """One buffer of the pool. ``view`` is a writable ``memoryview`` (format ``'B'``) of
    ``nbytes`` bytes, page aligned. Valid between ``acquire`` and ``release``; do not keep views
    of it after release."""

    __slots__ = ("index", "nbytes", "view", "_mmap", "_owner")

    def __init__(self, index: int, m: mmap.mmap, owner: "HostCache"):
        self.index = index
        self.nbytes = len(m)
        self._mmap = m
        self.view = memoryview(m)
        self._owner = owner

    def numpy(self):
        """The buffer as a 1-D ``numpy.uint8`` array (a view, no copy)."""
        import numpy as np

        return np.frombuffer(self.view, dtype=np.uint8)

    def __repr__(self) -> str:
        return f"HostBuffer(index={self.index}, nbytes={self.nbytes})"


class HostCache:
    """A fixed set of ``total_bytes // buffer_bytes`` page-aligned buffers of ``buffer_bytes`` each.

    ``buffer_bytes`` must be a positive multiple of ``alignment`` (default 4096, the O_DIRECT
    block) and at most ``total_bytes``. Thread safe: buffers may be acquired on one thread and
    released on another (the flusher's completion path).

    Raises ``ValueError`` on bad sizes; allocation failures propagate after everything already
    allocated has been released.
    """

    def __init__(
        self,
        total_bytes: int,
        buffer_bytes: int = 8 << 20,
        *,
        alignment: int = 4096,
        pin: Optional[Callable[[memoryview], Any]] = None,
        unpin: Optional[Callable[[Any], None]] = None,
    ):
        self._buffers: List[HostBuffer] = []
        self._pins: List[Any] = []
        self._unpin = unpin
        self._closed = False
        self._cond = threading.Condition()
        self._free: deque = deque()
        self._held = set()
        self.acquired_total = 0
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if buffer_bytes <= 0 or buffer_bytes % alignment:
            raise ValueError(f"buffer_bytes ({buffer_bytes}) must be a positive multiple of alignment ({alignment})")
        if total_bytes < buffer_bytes:
            raise ValueError(f"total_bytes ({total_bytes}) must hold at least one buffer of {buffer_bytes} bytes")
        self.buffer_bytes = buffer_bytes
        self.alignment = alignment
        try:
            for i in range(total_bytes // buffer_bytes):
                buf = HostBuffer(i, alloc_aligned(buffer_bytes), self)
                self._buffers.append(buf)
                if pin is not None:
                    self._pins.append(pin(buf.view))
                self._free.append(buf)
        except BaseException:
            self.close()
            raise

    @property
    def num_buffers(self) -> int:
        """Number of buffers in the pool (constant for the pool's life)."""
        return len(self._buffers)

    @property
    def total_bytes(self) -> int:
        """Bytes held by the pool (``num_buffers * buffer_bytes``), constant."""
        return sum(b.nbytes for b in self._buffers)

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    def try_acquire(self) -> Optional[HostBuffer]:
        """A free buffer, or None at once when all are held. Raises ``HostCacheError`` if closed."""
        with self._cond:
            return self._take()

    def acquire(self, timeout: Optional[float] = None) -> HostBuffer:
        """A free buffer, waiting up to ``timeout`` seconds (None: forever) for one to be released.

        Raises :class:`HostCacheTimeoutError` when none became free in time and
        :class:`HostCacheError` if the cache is (or gets) closed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                buf = self._take()
                if buf is not None:
                    return buf
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise HostCacheTimeoutError(
                        f"no host buffer free after {timeout:.3f} s: all {self.num_buffers} buffers "
                        f"of {self.buffer_bytes} bytes are held"
                    )
                self._cond.wait(remaining)

    def _take(self) -> Optional[HostBuffer]:
        if self._closed:
            raise HostCacheError("host cache is closed")
        if not self._free:
            return None
        buf = self._free.popleft()
        self._held.add(buf.index)
        self.acquired_total += 1
        return buf

    def release(self, buf: HostBuffer) -> None:
        """Return ``buf`` to the pool. Raises :class:`HostCacheError` for a foreign buffer or a
        double release. Releasing after :meth:`close` is a no-op."""
        with self._cond:
            if self._closed:
                return
            if buf._owner is not self or buf.index not in self._held:
                raise HostCacheError(f"{buf!r} is not held from this cache (double release?)")
            self._held.discard(buf.index)
            self._free.append(buf)
            self._cond.notify()

    def close(self) -> None:
        """Unpin and unmap every buffer; wake waiters (they raise ``HostCacheError``).

        Idempotent and safe on a half-built object. A buffer whose memory is still exported (a
        view kept by someone, e.g. an I/O that never completed) is left to the garbage collector
        rather than unmapped under its user.
        """
        cond = getattr(self, "_cond", None)
        if cond is None:
            return
        with cond:
            if getattr(self, "_closed", False) and not self._buffers:
                return
            self._closed = True
            cond.notify_all()
        unpin = getattr(self, "_unpin", None)
        for handle in getattr(self, "_pins", []):
            if unpin is not None:
                try:
                    unpin(handle)
                except Exception as e:  # keep releasing the rest
                    log.warning("host cache: unpin failed: %s", e)
        self._pins = []
        for buf in getattr(self, "_buffers", []):
            try:
                buf.view.release()
                buf._mmap.close()
            except BufferError:
                log.debug("host cache: buffer %d still exported; left to the GC", buf.index)
        self._buffers = []
        self._free.clear()

    def __enter__(self) -> "HostCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostCache(num_buffers={self.num_buffers}, buffer_bytes={self.buffer_bytes}, "
            f"free={len(self._free)}, closed={self._closed})"
        )
