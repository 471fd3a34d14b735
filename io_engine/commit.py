"""Crash-consistent publication of a snapshot directory.

A snapshot is written into a hidden temporary directory, every file is synced, and only then is
the directory renamed to its final name and ``latest`` replaced (write to a temporary file, fsync,
rename, fsync the parent). A crash at any point leaves either the previous snapshot and the
previous ``latest``, or the new ones: never a ``latest`` naming an incomplete directory.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Iterable, List, Optional

from .errors import BadLatestError

LATEST = "latest"
TMP_PREFIX = ".tmp-"


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (tmp file, fsync, rename, fsync parent)."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, f"{TMP_PREFIX}{os.path.basename(path)}.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(parent)


def publish_dir(tmp_dir: str, final_dir: str) -> None:
    """Rename the complete ``tmp_dir`` to ``final_dir`` (replacing an older one of that name)."""
    parent = os.path.dirname(os.path.abspath(final_dir))
    for root, _dirs, files in os.walk(tmp_dir):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)
    old = None
    if os.path.exists(final_dir):
        old = os.path.join(parent, f"{TMP_PREFIX}old-{os.path.basename(final_dir)}.{os.getpid()}")
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


MAX_TAG_BYTES = 255  # a tag is one directory name


def check_tag(save_dir: str, tag: str, source: str = "tag") -> str:
    """``tag`` if it names a directory directly under ``save_dir``: one path component (no
    separators, not ``.``/``..``, no NUL, at most 255 bytes), not a hidden temporary one.

    Raises:
        BadLatestError: naming ``source`` (e.g. ``save_dir/latest``) and what is wrong.
    """
    bad = None
    if not tag:
        bad = "is empty"
    elif len(tag.encode("utf-8", "surrogateescape")) > MAX_TAG_BYTES or "\0" in tag:
        bad = f"holds {tag[:40]!r}..., not a directory name"
    elif "/" in tag or (os.sep != "/" and os.sep in tag) or tag in (".", ".."):
        bad = f"names {tag!r}, a path rather than a tag of {save_dir} (no separators or '..' allowed)"
    elif tag.startswith(TMP_PREFIX):
        bad = f"names {tag!r}, an unpublished temporary directory"
    elif not os.path.isdir(os.path.join(save_dir, tag)):
        bad = f"names {tag!r}, but {save_dir} has no such directory"
    if bad is not None:
        raise BadLatestError(source, bad)
    return tag


def read_latest(save_dir: str) -> Optional[str]:
    """The tag ``save_dir/latest`` names, checked with :func:`check_tag`; None when there is no
    ``latest`` (or ``save_dir`` is not a directory).

    Raises:
        BadLatestError: ``latest`` is unreadable, not UTF-8, empty, or does not name a tag
            directory of ``save_dir`` (the message names the file and the reason).
    """
    path = os.path.join(save_dir, LATEST)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TAG_BYTES + 2)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        raise BadLatestError(path, f"cannot be read ({err.strerror or err})") from None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise BadLatestError(path, f"is not UTF-8 text (starts {raw[:16]!r})") from None
    return check_tag(save_dir, tag, path)


def _step_of(tag: str) -> int:
    m = re.search(r"(\d+)$", tag)
    return int(m.group(1)) if m else -1


def prune_snapshots(
    save_dir: str, keep_last: int, protect: Iterable[str] = (), pattern: Optional[str] = None
) -> List[str]:
    """Delete complete snapshot directories beyond the newest ``keep_last`` (by trailing step number).

    Only directories whose whole name matches ``pattern`` (a regular expression; None: every
    directory) are candidates, so tags a user chose (``best``) are never pruned. Hidden temporary
    directories and the protected tags are never touched. Returns the deleted tags.
    """
    protect = set(protect)
    tags = [
        d
        for d in os.listdir(save_dir)
        if os.path.isdir(os.path.join(save_dir, d))
        and not d.startswith(".")
        and (pattern is None or re.fullmatch(pattern, d))
    ]
    tags.sort(key=_step_of)
    doomed = [t for t in tags[: max(0, len(tags) - keep_last)] if t not in protect]
    for t in doomed:
        # renamed out of sight first (atomic), then deleted: a process killed while deleting
        # leaves a hidden directory that remove_stale cleans, never a half-deleted snapshot
        gone = os.path.join(save_dir, f"{TMP_PREFIX}pruned-{t}.{os.getpid()}")
        try:
            os.replace(os.path.join(save_dir, t), gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)
    return doomed


def remove_stale(save_dir: str) -> List[str]:
    """Delete what killed writers left in ``save_dir``: hidden ``.tmp-`` directories and files
    (unpublished snapshot directories, half-pruned ones, temporary ``latest`` files). Call it only
    where no write of this directory is in flight (the snapshot engine does, on rank 0, right
    after a commit). Returns the names deleted."""
    out = []
    for name in os.listdir(save_dir):
        if not name.startswith(TMP_PREFIX):
            continue
        path = os.path.join(save_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                continue
        out.append(name)
    return out
