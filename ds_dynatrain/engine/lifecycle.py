"""A worker's life around training: preemption notices (SIGTERM), the restore of a restarted job
from its latest snapshot, and what runs when the process exits."""

from __future__ import annotations

import atexit
import os
import signal
import threading

from io_engine import read_latest

from ..checkpoint.snapshot import SnapshotCheckpointEngine
from ..elastic.groups import close_all
from ..errors import SnapshotNotFoundError
from ..log import logger
from .pending import wait_transition
from .records import RestoreRecord
from .requests import cancel_pending_joiners
from .state import ElasticState


def take_preemption_notices(dt: ElasticState) -> None:
    """SIGTERM to a worker of a ``dynatrain launch`` job is a preemption notice: the process
    hands over its partitions and leaves at the next step boundary (the others shrink the job)
    instead of dying. A second SIGTERM ends the process at once. Only the main thread can install
    a signal handler; elsewhere nothing changes."""

    def on_sigterm(signum, _frame):
        if dt.preempted:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        dt.preempted = True
        logger.info(
            f"member {dt.member}: preemption notice (SIGTERM); "
            + ("it stops standing by" if dt.retired else "leaving at the next step boundary")
        )

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def check_restorable(snapshot_dir: str) -> str:
    """The tag a restore of ``snapshot_dir`` would load (what its ``latest`` names).

    Raises:
        SnapshotNotFoundError: the directory holds no complete snapshot.
    """
    tag = read_latest(snapshot_dir) if os.path.isdir(snapshot_dir) else None
    if tag is None:
        raise SnapshotNotFoundError(
            f"no snapshot to restore from in {snapshot_dir}: it has no readable 'latest' "
            "(the job failed before its first snapshot was committed)"
        )
    return tag


def restore(engine, snapshot_dir: str) -> None:
    """Load the latest complete snapshot of ``snapshot_dir`` (any saving world size) into a job the
    launcher restarted after a worker died; log and record how many steps were lost. Collective.

    Raises:
        SnapshotNotFoundError: no complete snapshot (before anything is loaded).
        CheckpointIncompleteError, LayoutMismatchError: as ``load_checkpoint``.
    """
    dt = engine._dt
    check_restorable(snapshot_dir)
    last = dt.membership.last_step()
    path, _client = engine.load_checkpoint(snapshot_dir)
    if path is None:
        raise SnapshotNotFoundError(f"no snapshot to restore from in {snapshot_dir}")
    lost = max(0, last - engine.global_steps)
    if engine.global_rank == 0:
        dt.metrics.write(
            RestoreRecord(
                step=engine.global_steps,
                world_size=engine.dp_world_size,
                lost_steps=lost,
                last_step=last,
                dir=os.path.dirname(path),
            )
        )
        logger.info(
            f"restored {os.path.dirname(path)} on {engine.dp_world_size} ranks: the job goes on after step "
            f"{engine.global_steps}; {lost} step(s) since that snapshot were lost"
        )


def at_thread_shutdown(fn, *args) -> None:
    """Run ``fn(*args)`` when the main thread finishes, before thread pools stop taking work.

    Python stops ``concurrent.futures`` executors from ``threading``'s shutdown hooks, which run
    *before* ``atexit`` handlers; the snapshot engine's io threads must still work when the last
    snapshot is finished at exit, so this hook is registered with ``threading`` (later
    registrations run first). Falls back to ``atexit`` where that hook does not exist.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython < 3.9
        atexit.register(fn, *args)
    else:
        register(fn, *args)


def close_at_exit(engine) -> None:
    """At exit: stop joiners that will never be needed; let the last snapshot finish and publish
    (bounded by the collective timeout)."""
    dt = getattr(engine, "_dt", None)
    if dt is not None and engine.is_member:
        cancel_pending_joiners(engine)
        if dt.membership is not None and engine.global_rank == 0:
            dt.membership.done()  # standby processes leave
        try:
            wait_transition(engine)  # peers may still be sending to or receiving from this process
        except Exception as err:  # noqa: BLE001 - exiting anyway; say why
            logger.warning(f"at exit: the last resize's transfer failed: {err}")
    ce = getattr(engine, "checkpoint_engine", None)
    if isinstance(ce, SnapshotCheckpointEngine):
        ce.close()


def shutdown() -> None:
    """Before the interpreter exits: destroy the process group (left to the interpreter's
    teardown, gloo's threads can outlive it and abort the process, status -6, after training
    finished), and move every object into the garbage collector's permanent generation
    (``gc.freeze``). The collections Python runs while it tears down modules otherwise traverse
    the whole object graph of torch, DeepSpeed and transformers again and again: about 2.5 s of
    CPU in a process that leaves a job at a resize, taken from the survivors' first steps on a
    shared host. Nothing is lost: the process is ending, and only cyclic garbage is left for the
    operating system to reclaim."""
    import gc

    import torch.distributed as tdist

    close_all()  # the cached groups too, not only the default one
    if tdist.is_initialized():
        tdist.destroy_process_group()
    gc.freeze()
