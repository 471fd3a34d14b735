"""Reserving a new file's blocks before its O_DIRECT writes, so they run side by side.

A direct write that extends a file, or lands on blocks not yet allocated, takes the inode lock
exclusively on ext4 (``ext4_dio_write_checks`` in ``fs/ext4/file.c``: "extending I/O, any form of
non-overwrite I/O") and XFS; io_uring then hands each such write to a kernel worker, and up to
``queue_depth`` workers spin on one lock. Allocating the file's whole size first (``fallocate(2)``,
mode 0: blocks reserved as unwritten extents, size set) makes every aligned write an overwrite
inside the file, done under the shared lock. Measured on a virtio disk with ext4, a 650 MiB file
written from one buffer: 0.01 s of CPU (system-wide) instead of 0.06-0.12 s, and 2.3 instead of
2.0 GB/s; beside a training job, the spinning workers had taken about 2 % of both cores.

Python has only ``os.posix_fallocate``, whose C library version writes a byte into every block
where the file system cannot allocate (minutes for a large file); ``fallocate`` itself is called
through ``ctypes`` and simply skipped where the file system refuses it.
"""

from __future__ import annotations

import ctypes
import errno
from typing import Optional

from .errors import StorageWriteError

# the file system cannot reserve blocks: writing goes on without a reservation
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV, errno.EPERM}


def _libc_fallocate():
    """The C library's ``fallocate`` with 64-bit offsets (``fallocate64``; plain ``fallocate`` where
    ``off_t`` is 64 bits wide), or None where it has neither."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except Exception:  # noqa: BLE001 - no C library to load
        return None
    fn = getattr(libc, "fallocate64", None)
    if fn is None and ctypes.sizeof(ctypes.c_long) == 8:
        fn = getattr(libc, "fallocate", None)
    if fn is None:
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _libc_fallocate()


def reserve(fd: int, nbytes: int, path: str) -> bool:
    """Allocate bytes ``[0, nbytes)`` of the open file ``fd`` (``path`` names it in errors) and
    set its size to at least ``nbytes``; the blocks read as zeros until written.

    Returns True when reserved, False where the file system or C library cannot (nothing done).
    Raises :class:`StorageWriteError` when the device has no room (``ENOSPC``, ``EDQUOT``) or
    another error occurs: the write would fail later anyway, and now nothing is written yet.
    """
    if nbytes <= 0 or _FALLOCATE is None:
        return False
    while True:
        if _FALLOCATE(fd, 0, 0, nbytes) == 0:
            return True
        err: Optional[int] = ctypes.get_errno()
        if err != errno.EINTR:  # a signal during the call (FUSE, NFS): again
            break
    if err in _UNSUPPORTED:
        return False
    raise StorageWriteError(path, f"reserving {nbytes} bytes failed", offset=0, errno=err)
