"""The background half of a transition: waiting for the moments' transfer, installing them, and
completing and publishing the record; and the transient memory a transition used."""

from __future__ import annotations

import time
from typing import Optional

from ..errors import TransitionAbortedError
from ..log import logger
from ..zero.state import install_optimizer_state
from .members import reports
from .records import Record, ResizeRecord, format_resize


def complete_pending(engine) -> Optional[Record]:
    """Wait for the background transfer of the last resize or join (if one runs), install the
    moments, complete its record. Returns the record, or None when nothing was pending.

    Raises:
        TransitionAbortedError: a peer failed during the transfer; the engine then refuses to
            train (its new partitions are incomplete).
    """
    dt = getattr(engine, "_dt", None)
    pending = dt.pending if dt is not None else None
    if pending is None:
        return None
    t = time.perf_counter()
    try:
        stats = pending.transfer.wait()  # every wait inside is bounded by collective_timeout_s
    except TransitionAbortedError as err:
        dt.failed = str(err)
        dt.pending = None
        raise
    dt.pending = None
    if pending.group is not None:
        pending.group.shutdown()  # its sockets and threads go now, not when collected
    waited = time.perf_counter() - t
    if pending.dests is not None:
        install_optimizer_state(engine, [pending.dests[g] for g in sorted(pending.dests)], pending.scalars)
    pending.record.add_transfer(stats, waited, peak_extra_bytes(pending.rss_base))
    return pending.record


def publish(engine, rec: Record, first: Optional[str] = None) -> None:
    """Keep a completed resize or join record; rank 0 writes and prints a resize's (``first``: old
    rank 0's member id, which writes it where it stays, :func:`~ds_dynatrain.engine.members.reports`)."""
    dt = engine._dt
    if dt.retired:
        return
    dt.resizes.append(rec)
    writes = reports(dt, first) if first is not None else engine.global_rank == 0
    if writes and isinstance(rec, ResizeRecord):
        dt.metrics.write(rec)
        logger.info(format_resize(rec))


def wait_transition(engine) -> Optional[Record]:
    """:func:`complete_pending`, then :func:`publish` the record (see
    :meth:`~ds_dynatrain.engine.elastic_engine.ElasticEngine.wait_transition`)."""
    rec = complete_pending(engine)
    if rec is not None:
        publish(engine, rec)
    return rec


def _proc_status_bytes(name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def start_peak_rss() -> Optional[int]:
    """Reset the process's peak resident set (Linux ``clear_refs`` 5) and return the current
    resident set, bytes; None where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status_bytes("VmRSS")


def rss_peak_rise(base: Optional[int]) -> int:
    """Peak resident set since :func:`start_peak_rss` above ``base`` (its return), bytes; 0 if
    unmeasurable."""
    hwm = _proc_status_bytes("VmHWM")
    return 0 if base is None or hwm is None else max(0, hwm - base)


def peak_extra_bytes(base: Optional[int]) -> int:
    """Peak resident set since :func:`start_peak_rss` above both the start and the current
    resident set, bytes (0 if unmeasurable): the transient memory of the transition."""
    hwm, rss = _proc_status_bytes("VmHWM"), _proc_status_bytes("VmRSS")
    if base is None or hwm is None or rss is None:
        return 0
    return max(0, hwm - max(base, rss))
