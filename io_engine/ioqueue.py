"""Asynchronous positional read/write queues: io_uring, or a thread pool of ``os.pwrite``.

Both implement one small protocol, :class:`IOQueue`, so the flusher and the reader submit
operations and reap completions without knowing which one they got:

1. ``submit_write(fd, view, offset, token)`` / ``submit_read(...)`` — queue one operation of
   ``len(view)`` bytes at byte ``offset``; ``token`` is a positive int naming it. The caller keeps
   ``view`` alive until its completion is reaped (the kernel reads/writes it directly).
2. ``wait(timeout)`` — submit what is queued, then return at least one ``(token, result)`` pair,
   or ``[]`` after ``timeout`` seconds. ``result`` is the byte count, or ``-errno``.
3. ``close()`` — release the queue. Only call it with nothing in flight.

Why ``liburing`` 2024.5.3 (the Cython bindings): its ``io_uring_prep_write`` takes any
buffer-protocol object, so writes go straight from aligned host buffers (zero copy, O_DIRECT
possible). Its ``io_uring_wait_cqe`` does *not* release the GIL, so a thread blocked in it would
freeze the training loop; we instead peek completions and block in ``select.poll`` on the ring's
file descriptor, which does release the GIL.

The thread-pool queue is the fallback when the kernel or a seccomp policy refuses io_uring
(EPERM, ENOSYS, ENOMEM from the memlock limit). ``os.pwrite``/``os.preadv`` release the GIL.
"""

from __future__ import annotations

import errno
import os
import queue
import select
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Protocol, Tuple

Completion = Tuple[int, int]  # (token, bytes transferred or -errno)


class IOQueue(Protocol):
    """What the flusher and reader need from a queue; see the module docstring for call order."""

    kind: str

    def submit_write(self, fd: int, view: memoryview, offset: int, token: int) -> None: ...

    def submit_read(self, fd: int, view: memoryview, offset: int, token: int) -> None: ...

    def wait(self, timeout: float) -> List[Completion]: ...

    def close(self) -> None: ...


_IMPORT_LOCK = threading.Lock()


def import_liburing(attempts: int = 8):
    """Import ``liburing`` 2024.5.3, surviving its import-time cache race.

    Its ``__init__`` runs ``dynamic_import.importer()``, which keeps a cache file next to the
    package and deletes and rebuilds it when it looks stale; two processes importing it for the
    first time at once can see ``FileNotFoundError`` and leave a half-initialised module behind.
    That is retried (the module dropped from ``sys.modules`` first). ``ds_dynatrain.prebuild``
    imports it once at install time so the cache exists before any job starts.

    Raises:
        OSError(ENOSYS): not importable, or not the 2024.5.3 API.
    """
    with _IMPORT_LOCK:
        last = None
        for i in range(attempts):
            try:
                import liburing as L

                if hasattr(L, "io_uring_prep_write") and hasattr(L, "io_uring_peek_cqe"):
                    return L
                last = f"liburing at {getattr(L, '__file__', '?')} has an unexpected API (need 2024.5.3)"
            except ImportError as e:  # pragma: no cover - liburing is a dependency
                raise OSError(errno.ENOSYS, f"liburing is not importable: {e}") from None
            except OSError as e:  # the cache race
                last = f"importing liburing failed: {e}"
            for name in [m for m in sys.modules if m == "liburing" or m.startswith("liburing.")]:
                del sys.modules[name]
            try:  # dynamic_import remembers the package as imported; forget it so it runs again
                import dynamic_import.check as dic

                for path in [p for p in dic.IMPORTER_CALLED if p.rstrip("/").endswith("/liburing")]:
                    del dic.IMPORTER_CALLED[path]
            except (ImportError, AttributeError):  # pragma: no cover - another dynamic_import version
                pass
            time.sleep(0.02 * (i + 1))
        raise OSError(errno.ENOSYS, last)


class UringQueue:
    """An io_uring submission/completion queue of ``depth`` entries (liburing 2024.5.3).

    Raises ``OSError`` from ``io_uring_queue_init`` when the kernel refuses a ring (EPERM when
    disabled by sysctl or seccomp, ENOSYS on old kernels, ENOMEM under a low memlock limit), and
    ``OSError(ENOSYS)`` when ``liburing`` cannot be imported.
    """

    kind = "io_uring"

    def __init__(self, depth: int):
        L = import_liburing()
        self._L = L
        self._ring = L.io_uring()
        self._open = False
        L.io_uring_queue_init(depth, self._ring, 0)  # raises OSError on refusal
        self._open = True
        self._cqe = L.io_uring_cqe()
        self._poll = select.poll()
        self._poll.register(self._ring.ring_fd, select.POLLIN)
        self._queued = 0

    def _sqe(self):
        sqe = self._L.io_uring_get_sqe(self._ring)
        if not sqe:  # submission ring full: push it to the kernel first
            self._submit()
            sqe = self._L.io_uring_get_sqe(self._ring)
            if not sqe:
                raise OSError(errno.EBUSY, "io_uring submission queue is full")
        return sqe

    def submit_write(self, fd: int, view: memoryview, offset: int, token: int) -> None:
        sqe = self._sqe()
        self._L.io_uring_prep_write(sqe, fd, view, len(view), offset)
        self._L.io_uring_sqe_set_data64(sqe, token)
        self._queued += 1

    def submit_read(self, fd: int, view: memoryview, offset: int, token: int) -> None:
        sqe = self._sqe()
        self._L.io_uring_prep_read(sqe, fd, view, len(view), offset)
        self._L.io_uring_sqe_set_data64(sqe, token)
        self._queued += 1

    def _submit(self) -> None:
        while self._queued:
            n = self._L.io_uring_submit(self._ring)  # raises OSError on failure
            if n <= 0:
                raise OSError(errno.EAGAIN, "io_uring_submit accepted nothing")
            self._queued -= n

    def wait(self, timeout: float) -> List[Completion]:
        self._submit()
        L, cqe, out = self._L, self._cqe, []
        deadline = time.monotonic() + timeout
        while True:
            rc = L.io_uring_peek_cqe(self._ring, cqe)
            if rc == 0:
                out.append((cqe.user_data, cqe.res))
                L.io_uring_cqe_seen(self._ring, cqe)
                continue
            if rc != -errno.EAGAIN:
                raise OSError(-rc, "io_uring_peek_cqe failed")
            if out:
                return out
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return out
            self._poll.poll(max(1, int(remaining * 1000)))  # releases the GIL

    def close(self) -> None:
        if self._open:
            self._open = False
            self._L.io_uring_queue_exit(self._ring)


class ThreadQueue:
    """``depth`` operations in flight on a pool of ``min(depth, max_workers)`` threads running
    ``os.pwrite`` / ``os.preadv``. Never refused; slower per operation than io_uring."""

    kind = "threads"

    def __init__(self, depth: int, max_workers: int = 16):
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(depth, max_workers)), thread_name_prefix="ds_dynatrain-io"
        )
        self._done: "queue.SimpleQueue[Completion]" = queue.SimpleQueue()

    def _run(self, fn: Callable[[], int], token: int) -> None:
        try:
            n = fn()
        except OSError as e:
            n = -(e.errno or errno.EIO)
        except BaseException:  # never lose a completion, whatever happened
            n = -errno.EIO
        self._done.put((token, n))

    def submit_write(self, fd: int, view: memoryview, offset: int, token: int) -> None:
        self._pool.submit(self._run, lambda: os.pwrite(fd, view, offset), token)

    def submit_read(self, fd: int, view: memoryview, offset: int, token: int) -> None:
        self._pool.submit(self._run, lambda: os.preadv(fd, [view], offset), token)

    def wait(self, timeout: float) -> List[Completion]:
        try:
            out = [self._done.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)


QueueFactory = Callable[[str, int], IOQueue]


def default_queue_factory(kind: str, depth: int) -> IOQueue:
    """Build a queue of ``kind`` (``"io_uring"`` or ``"threads"``) with ``depth`` entries.

    This is the seam tests replace to inject a refusal (e.g. raise ``OSError(ENOSYS)`` for
    ``"io_uring"``) or faults (wrap the returned queue). Raises ``OSError`` as the queue does and
    ``ValueError`` for an unknown kind.
    """
    if kind == "io_uring":
        return UringQueue(depth)
    if kind == "threads":
        return ThreadQueue(depth)
    raise ValueError(f"unknown I/O queue kind {kind!r}")
