"""Faults injected at the io engine's seams (queue factory, opener), shared by the io tests and the
multi-process snapshot worker, and two small io-test helpers. Every fault here is INJECTED; tests
say so."""

from __future__ import annotations

import errno
import os

from io_engine.ioqueue import UringQueue, default_queue_factory

SMALL = dict(chunk_bytes=16 << 10, queue_depth=4)  # many chunks, real back-pressure


def uring_available() -> bool:
    """Whether this kernel gives us an io_uring ring (else the tests of that backend are skipped)."""
    try:
        UringQueue(2).close()
        return True
    except OSError:
        return False


class QueueWrapper:
    """A real queue every operation passes through to; subclasses change or record some of them."""

    def __init__(self, inner):
        self.inner, self.kind = inner, inner.kind

    def submit_write(self, fd, view, offset, token):
        self.inner.submit_write(fd, view, offset, token)

    def submit_read(self, fd, view, offset, token):
        self.inner.submit_read(fd, view, offset, token)

    def wait(self, timeout):
        return self.inner.wait(timeout)

    def close(self):
        self.inner.close()


def refuse_uring(kind, depth, code=errno.ENOSYS):
    """INJECTED: the kernel refuses io_uring at queue init, as under seccomp or an old kernel."""
    if kind == "io_uring":
        raise OSError(code, "injected: io_uring_queue_init refused")
    return default_queue_factory(kind, depth)


def refuse_direct_open(path, flags, mode):
    """INJECTED: the file system refuses O_DIRECT at open (EINVAL), as some FUSE/NFS mounts do."""
    if flags & os.O_DIRECT:
        raise OSError(errno.EINVAL, "injected: O_DIRECT refused")
    return os.open(path, flags, mode)


class FaultQueue:
    """INJECTED: wraps a real queue; chosen operations complete with ``result(view)`` instead of
    reaching the file (``-ENOSPC``, a short count, ``-EINVAL``...).

    ``should_fail(fd, offset)`` picks the writes, ``should_fail_read(fd, offset)`` the reads."""

    def __init__(self, inner, should_fail, result, should_fail_read=None):
        self.inner, self.should_fail, self.result = inner, should_fail, result
        self.should_fail_read = should_fail_read or (lambda fd, offset: False)
        self.kind, self.fake, self.injected = inner.kind, [], 0

    def submit_write(self, fd, view, offset, token):
        if self.should_fail(fd, offset):
            self.injected += 1
            self.fake.append((token, self.result(view)))
        else:
            self.inner.submit_write(fd, view, offset, token)

    def submit_read(self, fd, view, offset, token):
        if self.should_fail_read(fd, offset):
            self.injected += 1
            self.fake.append((token, self.result(view)))
        else:
            self.inner.submit_read(fd, view, offset, token)

    def wait(self, timeout):
        if self.fake:
            out, self.fake = self.fake, []
            return out
        return self.inner.wait(timeout)

    def close(self):
        self.inner.close()


def faulty(should_fail, result, seen, should_fail_read=None):
    """A queue factory whose queues are :class:`FaultQueue` s (each appended to ``seen``)."""

    def factory(kind, depth):
        q = FaultQueue(default_queue_factory(kind, depth), should_fail, result, should_fail_read)
        seen.append(q)
        return q

    return factory
