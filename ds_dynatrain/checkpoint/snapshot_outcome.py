"""The outcome of one snapshot, as every rank learns it, and what a failure says.

Rank 0 decides the outcome once every rank reported (its files synced, or its error) and posts it
to the job's store as one JSON value; every rank reads that same value, so all ranks agree on
"committed" or "failed", on the failed ranks and on their causes, even when a write failed on one
rank only. :class:`SnapshotOutcome` is what the snapshot engine hands to its ``on_outcome``
callback (the elastic engine writes the metrics record of it, on rank 0).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Tuple

from io_engine import read_latest
from io_engine.errors import IOEngineError, errno_name

from ..errors import SnapshotWriteError
from ..log import logger

_STEP_TAG = re.compile(r"global_step(\d+)")


@dataclass(frozen=True)
class SnapshotOutcome:
    """One snapshot's outcome, the same on every rank.

    tag, dir:      the snapshot (``dir/tag`` when committed).
    ok:            committed: every rank's files written and synced, the directory published.
    error:         why it failed (each failed rank and its cause); ``""`` when ``ok``.
    failed_ranks:  the ranks whose writes failed (empty when ``ok``, or when no rank reported).
    step:          the global step saved (from the state DeepSpeed saves, or a ``global_stepN`` tag);
                   None when neither tells.
    save_s:        seconds ``save_checkpoint`` spent in the training loop on this rank.
    seconds:       seconds from the save to the decision (rank 0's flush and the agreement).
    bytes:         bytes of the files every reporting rank wrote.
    capture_s:     the slowest rank's seconds from the save until its state was no longer read
                   (copied into the host cache, or written from its own memory).
    flush_s:       the slowest rank's seconds from then until its files were synced.
    """

    tag: str
    dir: str
    ok: bool
    error: str = ""
    failed_ranks: Tuple[int, ...] = ()
    step: Optional[int] = None
    save_s: float = 0.0
    seconds: float = 0.0
    bytes: int = 0
    capture_s: float = 0.0
    flush_s: float = 0.0

    @staticmethod
    def of(tag: str, save_dir: str, got: dict, saved_step, save_s: float, t0: float) -> "SnapshotOutcome":
        """The outcome of a decoded store value ``got`` (:func:`read_outcome`)."""
        return SnapshotOutcome(
            tag=tag,
            dir=save_dir,
            ok=got["ok"],
            error="" if got["ok"] else str(got.get("error", "")),
            failed_ranks=tuple(int(r) for r in got.get("ranks", ())),
            step=step_of(tag, saved_step),
            save_s=save_s,
            seconds=float(got.get("seconds") or time.perf_counter() - t0),
            bytes=int(got.get("bytes", 0)),
            capture_s=float(got.get("capture_s", 0.0)),
            flush_s=float(got.get("flush_s", 0.0)),
        )


def read_outcome(store, key: str, timeout_s: float) -> dict:
    """Wait (at most ``timeout_s``) for the outcome rank 0 posts under ``key`` and decode it; no
    outcome in time is a failure that says so."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return decode(store.get(key))
    except RuntimeError as err:
        return {"ok": False, "error": f"no outcome within {timeout_s:.0f} s ({err})", "ranks": [], "unanswered": True}


def encode(ok: bool, error: str = "", ranks=(), seconds: float = 0.0, totals: Optional[dict] = None) -> str:
    """The store value of an outcome (rank 0 writes it once); ``totals``: the ranks' reports
    summed (:func:`sum_reports`)."""
    return json.dumps({"ok": bool(ok), "error": error, "ranks": sorted(ranks), "seconds": seconds, **(totals or {})})


def rank_report(jobs, t0: float) -> str:
    """One rank's figures of a snapshot, for rank 0 to sum: ``bytes`` of its files, ``capture_s``
    (from the save at ``t0`` until its last file was captured) and ``flush_s`` (from then until its
    last file was synced). ``jobs`` have ``nbytes``, ``captured_at`` and ``persisted_at``."""
    if not jobs:
        return json.dumps({"bytes": 0, "capture_s": 0.0, "flush_s": 0.0})
    captured = max(j.captured_at for j in jobs)
    persisted = max(j.persisted_at for j in jobs)
    return json.dumps(
        {"bytes": sum(j.nbytes for j in jobs), "capture_s": captured - t0, "flush_s": max(0.0, persisted - captured)}
    )


def sum_reports(raws) -> dict:
    """The job's figures from the ranks' reports (raw store values; an unreadable one counts
    nothing): bytes summed, the slowest rank's capture and flush seconds."""
    out = {"bytes": 0, "capture_s": 0.0, "flush_s": 0.0}
    for raw in raws:
        try:
            rep = json.loads(raw.decode("utf-8"))
            out["bytes"] += int(rep["bytes"])
            out["capture_s"] = max(out["capture_s"], float(rep["capture_s"]))
            out["flush_s"] = max(out["flush_s"], float(rep["flush_s"]))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError):
            continue
    return out


def decode(raw: bytes) -> dict:
    """The store value back: ``{"ok", "error", "ranks", "seconds"}``; a value that does not parse
    is a failure that says so (never an ok)."""
    try:
        out = json.loads(raw.decode("utf-8"))
        if isinstance(out, dict) and isinstance(out.get("ok"), bool):
            return out
    except (UnicodeDecodeError, ValueError):
        pass
    return {"ok": False, "error": f"unreadable outcome {raw[:80]!r}", "ranks": [], "seconds": 0.0}


def step_of(tag: str, saved_step) -> Optional[int]:
    """The step a snapshot holds: what DeepSpeed saved as ``global_steps``, else a ``global_stepN`` tag's N."""
    if isinstance(saved_step, int) and not isinstance(saved_step, bool):
        return saved_step
    m = _STEP_TAG.fullmatch(tag)
    return int(m.group(1)) if m else None


def cause(err: BaseException) -> str:
    """One rank's error as its report says it: the message, and the errno's name when it has one
    (``... No space left on device (ENOSPC)``)."""
    code = getattr(err, "errno", None)
    text = f"{err}" or type(err).__name__
    return f"{text} ({errno_name(code)})" if code else text


def latest_of(save_dir: str) -> str:
    """What ``save_dir/latest`` names, for a message (never raises)."""
    try:
        return repr(read_latest(save_dir))
    except IOEngineError as err:
        return f"nothing readable ({err})"


def published(snap) -> bool:
    """Whether rank 0 committed ``snap`` (a ``_Snapshot`` of
    :mod:`~ds_dynatrain.checkpoint.snapshot`), read off the files alone, for when the store
    cannot say: its temporary directory is gone, and the final directory holds every file this
    rank wrote for it, at its size, written since the save began (not an older snapshot of the
    same tag); when the save names ``latest``, ``latest`` names the tag. Never raises."""
    if not snap.jobs or os.path.exists(snap.tmp_dir) or not os.path.isdir(snap.final_dir):
        return False
    try:
        if snap.info.save_latest and read_latest(snap.info.save_dir) != snap.info.tag:
            return False
        for job in snap.jobs:
            if job.error is not None or not job.path.startswith(snap.tmp_dir + os.sep):
                return False
            st = os.stat(snap.final_path(job.path))
            if st.st_size != job.nbytes or st.st_mtime < snap.wall_t0 - 1.0:  # 1 s: the file clock is coarse
                return False
    except (OSError, IOEngineError):
        return False
    return True


def write_error(final_dir: str, save_dir: str, error: str) -> SnapshotWriteError:
    """The error of a failed snapshot: the directory it was not committed to, every failed rank's
    cause, and what ``latest`` still names."""
    return SnapshotWriteError(
        f"snapshot {final_dir} was not committed, a write failed ({error}); 'latest' still names {latest_of(save_dir)}"
    )


class OutcomeTracking:
    """The outcome side of the snapshot engine (a mixin of
    :class:`~ds_dynatrain.checkpoint.snapshot.SnapshotCheckpointEngine`, whose attributes it uses:
    ``_last``, ``_unreported``, ``store``, ``timeout_s``, ``stats``, ``on_outcome``,
    ``on_write_error``): each committed snapshot's outcome read once, counted, handed to
    ``on_outcome``, and a failure raised or logged as ``on_write_error`` says."""

    def _poll(self) -> None:
        """Take note of the last snapshot's outcome if rank 0 has posted it (no wait): logged and
        handed to ``on_outcome`` now rather than at the next save. A failure under ``"raise"`` is
        kept for the next ``create``, where every rank raises at the same save."""
        snap = self._last
        if snap is None or not all(j.persisted.is_set() for j in snap.jobs):
            return
        try:
            if not self.store.check([f"{snap.key}/outcome"]):
                return
        except RuntimeError:  # the store is gone (the job is ending): the outcome waits for close
            return
        err = self._settle()
        if err is not None and self.on_write_error == "raise":
            self._unreported = err
        else:
            self._report(err)

    def _settle(self) -> Optional[SnapshotWriteError]:
        """Wait for the last committed snapshot's outcome (bounded by ``timeout_s``), count it,
        hand it to ``on_outcome``; return the failure not yet reported (this one's or an earlier
        one's), or None."""
        snap, self._last = self._last, None
        if snap is not None:
            err = self._outcome_of(snap)
            self._unreported = self._unreported or err
        err, self._unreported = self._unreported, None
        return err

    def _outcome_of(self, snap) -> Optional[SnapshotWriteError]:
        got = read_outcome(self.store, f"{snap.key}/outcome", self.timeout_s)
        if got.get("unanswered") and published(snap):
            # rank 0 published it, then the store went (the job is ending): the files are the truth
            logger.warning(
                f"snapshot {snap.info.tag}: the job's store gave no outcome ({got['error']}), but the snapshot is "
                f"committed: {snap.final_dir} holds this rank's files of this save"
                + (" and 'latest' names it" if snap.info.save_latest else "")
            )
            got = {"ok": True, "ranks": []}
        for j in snap.jobs:
            self.stats["persist_s"] += j.seconds
            self.stats["bytes"] += j.nbytes
            self.stats["from_source_bytes"] += j.from_source_bytes
        info = snap.info
        outcome = SnapshotOutcome.of(info.tag, info.save_dir, got, snap.saved_step, snap.save_s, snap.t0)
        if self.on_outcome is not None:
            try:
                self.on_outcome(outcome)
            except Exception as err:  # noqa: BLE001 - a record that cannot be written must not stop training
                logger.warning(f"snapshot {info.tag}: its outcome could not be recorded: {err}")
        return None if outcome.ok else write_error(snap.final_dir, info.save_dir, outcome.error)

    def _report(self, err: Optional[SnapshotWriteError]) -> None:
        """Apply ``on_write_error`` to a failed snapshot: raise it, or log it and go on."""
        if err is None:
            return
        if self.on_write_error == "raise":
            raise err
        logger.warning(
            f"{err}; training goes on (dynatrain.snapshot.on_write_error is 'warn'), the next snapshot tries again"
        )
