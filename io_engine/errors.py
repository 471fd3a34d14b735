"""The error family of ``io_engine``.

One root, :class:`IOEngineError`, so a caller can catch "storage went wrong" without listing
cases; below it two branches that mean different things to the caller:

* :class:`SnapshotFormatError` — the *file* is wrong (bad magic, corrupt footer, truncated,
  checksum mismatch). Retrying will not help; the snapshot must be skipped.
* :class:`StorageError` — the *storage* refused an operation (ENOSPC, EIO, short write, timeout,
  no usable I/O backend). The file being written must be considered absent.

Every message names the file, and where it applies the byte offset or the item key, so a log
line alone locates the problem.
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Optional


class IOEngineError(Exception):
    """Root of every error raised by ``io_engine``."""


class InvalidItemError(IOEngineError, ValueError):
    """An item description handed to the planner or writer is unusable (duplicate key, negative
    size, attrs that are not JSON, a non-contiguous buffer...). Raised before any byte is written."""


# --- the file does not follow the format -------------------------------------------------------


class SnapshotFormatError(IOEngineError):
    """A snapshot file is not a valid file of this format. ``path`` names it."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}")


class BadMagicError(SnapshotFormatError):
    """The header or trailer magic number is not ours: not a snapshot file, or overwritten."""


class UnsupportedVersionError(SnapshotFormatError):
    """The file declares a format version this code cannot read."""


class CorruptHeaderError(SnapshotFormatError):
    """The fixed header fails its checksum or holds impossible values."""


class CorruptFooterError(SnapshotFormatError):
    """The footer (metadata JSON) or trailer fails its checksum, does not parse, or describes
    items that do not fit in the file."""


class FileSizeMismatchError(SnapshotFormatError):
    """The file's length differs from the length its header records."""


class TruncatedFileError(FileSizeMismatchError):
    """The file is shorter than its header records (an interrupted copy or write)."""


class ChecksumMismatchError(SnapshotFormatError):
    """An item's payload does not match the checksum recorded in the footer. ``key`` names it."""

    def __init__(self, path: str, key: str, expected: str, actual: str, offset: Optional[int] = None, length=None):
        self.key = key
        self.expected = expected
        self.actual = actual
        self.offset = offset
        where = "" if offset is None else f", bytes [{offset}, {offset + (length or 0)}) of the file"
        super().__init__(
            path, f"checksum mismatch for item {key!r}{where}: footer says {expected}, the bytes have {actual}"
        )


class BadLatestError(SnapshotFormatError):
    """A snapshot directory's ``latest`` file does not name a tag of that directory: not UTF-8
    text, empty, a path (separators, ``..``) or a directory that does not exist."""


# --- the storage refused an operation ----------------------------------------------------------


class StorageError(IOEngineError):
    """An operation on ``path`` failed at the storage level."""

    def __init__(self, path: str, message: str, *, offset: Optional[int] = None, errno: Optional[int] = None):
        self.path = path
        self.offset = offset
        self.errno = errno
        where = f" at offset {offset}" if offset is not None else ""
        why = f": [Errno {errno}] {os.strerror(errno)}" if errno else ""
        super().__init__(f"{path}{where}: {message}{why}")


class StorageWriteError(StorageError):
    """A write (or the final truncate / fsync) failed: ENOSPC, EIO, ... The file is incomplete."""


class ShortWriteError(StorageWriteError):
    """The kernel accepted fewer bytes than asked; treated as an error, never retried silently."""


class StorageReadError(StorageError):
    """A read failed, returned fewer bytes than the file should hold, or asked for a range
    outside the file."""


class IOTimeoutError(StorageError, TimeoutError):
    """No completion arrived within the configured timeout (hung storage)."""


class BackendUnavailableError(StorageError):
    """The I/O backend that was explicitly requested (e.g. ``engine="io_uring"``) cannot be used."""


class HostCacheError(IOEngineError):
    """Misuse or exhaustion of the host cache."""


class HostCacheTimeoutError(HostCacheError, TimeoutError):
    """No host buffer became free within the timeout given to ``acquire``."""


def errno_name(code: Optional[int]) -> str:
    """``errno.errorcode`` name of ``code`` (``"ENOSPC"``), or ``"E?"`` when unknown."""
    return _errno.errorcode.get(code or 0, "E?")
