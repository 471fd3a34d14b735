"""A worker's life around training: preemption notices (SIGTERM to one worker), the stop of the
whole job at a step boundary (a signal to the launcher), and what runs when the process exits."""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import Optional

from ..checkpoint.snapshot import SnapshotCheckpointEngine
from ..elastic.groups import close_all
from ..errors import SnapshotWriteError
from ..log import logger
from ..zero.comm import release_process_groups
from . import broken
from .pending import wait_transition
from .replicas import close_replicas
from .requests import cancel_pending_joiners
from .state import ElasticState
from .switch_memory import release_switch_memory


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


def stop_job(engine, signum: int, why: str) -> None:
    """End the job at this step boundary, on every rank alike (each learned ``signum`` from the
    step's vote): joiners that will never be needed are stopped, a final snapshot of this step is
    taken and committed when the job takes snapshots (``latest`` names it), and the process ends
    with status 0 (``SystemExit(0)``, raised from ``engine.step()``: the script's code after its
    training loop does not run; the exit hooks do). Collective. A final snapshot that cannot be
    written is logged on every rank; ``latest`` then keeps naming the previous one.

    Raises:
        SystemExit: always (status 0).
    """
    dt = engine._dt
    step, name = engine.global_steps, signal.Signals(signum).name
    cancel_pending_joiners(engine)  # rank 0: a prepared request is given up, its joiners stopped
    snap = dt.config.snapshot
    committed = None
    if snap.interval_steps:
        problem = _final_snapshot(engine, snap.dir, f"global_step{step}")
        if problem is None:
            committed = os.path.join(snap.dir, f"global_step{step}")
        else:
            logger.error(f"member {dt.member}: the final snapshot of step {step} failed: {problem}")
    if engine.global_rank == 0:
        if dt.membership is not None:
            dt.membership.stopped(step, signum)
        logger.info(
            f"job stopped after step {step} ({why}, {name})"
            + (f": final snapshot {committed} committed" if committed else "")
            + ("; no snapshot (snapshots are off)" if not snap.interval_steps else "")
        )
    raise SystemExit(0)


def _final_snapshot(engine, directory: str, tag: str) -> Optional[str]:
    """Save ``tag`` and wait for its commit; None when committed, else why not. A failure of an
    earlier snapshot that the next save raises (``on_write_error: "raise"``) is reported and the
    save tried once more: the final one must not be lost to an older one's failure."""
    problems = []
    for _attempt in range(2):
        try:
            engine.save_checkpoint(directory, tag=tag)
        except SnapshotWriteError as err:  # an earlier snapshot's failure, raised at this save
            problems.append(str(err))
            continue
        ce = engine.checkpoint_engine
        try:
            if isinstance(ce, SnapshotCheckpointEngine):
                ce.wait()
            return None
        except SnapshotWriteError as err:  # this snapshot itself
            problems.append(str(err))
            break
    return "; ".join(problems)


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


_AT_EXIT = {"collect": False}  # set by close_at_exit, read by shutdown (which runs after it)


def close_at_exit(engine) -> None:
    """At exit: stop joiners that will never be needed; let the last snapshot finish and publish
    (bounded by the collective timeout); then drop DeepSpeed's references to its process groups,
    so that their gloo threads end now, not during the interpreter's teardown
    (:func:`~ds_dynatrain.zero.comm.release_process_groups`)."""
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
    if dt is not None:
        close_replicas(dt)  # the replica group's gloo threads end now too
        release_switch_memory(dt)  # a prepared switch that did not come
        # an engine rebuilt in place (a resize, a TP switch) left its earlier engines' objects in
        # reference cycles that hold their process groups: collected at exit (``shutdown``)
        _AT_EXIT["collect"] |= engine.is_member and (dt.generation > 0 or bool(dt.resizes))
    release_process_groups(engine)


def shutdown() -> None:
    """Before the interpreter exits: destroy the process group and every cached one (left to the
    interpreter's teardown, gloo's threads can outlive it and abort the process, status -6, after
    training finished: see :func:`~ds_dynatrain.zero.comm.release_process_groups`), and move
    every object into the garbage collector's permanent generation (``gc.freeze``), after one
    collection where a recovery or a rebuild in place left engines in cycles (a process that stays
    to the end of a job; a process that leaves at a resize does not pay it). The
    collections Python runs while it tears down modules otherwise traverse the whole object graph
    of torch, DeepSpeed and transformers again and again: about 2.5 s of CPU in a process that
    leaves a job at a resize, taken from the survivors' first steps on a shared host. Nothing is
    lost: the process is ending, and only cyclic garbage is left for the operating system to
    reclaim."""
    import gc

    import torch.distributed as tdist

    close_all()  # the cached groups too, not only the default one
    if tdist.is_initialized():
        tdist.destroy_process_group()
    if broken.releases or _AT_EXIT["collect"]:
        # a failed generation let go in a recovery, or the earlier engines of one rebuilt in place:
        # their groups held in cycles go now, not at the interpreter's teardown (where a gloo
        # thread ending aborts the process, "terminate called without an active exception")
        gc.collect()
    gc.freeze()
