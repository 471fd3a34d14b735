"""Choosing how bytes reach storage, falling back when refused, and running operations on a file.

Two independent choices are made here, each with a fallback that is logged once per
:class:`IOBackend` (one per engine, so once per job) with its reason:

* **queue** — io_uring, or a thread pool of ``os.pwrite``/``os.preadv`` when io_uring is refused
  at queue init (EPERM: disabled by sysctl or seccomp; ENOSYS: old kernel; ENOMEM: memlock limit);
* **O_DIRECT** — on, or buffered (page cache) I/O when the file system refuses it: EINVAL at
  ``open`` or on the first operation (some network and FUSE file systems). Once refused on a
  device, later files on that device open buffered at once.

Every combination writes byte-identical files: only the path through the kernel differs.

The seams for tests and unusual platforms are the constructor's ``queue_factory`` (build a queue
of a given kind; raise to refuse it, wrap it to inject faults) and ``opener`` (``os.open``'s
signature; raise EINVAL for ``O_DIRECT`` to refuse it).

:class:`FileChannel` runs positional operations on one file through one queue: at most
``queue_depth`` in flight, completions reaped with a timeout, failures turned into typed errors
naming the file and offset. It is used by one thread at a time.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from .dio_align import file_memory_alignment
from .errors import (
    BackendUnavailableError,
    IOTimeoutError,
    ShortWriteError,
    StorageError,
    StorageReadError,
    StorageWriteError,
    errno_name,
)
from .ioqueue import IOQueue, QueueFactory, default_queue_factory

log = logging.getLogger("ds_dynatrain.io")

Opener = Callable[[str, int, int], int]
_DIRECT_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP)
# Operations that never completed (timeout) keep their buffers referenced here forever, so the
# memory the kernel may still touch is never unmapped or reused.
_ABANDONED: List[Any] = []


@dataclass(frozen=True)
class IOConfig:
    """How the io engine talks to storage.

    engine:      ``"auto"`` (io_uring, else threads), ``"io_uring"`` (refusal is an error) or
                 ``"threads"``.
    direct:      ``"auto"`` (O_DIRECT, else buffered), ``True`` (refusal is an error), ``False``.
    queue_depth: operations in flight per file (default 32).
    chunk_bytes: largest single operation, bytes; a multiple of ``alignment`` (default 8 MiB).
    alignment:   O_DIRECT block, bytes, for length and offset (default 4096), and for a buffer's
                 address where the kernel does not report the file's own memory alignment
                 (:mod:`~io_engine.dio_align`).
    timeout_s:   longest wait for any completion, seconds, before :class:`IOTimeoutError`.

    Raises ``ValueError`` on construction for any invalid field.
    """

    engine: str = "auto"
    direct: Union[str, bool] = "auto"
    queue_depth: int = 32
    chunk_bytes: int = 8 << 20
    alignment: int = 4096
    timeout_s: float = 300.0

    def __post_init__(self):
        if self.engine not in ("auto", "io_uring", "threads"):
            raise ValueError(f"engine must be 'auto', 'io_uring' or 'threads', got {self.engine!r}")
        if self.direct not in ("auto", True, False):
            raise ValueError(f"direct must be 'auto', True or False, got {self.direct!r}")
        if not 1 <= self.queue_depth <= 4096:
            raise ValueError(f"queue_depth must be in [1, 4096], got {self.queue_depth}")
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {self.alignment}")
        if self.chunk_bytes <= 0 or self.chunk_bytes % self.alignment or self.chunk_bytes >= 1 << 31:
            raise ValueError(
                f"chunk_bytes must be a positive multiple of {self.alignment} below 2 GiB, got {self.chunk_bytes}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def _device_of(path: str) -> int:
    try:
        return os.stat(os.path.dirname(os.path.abspath(path))).st_dev
    except OSError:
        return -1


class IOBackend:
    """The policy shared by flushers and readers: which queue, whether O_DIRECT, what was refused.

    ``queue_factory(kind, depth)`` builds queues (default :func:`default_queue_factory`);
    ``opener(path, flags, mode)`` opens files (default ``os.open``). ``fallbacks`` lists the
    messages logged so far (each logged once, at WARNING, on ``ds_dynatrain.io``).
    """

    def __init__(
        self,
        config: Optional[IOConfig] = None,
        *,
        queue_factory: Optional[QueueFactory] = None,
        opener: Optional[Opener] = None,
    ):
        self.config = config or IOConfig()
        self._factory = queue_factory or default_queue_factory
        self._opener = opener or os.open
        self._lock = threading.Lock()
        self._uring_refused = False
        self._buffered_devices: Set[int] = set()
        self._noted: Set[Any] = set()
        self.fallbacks: List[str] = []

    def note_once(self, key: Any, message: str) -> None:
        """Log ``message`` at WARNING the first time ``key`` is seen by this backend."""
        with self._lock:
            if key in self._noted:
                return
            self._noted.add(key)
            self.fallbacks.append(message)
        log.warning(message)

    def open_queue(self) -> IOQueue:
        """A queue for one file. Raises :class:`BackendUnavailableError` when ``engine`` was
        forced to io_uring and it is refused."""
        depth = self.config.queue_depth
        if self.config.engine != "threads" and not self._uring_refused:
            try:
                return self._factory("io_uring", depth)
            except OSError as e:
                if self.config.engine == "io_uring":
                    raise BackendUnavailableError(
                        "<io_uring>", "io_uring was requested but refused", errno=e.errno
                    ) from e
                self._uring_refused = True
                self.note_once(
                    "io_uring",
                    f"io_uring refused at queue init ({errno_name(e.errno)}: "
                    f"{e.strerror or e}); falling back to a thread pool of "
                    f"os.pwrite/os.preadv",
                )
        return self._factory("threads", depth)

    def open_file(self, path: str, write: bool) -> Tuple[int, bool]:
        """Open ``path`` for writing (created/truncated) or reading. Returns ``(fd, direct)``.

        Raises :class:`StorageWriteError`/:class:`StorageReadError` when the file cannot be
        opened, or O_DIRECT was forced and refused.
        """
        err_type = StorageWriteError if write else StorageReadError
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY) | os.O_CLOEXEC
        direct = self.config.direct
        dev = _device_of(path)
        if direct is True or (direct == "auto" and dev not in self._buffered_devices):
            try:
                return self._opener(path, flags | os.O_DIRECT, 0o644), True
            except OSError as e:
                if direct is True or e.errno not in _DIRECT_REFUSALS:
                    raise err_type(
                        path, "open failed" + (" with O_DIRECT" if direct is True else ""), errno=e.errno
                    ) from e
                self.note_direct_refused(path, f"open with O_DIRECT failed: {errno_name(e.errno)}")
        try:
            return self._opener(path, flags, 0o644), False
        except OSError as e:
            raise err_type(path, "open failed", errno=e.errno) from e

    def reopen_buffered(self, path: str, write: bool, reason: str) -> int:
        """Reopen an already created ``path`` without O_DIRECT (no truncation); log the reason."""
        self.note_direct_refused(path, reason)
        flags = (os.O_WRONLY if write else os.O_RDONLY) | os.O_CLOEXEC
        try:
            return self._opener(path, flags, 0o644)
        except OSError as e:
            raise (StorageWriteError if write else StorageReadError)(
                path, "reopen without O_DIRECT failed", errno=e.errno
            ) from e

    def note_direct_refused(self, path: str, reason: str) -> None:
        dev = _device_of(path)
        with self._lock:
            self._buffered_devices.add(dev)
        where = os.path.dirname(os.path.abspath(path))
        self.note_once(
            ("direct", dev), f"O_DIRECT refused on the file system of {where} ({reason}); using buffered I/O there"
        )


class Op:
    """One positional read or write of ``view`` at byte ``offset``.

    For reads, ``need`` is the number of bytes that must arrive (fewer than ``len(view)`` when the
    aligned view runs past end of file). ``on_release`` is called exactly once when the kernel no
    longer references ``view`` (success or failure; never after a timeout). ``keep`` holds extra
    references (a bounce buffer) for the op's lifetime.
    """

    __slots__ = ("write", "view", "offset", "need", "on_release", "keep", "done")

    def __init__(
        self,
        write: bool,
        view: memoryview,
        offset: int,
        need: Optional[int] = None,
        on_release: Optional[Callable[[], None]] = None,
        keep: Any = None,
    ):
        self.write, self.view, self.offset = write, view, offset
        self.need = len(view) if need is None else need
        self.on_release, self.keep, self.done = on_release, keep, 0


class FileChannel:
    """One open file and one queue. Call :meth:`submit` per op, then :meth:`drain`, then
    :meth:`close` (or :meth:`abort` on any error). See the module docstring."""

    def __init__(self, backend: IOBackend, path: str, *, write: bool):
        self.backend, self.path, self.write = backend, path, write
        self._queue: Optional[IOQueue] = None
        self.fd = -1
        self.direct = False
        self.memory_alignment = 1  # a buffer's address must be a multiple of it (dio_align)
        self._inflight: Dict[int, Op] = {}
        self._retry: List[Op] = []
        self._next = 1
        self._error: Optional[StorageError] = None
        self._direct_ok = False
        self.bytes_done = 0
        try:
            self._queue = backend.open_queue()
            self.fd, self.direct = backend.open_file(path, write)
            self.memory_alignment = file_memory_alignment(self.fd, self.direct, backend.config.alignment)
        except BaseException:
            self.close()
            raise

    @property
    def engine(self) -> str:
        """``"io_uring"`` or ``"threads"``."""
        return getattr(self._queue, "kind", "?")

    def submit(self, op: Op) -> None:
        """Queue ``op``, first waiting while ``queue_depth`` ops are in flight. Raises the first
        :class:`StorageError` of this channel (after every in-flight op has completed)."""
        self._raise_if_failed()
        while len(self._inflight) + len(self._retry) >= self.backend.config.queue_depth:
            self._reap()
        self._raise_if_failed()
        self._issue(op)

    def drain(self) -> None:
        """Wait for every op; raise the first error, if any."""
        while self._inflight or self._retry:
            self._reap()
        self._raise_if_failed()

    def _issue(self, op: Op) -> None:
        token, self._next = self._next, self._next + 1
        view = op.view[op.done :] if op.done else op.view
        self._inflight[token] = op
        try:
            if op.write:
                self._queue.submit_write(self.fd, view, op.offset + op.done, token)
            else:
                self._queue.submit_read(self.fd, view, op.offset + op.done, token)
        except OSError as e:
            del self._inflight[token]
            self._fail(op, f"submitting {len(view)} bytes failed", e.errno)

    def _reap(self) -> None:
        if not self._inflight:
            if self._retry:
                self._drop_direct()
            return
        try:
            got = self._queue.wait(self.backend.config.timeout_s)
        except OSError as e:
            self._fail(None, "waiting for completions failed", e.errno)
            got = None
        if not got:
            self._abandon()
            return
        for token, res in got:
            self._complete(self._inflight.pop(token), res)
        if self._retry and not self._inflight:
            self._drop_direct()

    def _complete(self, op: Op, res: int) -> None:
        if res < 0:
            if (
                -res in _DIRECT_REFUSALS
                and self.direct
                and not self._direct_ok
                and self.backend.config.direct == "auto"
                and self._error is None
            ):
                self._retry.append(op)  # file system refuses O_DIRECT ops: retry buffered
                return
            self._fail(op, f"{'write' if op.write else 'read'} of {len(op.view) - op.done} bytes failed", -res)
            return
        if op.write:
            if res < len(op.view) - op.done:
                return self._fail(op, f"short write: {res} of {len(op.view) - op.done} bytes", None, ShortWriteError)
        else:
            have = op.done + res
            if have < op.need:
                if res == 0:
                    return self._fail(op, f"unexpected end of file: {have} of {op.need} bytes read", None)
                if self.direct and have % self.backend.config.alignment:
                    return self._fail(op, f"short read: {have} of {op.need} bytes", None)
                op.done = have  # resubmit the rest
                self._issue(op)
                return
        if self.direct:
            self._direct_ok = True
        self.bytes_done += res
        self._release(op)

    def _fail(self, op: Optional[Op], message: str, err: Optional[int], cls=None) -> None:
        if self._error is None:
            cls = cls or (StorageWriteError if self.write else StorageReadError)
            mode = f" [{self.engine}{', O_DIRECT' if self.direct else ', buffered'}]"
            self._error = cls(self.path, message + mode, offset=None if op is None else op.offset + op.done, errno=err)
        if op is not None:
            self._release(op)

    @staticmethod
    def _release(op: Op) -> None:
        cb, op.on_release, op.view, op.keep = op.on_release, None, None, None
        if cb is not None:
            cb()

    def _drop_direct(self) -> None:
        ops, self._retry = self._retry, []
        if self._error is not None:
            for op in ops:
                self._release(op)
            return
        try:
            fd = self.backend.reopen_buffered(self.path, self.write, "EINVAL on the first O_DIRECT operation")
        except StorageError as e:
            self._error = e
            for op in ops:
                self._release(op)
            return
        os.close(self.fd)
        self.fd, self.direct, self.memory_alignment = fd, False, 1
        for op in ops:
            self._issue(op)

    def _abandon(self) -> None:
        ops = list(self._inflight.values()) + self._retry
        _ABANDONED.append((self._queue, ops))  # never unmap what the kernel may still touch
        self._inflight, self._retry, self._queue = {}, [], None
        if self._error is None:
            self._error = IOTimeoutError(
                self.path, f"no completion within {self.backend.config.timeout_s} s ({len(ops)} ops abandoned)"
            )

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            while self._inflight or self._retry:
                self._reap()
            raise self._error

    def abort(self) -> None:
        """Wait for in-flight ops (ignoring their errors) and close. Never raises StorageError."""
        try:
            while self._inflight or self._retry:
                self._reap()
        finally:
            self.close()

    def close(self) -> None:
        """Close the file and the queue; ops still in flight are waited for first."""
        if self._inflight or self._retry:
            self.abort()
            return
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
        if self._queue is not None:
            q, self._queue = self._queue, None
            q.close()
