"""Soak part 2: SIGKILL at random moments of a snapshot flush (``SOAK_KILLS``, default 100).

A process writes snapshots one after another through the plugin's snapshot engine
(``tests/workers/soak_flush_worker.py``: the engine, its io_uring/O_DIRECT writer, the commit,
``latest``, pruning; the state of step N a deterministic function of N). It is started from a
forkserver that has imported torch and DeepSpeed once, lets 0-2 snapshots complete, and is
killed with SIGKILL (the fault, injected from outside) at a random time within the next
snapshot's flush: uniformly over a flush's measured duration, a third of the kills in its last
part (the commit: rename, ``latest``, prune). After every kill, the oracle:

* ``latest`` is absent only before the first commit, and otherwise names a published directory
  (``io_engine.read_latest``, which refuses a torn or foreign ``latest``);
* it names a step no older than the last snapshot the process saw committed (nothing committed is
  lost) and no newer than the one in flight;
* every published ``global_step<N>`` directory loads (CRC-checked) bitwise equal to the state of
  step N.

The next process goes on from ``latest`` + 1, as a restarted job would. Figures: kills, unloadable
``latest``, mismatches, where the kills landed (judged from the directory afterwards) and the
temporary directories the killed flushes left behind.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import shutil
import signal
import statistics
import sys
import time

import pytest
import soaklib

KILLS = soaklib.count("SOAK_KILLS", 100)
pytestmark = pytest.mark.soak

if soaklib.ROOT not in sys.path:
    sys.path.insert(0, soaklib.ROOT)  # the forkserver imports the worker as tests.workers.soak_flush_worker


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.workers.soak_flush_worker"])
    return ctx


def _start(ctx, save_dir: str, first_step: int, count=None):
    from tests.workers import soak_flush_worker

    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=soak_flush_worker.run, args=(save_dir, first_step, send, count), daemon=True)
    p.start()
    send.close()
    return p, recv


def _next(recv, p, timeout: float):
    """The worker's next message; fails the test when it errs, dies or stays silent."""
    if not recv.poll(timeout):
        raise AssertionError(f"the snapshot worker sent nothing within {timeout} s (exit {p.exitcode})")
    msg = recv.recv()
    assert msg[0] != "error", msg
    return msg


def _drain(recv):
    """The messages a killed worker sent before it died."""
    out = []
    try:
        while recv.poll(0):
            out.append(recv.recv())
    except EOFError:
        pass
    return out


def _calibrate(ctx, save_dir: str):
    """Three snapshots without a kill: the median flush duration, seconds."""
    p, recv = _start(ctx, save_dir, 1, count=3)
    durations = []
    try:
        while len(durations) < 3:
            msg = _next(recv, p, 120)
            if msg[0] == "done":
                durations.append(msg[2])
        p.join(60)
        assert p.exitcode == 0, p.exitcode
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    return statistics.median(durations)


def _published(save_dir: str):
    return sorted((int(m.group(1)), d) for d in os.listdir(save_dir) if (m := re.fullmatch(r"global_step(\d+)", d)))


def _check(save_dir: str, in_flight: int, committed: int, problems: list):
    """The oracle after one kill; returns (latest step or None, where the kill landed, temporary
    directories left, older snapshot directories left half-deleted by a killed prune)."""
    from io_engine import read_latest
    from io_engine.errors import IOEngineError
    from tests.workers.soak_flush_worker import MODEL_FILE, OPTIM_FILE, difference, load_snapshot, state_of

    files = (MODEL_FILE, OPTIM_FILE)

    try:
        tag = read_latest(save_dir)
    except IOEngineError as err:
        problems.append(f"kill during step {in_flight}: unloadable latest: {err}")
        return None, "unloadable", 0, 0
    latest = None if tag is None else int(re.fullmatch(r"global_step(\d+)", tag).group(1))
    if latest is None and committed:
        problems.append(f"kill during step {in_flight}: no latest after step {committed} was committed")
    if latest is not None and not committed <= latest <= in_flight:
        problems.append(f"kill during step {in_flight}: latest names step {latest}, committed {committed}")
    half_pruned = 0
    for step, d in _published(save_dir):
        path = os.path.join(save_dir, d)
        if latest is not None and step < latest and not all(os.path.exists(os.path.join(path, f)) for f in files):
            half_pruned += 1  # killed while pruning it: files missing (a load says so), not silently wrong
            shutil.rmtree(path)
            continue
        try:
            got = load_snapshot(path)
        except Exception as err:  # noqa: BLE001 - any failure to load a published snapshot is a finding
            problems.append(f"kill during step {in_flight}: {d} does not load: {type(err).__name__}: {err}")
            continue
        diff = difference(got, state_of(step))
        if diff:
            problems.append(f"kill during step {in_flight}: {d} differs from the state of step {step}: {diff}")
    published = {s for s, _ in _published(save_dir)}
    where = (
        "latest moved"
        if latest == in_flight
        else "published, latest not yet moved"
        if in_flight in published
        else "before publication"
    )
    # what killed writes left; the engine's next commit removes them (io_engine.remove_stale)
    tmp = [d for d in os.listdir(save_dir) if d.startswith(".tmp-")]
    return latest, where, len(tmp), half_pruned


@pytest.mark.timeout(300 + 20 * KILLS)
def test_sigkill_during_snapshot_flushes(tmp_path):
    t_start = time.monotonic()
    ctx = _context()
    save_dir = str(tmp_path / "snapshots")
    flush_s = _calibrate(ctx, save_dir)
    rng = random.Random(soaklib.seed())
    committed = 3  # the calibration's
    problems, where, leftovers, half_pruned = [], {}, 0, 0  # leftovers: the most present after a kill
    next_step = committed + 1
    for _ in range(KILLS):
        before = rng.randint(0, 2)
        delay = rng.uniform(0.6, 1.2) * flush_s if rng.random() < 1 / 3 else rng.uniform(0.0, 1.2) * flush_s
        p, recv = _start(ctx, save_dir, next_step)
        starts = 0
        try:
            while True:
                msg = _next(recv, p, 120)
                if msg[0] == "done":
                    committed = max(committed, msg[1])
                elif msg[0] == "start":
                    starts += 1
                    if starts > before:
                        in_flight = msg[1]
                        break
            time.sleep(delay)
            os.kill(p.pid, signal.SIGKILL)  # INJECTED fault: the process dies mid-flush
            p.join(30)
            for msg in _drain(recv):
                if msg[0] == "done":
                    committed = max(committed, msg[1])
                    if msg[1] == in_flight:  # the flush ended before the kill: it hit the next one
                        in_flight += 1
        finally:
            if p.is_alive():
                p.kill()
                p.join()
            recv.close()
        assert p.exitcode == -signal.SIGKILL, p.exitcode
        latest, landed, left, pruned = _check(save_dir, in_flight, committed, problems)
        half_pruned += pruned
        where[landed] = where.get(landed, 0) + 1
        leftovers = max(leftovers, left)
        next_step = (latest or 0) + 1
    seconds = time.monotonic() - t_start
    unloadable = where.get("unloadable", 0)
    figures = {
        "kills": KILLS,
        "seed": soaklib.seed(),
        "flush_s": flush_s,
        "unloadable_latest": unloadable,
        "problems": problems,
        "landed": where,
        "leftover_tmp_dirs": leftovers,
        "half_pruned_dirs": half_pruned,
        "last_committed_step": committed,
        "seconds": seconds,
    }
    text = "\n".join(
        [
            f"{KILLS} SIGKILLs during snapshot flushes (a flush of 7.5 MiB takes {flush_s * 1000:.0f} ms here); "
            f"seed {soaklib.seed()}",
            f"unloadable latest: {unloadable}; other problems: {len(problems) - unloadable}",
            soaklib.table(["where the kill landed", "kills"], sorted(where.items())),
            f"leftovers of killed writes present after a kill, at most (each later commit removes them): {leftovers}",
            f"older snapshot directories left half-deleted by a killed prune (files missing; fail loudly): "
            f"{half_pruned}",
            f"{seconds:.0f} s",
        ]
        + problems[:20]
    )
    soaklib.write_figures("snapshot_kills", figures, text)
    assert not problems, problems[:20]
    assert leftovers <= 2, f"{leftovers} leftovers of killed writes at once: the commits do not remove them"
