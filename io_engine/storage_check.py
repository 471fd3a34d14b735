"""Checking a snapshot directory before anything is trained or written there.

:func:`check_snapshot_dir` answers, once and up front, the questions a first snapshot would
otherwise answer late (after ``interval_steps`` of training) with a raw ``OSError``: does the
directory exist or can it be created, is it a directory, can a file be created, written and
removed there, and which write path the io engine will take there: O_DIRECT, or the buffered
fallback that :class:`~io_engine.backend.IOBackend` takes when the file system refuses O_DIRECT
(EINVAL at ``open`` or on the first write, as tmpfs and some FUSE and network file systems do).

The probe is one hidden file (``.dynatrain-probe-<pid>-<random>``) of one aligned block, created
exclusively, written with the flags a snapshot file gets, and removed again, whatever happens.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

from .backend import _DIRECT_REFUSALS, IOBackend
from .errors import StorageError, StorageWriteError, errno_name
from .host_cache import alloc_aligned

PROBE_PREFIX = ".dynatrain-probe-"
PROBE_BYTES = 4096  # one O_DIRECT block

Opener = Callable[[str, int, int], int]


@dataclass(frozen=True)
class DirCheck:
    """What :func:`check_snapshot_dir` found.

    path:           the directory, absolute.
    created:        it did not exist; the check created it (with its missing parents).
    direct:         snapshot files there are written with O_DIRECT.
    direct_refused: why not, when ``direct`` is False (``"O_DIRECT refused at open (EINVAL)"``,
                    ``"O_DIRECT not asked for"``); ``""`` when ``direct``.
    free_bytes:     bytes free there for an unprivileged writer (``statvfs``), at the check.
    """

    path: str
    created: bool
    direct: bool
    direct_refused: str
    free_bytes: int

    def describe(self) -> str:
        """One line for the log: ``snapshot directory /x: writable, 12.3 GiB free, O_DIRECT writes``."""
        how = "O_DIRECT writes" if self.direct else f"buffered writes ({self.direct_refused})"
        made = "created, " if self.created else ""
        return f"snapshot directory {self.path}: {made}writable, {self.free_bytes / 2**30:.1f} GiB free, {how}"


def check_snapshot_dir(
    path: Union[str, os.PathLike],
    *,
    direct: Union[str, bool] = "auto",
    opener: Optional[Opener] = None,
    backend: Optional[IOBackend] = None,
) -> DirCheck:
    """Check that snapshots can be written to directory ``path``; create it when it is missing.

    Args:
        path: the snapshot directory (relative paths are taken from the current directory).
        direct: as :class:`~io_engine.backend.IOConfig` ``direct``: ``"auto"`` (O_DIRECT, else the
            buffered fallback), ``True`` (a refusal of O_DIRECT is an error), ``False``.
        opener: ``os.open``'s signature (default ``os.open``); the seam that refuses O_DIRECT in tests.
        backend: probe through this backend instead (its ``config.direct`` and opener apply): a
            refusal of O_DIRECT is then recorded in it, so the files it writes there later open
            buffered at once, and it logs that fallback itself, once.

    Returns:
        A :class:`DirCheck`. Nothing is logged here unless ``backend`` is given.

    Raises:
        StorageWriteError: naming ``path`` and the reason: it exists and is not a directory; it
            cannot be created (a parent is a file, no permission, a read-only file system...); a
            file cannot be created, written or removed there (EROFS, EACCES, ENOSPC, EDQUOT...);
            or O_DIRECT was required (``direct=True``) and is refused.
    """
    raw = os.fspath(path)
    if not raw:
        raise StorageWriteError("''", "an empty path names no directory")
    where = os.path.abspath(raw)
    created = _ensure_dir(where)
    used_direct, refused = _probe(where, direct, opener or os.open, backend)
    try:
        st = os.statvfs(where)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return DirCheck(where, created, used_direct, refused, free)


def _ensure_dir(path: str) -> bool:
    """Make sure ``path`` is a directory; True when this call created it."""
    if os.path.isdir(path):
        return False
    if os.path.lexists(path):
        what = "a broken symbolic link" if not os.path.exists(path) else "a file"
        raise StorageWriteError(path, f"exists and is {what}, not a directory")
    try:
        os.makedirs(path, exist_ok=True)  # exist_ok: another process may create it at the same time
    except OSError as err:
        above = _existing_ancestor(path)
        if not os.path.isdir(above):
            raise StorageWriteError(path, f"cannot be created: {above} is a file, not a directory") from None
        raise StorageWriteError(path, f"cannot be created in {above}", errno=err.errno) from None
    if not os.path.isdir(path):  # pragma: no cover - replaced by something else meanwhile
        raise StorageWriteError(path, "was created but is not a directory")
    return True


def _existing_ancestor(path: str) -> str:
    """The nearest ancestor of ``path`` that exists (a directory, or the file in the way)."""
    p = os.path.dirname(path)
    while p and not os.path.lexists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def _probe(path: str, direct, opener: Opener, backend: Optional[IOBackend]) -> Tuple[bool, str]:
    """Create, write and remove one probe file in ``path``: ``(O_DIRECT used, why not)``."""
    name = os.path.join(path, f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    block = alloc_aligned(PROBE_BYTES)
    fd = -1
    try:
        fd, used_direct, refused = _open_probe(path, name, direct, opener, backend)
    except BaseException:
        _close_and_remove(-1, block, name)  # an open refused for O_DIRECT may have created it
        raise
    try:
        try:
            n = os.pwrite(fd, block, 0)
        except OSError as err:
            auto = (backend.config.direct if backend is not None else direct) == "auto"
            if not (used_direct and auto and err.errno in _DIRECT_REFUSALS):
                raise _not_writable(path, f"writing {PROBE_BYTES} bytes there failed", err.errno) from None
            refused = f"O_DIRECT refused on the first write ({errno_name(err.errno)})"
            os.close(fd)
            fd, used_direct = -1, False
            if backend is not None:
                backend.note_direct_refused(name, refused)
            fd = _open_or_fail(path, opener, name, os.O_WRONLY | os.O_CLOEXEC)
            n = _write_or_fail(path, fd, block)
        if n != PROBE_BYTES:
            raise _not_writable(path, f"a write of {PROBE_BYTES} bytes there wrote {n}", None)
    except BaseException:
        _close_and_remove(fd, block, name)  # the first failure is the one reported
        raise
    _close_and_remove(fd, block, None)
    _remove_probe(path, name)
    return used_direct, refused


def _close_and_remove(fd: int, block, name: Optional[str]) -> None:
    """Close the probe's descriptor and buffer; remove the file ``name`` too, quietly, when given."""
    if fd >= 0:
        os.close(fd)
    block.close()
    if name is not None:
        try:
            os.unlink(name)
        except OSError:
            pass


def _open_probe(path: str, name: str, direct, opener: Opener, backend: Optional[IOBackend]):
    """Open the probe file for writing: ``(fd, O_DIRECT used, why not)``."""
    if backend is not None:
        try:
            fd, used_direct = backend.open_file(name, write=True)
        except StorageError as err:
            raise _not_writable(path, "creating a file there failed", err.errno) from None
        if used_direct:
            return fd, True, ""
        asked = backend.config.direct is not False
        return fd, False, "O_DIRECT refused on this file system" if asked else "O_DIRECT not asked for"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    if direct is False:
        return _open_or_fail(path, opener, name, flags), False, "O_DIRECT not asked for"
    try:
        return opener(name, flags | os.O_DIRECT, 0o600), True, ""
    except OSError as err:
        if err.errno not in _DIRECT_REFUSALS:
            raise _not_writable(path, "creating a file there failed", err.errno) from None
        if direct is True:
            raise StorageWriteError(
                path, "O_DIRECT was required but the file system refuses it", errno=err.errno
            ) from None
        refused = f"O_DIRECT refused at open ({errno_name(err.errno)})"
    # without O_EXCL: an open refused for O_DIRECT may have created the file already (the name is ours)
    return _open_or_fail(path, opener, name, flags & ~os.O_EXCL), False, refused


def _open_or_fail(path: str, opener: Opener, name: str, flags: int) -> int:
    try:
        return opener(name, flags, 0o600)
    except OSError as err:
        raise _not_writable(path, "creating a file there failed", err.errno) from None


def _write_or_fail(path: str, fd: int, block) -> int:
    try:
        return os.pwrite(fd, block, 0)
    except OSError as err:
        raise _not_writable(path, f"writing {PROBE_BYTES} bytes there failed", err.errno) from None


def _remove_probe(path: str, name: str) -> None:
    try:
        os.unlink(name)
    except OSError as err:
        raise _not_writable(path, f"the probe file {os.path.basename(name)} cannot be removed", err.errno) from None


def _not_writable(path: str, what: str, code: Optional[int]) -> StorageWriteError:
    name = f" ({errno_name(code)})" if code else ""
    return StorageWriteError(path, f"is not writable: {what}{name}", errno=code)


__all__ = ["DirCheck", "PROBE_PREFIX", "check_snapshot_dir"]
