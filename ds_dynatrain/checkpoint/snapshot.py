"""The snapshot checkpoint engine: DeepSpeed's ``CheckpointEngine`` interface, asynchronous.

DataStates-LLM design (Maurya et al., HPDC'24, §4): model and optimizer state do not change during
forward and backward, so a snapshot is *captured* lazily beside them and only the next optimizer
step waits for the capture; tensors are not serialized at all, they are written as bytes with
io_uring and O_DIRECT, straight from their memory where it is aligned as the file asks (512 bytes
on common disks, :mod:`io_engine.dio_align`), else copied into a
bounded pool of aligned host buffers first (:mod:`io_engine.writer`); the plain data are
serialized (allow-listed JSON, :mod:`state_providers.serialize`).

``engine.save_checkpoint()`` calls, on every rank: ``create`` -> ``save`` (one per file) ->
``commit``. Here:

* ``save(state_dict, path)`` turns the dict into items (:class:`state_providers.DictStateProvider`:
  zero-copy tensor views, plain data serialized now) and queues one file job; it returns at once.
  The engine's worker thread writes the tensors from their memory or copies them into the host
  cache (*captured* once it no longer reads them) and flushes the file into ``DIR/.tmp-<tag>/``
  (*persisted*, fsynced).
* ``commit(info)`` queues the commit and returns at once. When this rank's files are persisted
  it reports to the job's store; rank 0 waits until every rank reported, then renames the
  directory to ``DIR/<tag>``, replaces ``latest`` atomically and prunes to ``keep_last``, and posts
  the outcome. No collective runs on the training process group from a background thread.
* :meth:`wait_captured` (called by the elastic engine right before the optimizer step) blocks
  only if a capture is unfinished, and takes note of the last snapshot's outcome once rank 0 has
  posted it (one store lookup, no wait); :meth:`wait` blocks until that outcome is known and
  raises :class:`SnapshotWriteError` if any rank failed. ``latest`` never moves to a snapshot with
  a missing file.
* A failed snapshot (a write on any rank; a directory that cannot be created or written) is one
  outcome on every rank. ``on_write_error="warn"``: every rank logs it (tag, failed ranks, causes)
  and training goes on; ``"raise"``: :class:`SnapshotWriteError` on every rank at the next save.
  ``on_outcome`` gets a :class:`~.snapshot_outcome.SnapshotOutcome` of every snapshot, once. A
  directory is checked (:func:`io_engine.check_snapshot_dir`, through the writer's io backend,
  which keeps the write path decided there) the first time the engine saves into it; a failed
  check or ``makedirs`` is this rank's failed write, never an exception inside DeepSpeed's
  ``save_checkpoint`` (whose barrier the other ranks would wait in).

``asynchronous=False`` does the same work inside ``save``/``commit`` (the comparison point).
Loading reads this engine's files (``io_engine`` reader, checksums verified) and, for directories
written by DeepSpeed's default engine, ``torch.load(weights_only=True)`` with DeepSpeed's own types
allow-listed: loading never executes code from a file.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from io_engine import LATEST, TMP_PREFIX, check_snapshot_dir, prune_snapshots, publish_dir, remove_stale, write_atomic
from io_engine.errors import IOEngineError, errno_name
from io_engine.priority import lower_thread_priority
from state_providers import DictStateProvider, TensorItem

from ..errors import ConfigError, DynatrainError, SnapshotWriteError
from ..log import logger, plural
from .device_stage import PinnedStage
from .module_master import strip_working
from .saved import MODEL_FILE
from .snapshot_outcome import OutcomeTracking, SnapshotOutcome, cause, encode, rank_report, sum_reports
from .state_file import ReadAhead, read_state_file

ENGINE_NAME = "DynatrainSnapshotEngine"
STORE_PREFIX = "dynatrain/snap"
PRUNABLE_TAG = r"global_step\d+"  # the tags of periodic snapshots; other tags are the user's and are kept


def _write_items(provider: DictStateProvider, stage: PinnedStage, ready=None):
    """``io_engine`` write items for a provider's items, and whether they are private copies.

    Tensors are uint8 numpy views: of the live tensors when all are on the CPU (no copy; the writer's
    write from them, or its copy into the host cache, is the capture), else of their copies staged in ``stage``'s pinned
    memory (:mod:`.device_stage`), which are the capture. Objects are bytes."""
    from io_engine import WriteItem

    items = list(provider.items())
    tensors = [it.tensor for it in items if isinstance(it, TensorItem)]
    staged = any(t.device.type == "cuda" for t in tensors)
    copies = iter(stage.stage(tensors, ready)) if staged else None
    out = []
    for it in items:
        if isinstance(it, TensorItem):
            host = next(copies) if staged else it.tensor.reshape(-1).view(torch.uint8)
            out.append(WriteItem(it.key, host.numpy(), "tensor", dict(it.attrs), it.dtype, it.shape))
        else:
            out.append(WriteItem(it.key, it.payload, "object", dict(it.attrs)))
    return out, staged


def _captured(job: "_FileJob") -> None:
    job.captured_at = time.perf_counter()
    job.captured.set()


def _file_done(job: "_FileJob", t0: float, err: Optional[BaseException]) -> None:
    """The file is persisted or failed (``err``): record the times, drop the live tensors, wake
    every waiter."""
    job.error = err
    job.persisted_at = time.perf_counter()
    job.captured_at = job.captured_at or job.persisted_at
    job.seconds = job.persisted_at - t0
    job.provider = None  # drop the references to live tensors
    job.captured.set()
    job.persisted.set()


@dataclass
class _FileJob:
    path: str
    provider: DictStateProvider
    captured: threading.Event = field(default_factory=threading.Event)
    persisted: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    ready: Any = None  # a CUDA event recorded at save time when the state is on a GPU
    seconds: float = 0.0
    nbytes: int = 0
    from_source_bytes: int = 0  # written straight from the live (or staged) tensors, not copied
    captured_at: float = 0.0  # perf_counter when its tensors were no longer read (GPU: staged in pinned memory)
    persisted_at: float = 0.0  # perf_counter when the file was synced (or failed)


@dataclass
class _Snapshot:
    info: CheckpointCommitInfo
    key: str  # store prefix of this snapshot's agreement
    token: str = ""  # unique name of this attempt's temporary directory
    jobs: List[_FileJob] = field(default_factory=list)
    committed: bool = False
    error: Optional[str] = None  # this rank failed before any file (its directory); nothing is written
    saved_step: Any = None  # ``global_steps`` of the state DeepSpeed saved, when a file had it
    t0: float = field(default_factory=time.perf_counter)
    wall_t0: float = field(default_factory=time.time)  # the same moment on the files' clock
    save_s: float = 0.0

    @property
    def final_dir(self) -> str:
        return os.path.join(self.info.save_dir, self.info.tag)

    @property
    def tmp_dir(self) -> str:
        # unique per attempt (a random token agreed through the store): a directory left by a
        # crashed save, of this job or an earlier one, is never reused
        return os.path.join(self.info.save_dir, f"{TMP_PREFIX}{self.info.tag}-{self.token}")

    def final_path(self, tmp_path: str) -> str:
        """Where a file written at ``tmp_path`` (under :attr:`tmp_dir`) lies once published."""
        return self.final_dir + tmp_path[len(self.tmp_dir) :]


class SnapshotCheckpointEngine(OutcomeTracking, CheckpointEngine):
    """Asynchronous, crash-consistent checkpoint engine (see the module docstring).

    Args:
        store_address: ``(host, port)`` of the job's ``TCPStore`` (the membership store, or
            torch.distributed's default store). The engine opens its own connections, one for the
            training thread and one for its worker: a store client must not be shared between
            threads (interleaved requests on one socket hang).
        rank, world_size: this process in the generation that saves.
        generation: the membership generation (keys of the store are per generation).
        keep_last: complete snapshots kept in a directory after a commit (None: all).
        timeout_s: limit of every wait (capture, persistence, agreement), seconds.
        cache_bytes: host cache size, bytes (bounded; reused across snapshots).
        asynchronous: False writes inside ``save``/``commit``.
        on_write_error: ``"warn"`` or ``"raise"``: what a failed snapshot does (module docstring).
        worker_nice: added to the nice value of the worker thread (Linux: of that thread alone,
            :func:`io_engine.priority.lower_thread_priority`), 0 to 19; the copy, checksum and flush then yield
            the CPUs to training. Threads the worker starts inherit it.
        write_from_memory: write a tensor whose memory is aligned as O_DIRECT asks there straight
            from that memory (:class:`io_engine.SnapshotFileWriter` ``from_source``); the capture
            then ends when those writes completed. False copies every tensor into the host cache.

    Raises:
        ConfigError: ``on_write_error`` is neither ``"warn"`` nor ``"raise"``, or ``worker_nice``
            is not an int from 0 to 19.
    """

    def __init__(
        self,
        store_address=None,
        rank: int = 0,
        world_size: int = 1,
        generation: int = 0,
        keep_last: Optional[int] = None,
        timeout_s: float = 300.0,
        cache_bytes: int = 256 << 20,
        asynchronous: bool = True,
        on_write_error: str = "warn",
        worker_nice: int = 5,
        write_from_memory: bool = True,
    ):
        super().__init__(None)
        if on_write_error not in ("warn", "raise"):
            raise ConfigError(f"on_write_error must be 'warn' or 'raise', got {on_write_error!r}")
        self.on_write_error = on_write_error
        if not isinstance(worker_nice, int) or not 0 <= worker_nice <= 19:
            raise ConfigError(f"worker_nice must be an int from 0 to 19, got {worker_nice!r}")
        self.worker_nice = worker_nice
        self.write_from_memory = write_from_memory
        # called with a SnapshotOutcome of every snapshot, once its outcome is known (this rank)
        self.on_outcome: Optional[Callable[[SnapshotOutcome], None]] = None
        self._unreported: Optional[SnapshotWriteError] = None  # a failure noted, raised at the next save
        self._early_error: Optional[str] = None  # a makedirs that failed before ``create``
        self._checked = set()  # directories this engine checked already
        self.name = ENGINE_NAME
        self.store_address = store_address
        self._stores = {}
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.keep_last = keep_last
        self.timeout_s = timeout_s
        self.asynchronous = asynchronous
        self._cache_bytes = cache_bytes
        self._writer = None
        self._stages: List[PinnedStage] = []  # GPU state: each file's copies, pinned once and reused
        self._seq = 0
        self._instance: Optional[int] = None
        self._current: Optional[_Snapshot] = None
        self._last: Optional[_Snapshot] = None
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        # seconds the optimizer step waited for captures; seconds and bytes of the files persisted,
        # and of those bytes the ones written straight from the tensors' memory (io_engine.writer)
        self.stats = {"capture_wait_s": 0.0, "persist_s": 0.0, "bytes": 0, "from_source_bytes": 0}
        # path in the saved dict -> footer attributes of that tensor (the VPS coordinates of ZeRO
        # partitions, set by the elastic engine); None: none
        self.tensor_attrs = None
        # names of ``module`` entries of the ZeRO-1/2 model-state file left to the fp32 master
        # partitions, rebuilt from them on read (:mod:`.module_master`; set by the elastic engine)
        self.module_from_master: Mapping[str, Tuple[int, ...]] = {}  # name -> shape
        # True from a load until the next optimizer step: the loaded working parameters need not be
        # the cast of the loaded master (a file of another precision), so they are written whole
        self.hold_module = False
        # set by ElasticEngine.save_checkpoint, which keeps DeepSpeed from writing ``latest`` itself
        # (non-atomically) and has this engine's commit publish it instead; None: DeepSpeed's flag
        self.publish_latest = None
        # files a load read (and checked) before DeepSpeed's own load asks for them
        self.read_ahead = ReadAhead()

    @property
    def store(self):
        """This thread's own connection to the job's store."""
        tid = threading.get_ident()
        st = self._stores.get(tid)
        if st is None:
            host, port = self.store_address
            st = self._stores[tid] = torch.distributed.TCPStore(
                host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=self.timeout_s)
            )
        return st

    # ---------------------------------------------------------------- worker
    def _ensure_worker(self):
        if self._writer is None:
            from io_engine.ioqueue import import_liburing

            try:
                import_liburing()  # in the training thread, before the worker needs it
            except OSError:
                pass  # the io backend falls back to a thread pool and says so once
            from io_engine import SnapshotFileWriter

            self._writer = SnapshotFileWriter(cache_bytes=self._cache_bytes, from_source=self.write_from_memory)
        if self.asynchronous and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dynatrain-snapshot", daemon=True)
            self._thread.start()

    def _run(self):
        lower_thread_priority(self.worker_nice)
        pending: List[Callable[[], None]] = []  # staged files' writes, run at their snapshot's commit
        while True:
            task = self._queue.get()
            if task is None or task[0] == "commit":
                for write in pending:
                    write()
                pending.clear()
                if task is None:
                    return
                self._finish(task[1])
            else:
                write = self._write_file(task[1], slot=len(pending), defer=True)
                if write is not None:
                    pending.append(write)

    def _stage(self, slot: int) -> PinnedStage:
        while len(self._stages) <= slot:
            self._stages.append(PinnedStage())
        return self._stages[slot]

    def _write_file(self, job: _FileJob, slot: int = 0, defer: bool = False) -> Optional[Callable[[], None]]:
        """Capture ``job``'s file and write it. GPU state is captured by staging its tensors into
        pinned memory (``slot``: which of the engine's stages); with ``defer`` its write is returned
        instead of run, so the next file of the snapshot is captured before this one is flushed."""
        t0 = time.perf_counter()
        try:
            os.makedirs(os.path.dirname(job.path), exist_ok=True)
            items, staged = _write_items(job.provider, self._stage(slot), job.ready)
        except BaseException as err:  # OSError, a failed pinned allocation: never leave a waiter blocked
            _file_done(job, t0, err)
            return None
        if staged:  # the pinned copies are the snapshot's: training may change the state now
            _captured(job)
            if defer:
                return partial(self._persist, job, items, staged, t0)
        self._persist(job, items, staged, t0)
        return None

    def _persist(self, job: _FileJob, items, staged: bool, t0: float) -> None:
        err = None
        try:
            res = self._writer.write(
                job.path,
                items,
                on_captured=None if staged else partial(_captured, job),
                file_attrs={"producer": "ds_dynatrain", "rank": self.rank, "world_size": self.world_size},
            )
            job.nbytes, job.from_source_bytes = res.layout.file_size, res.from_source_bytes
        except BaseException as e:  # OSError, IOEngineError, anything: never leave a waiter blocked
            err = e
        _file_done(job, t0, err)

    def _finish(self, snap: _Snapshot):
        """This rank's files are persisted (or failed): report; rank 0 decides and publishes."""
        errors = ([snap.error] if snap.error else []) + [cause(j.error) for j in snap.jobs if j.error is not None]
        st = self.store
        if errors:
            st.set(f"{snap.key}/failed/{self.rank}", "; ".join(errors)[:2000])
        st.set(f"{snap.key}/report/{self.rank}", rank_report(snap.jobs, snap.t0))
        st.add(f"{snap.key}/done", 1)
        if self.rank != 0:
            return
        deadline = time.monotonic() + self.timeout_s
        outcome = f"{snap.key}/outcome"
        while int(st.add(f"{snap.key}/done", 0)) < self.world_size:
            if time.monotonic() > deadline:
                shutil.rmtree(snap.tmp_dir, ignore_errors=True)
                why = f"not every rank finished writing within {self.timeout_s:.0f} s"
                st.set(outcome, encode(False, why, seconds=time.perf_counter() - snap.t0, totals=self._totals(snap)))
                return
            time.sleep(0.01)
        totals = self._totals(snap)
        failed = {}
        for r in range(self.world_size):
            k = f"{snap.key}/failed/{r}"
            if st.check([k]):
                failed[r] = f"rank {r}: {st.get(k).decode(errors='replace')}"
        if failed:
            shutil.rmtree(snap.tmp_dir, ignore_errors=True)  # no partial snapshot is left behind
            st.set(outcome, encode(False, "; ".join(failed.values()), failed, time.perf_counter() - snap.t0, totals))
            return
        try:
            publish_dir(snap.tmp_dir, snap.final_dir)
            if snap.info.save_latest:
                write_atomic(os.path.join(snap.info.save_dir, LATEST), snap.info.tag.encode())
            if self.keep_last is not None:
                prune_snapshots(snap.info.save_dir, self.keep_last, protect=[snap.info.tag], pattern=PRUNABLE_TAG)
            stale = remove_stale(snap.info.save_dir)  # what killed flushes and prunes left
            if stale:
                logger.info(f"snapshot {snap.info.tag}: removed {plural(len(stale), 'leftover')} of killed writes")
            st.set(outcome, encode(True, seconds=time.perf_counter() - snap.t0, totals=totals))
        except OSError as err:
            shutil.rmtree(snap.tmp_dir, ignore_errors=True)
            why = f"rank 0: publishing: {cause(err)}"
            st.set(outcome, encode(False, why, [0], time.perf_counter() - snap.t0, totals))

    def _totals(self, snap: _Snapshot) -> dict:
        """Rank 0: the figures of the ranks that reported, summed (:func:`sum_reports`)."""
        st = self.store
        keys = [f"{snap.key}/report/{r}" for r in range(self.world_size)]
        return sum_reports(st.get(k) for k in keys if st.check([k]))

    # ---------------------------------------------------------------- CheckpointEngine
    def create(self, info: CheckpointCommitInfo):
        # the previous snapshot's outcome, on every rank, before a new one starts (the policy:
        # every rank raises here, at the same save, or warns and goes on)
        self._report(self._settle())
        self._ensure_worker()
        if self._instance is None:
            # the n-th engine this rank made in this generation (several engines in one process,
            # e.g. a job that builds a second one): every rank builds them in the same order, so
            # the n-th engines of all ranks share keys, and no engine reads another's stale token
            self._instance = self.store.add(f"{STORE_PREFIX}/g{self.generation}/instances/r{self.rank}", 1)
        key = f"{STORE_PREFIX}/g{self.generation}/i{self._instance}/s{self._seq}"
        self._seq += 1
        if self.rank == 0:
            self.store.set(f"{key}/token", uuid.uuid4().hex[:12])
        self.store.wait([f"{key}/token"], timedelta(seconds=self.timeout_s))
        self._current = _Snapshot(info, key, token=self.store.get(f"{key}/token").decode())
        self._current.error, self._early_error = self._early_error or self._check_dir(info.save_dir), None

    def _check_dir(self, save_dir: str) -> Optional[str]:
        """This rank's failure to use ``save_dir`` (None: usable), checked once per directory
        through the writer's backend, which keeps the write path decided there."""
        where = os.path.abspath(save_dir)
        if where in self._checked:
            return None
        try:
            check_snapshot_dir(where, backend=self._writer.flusher.backend)
        except IOEngineError as err:
            return f"{err}"
        self._checked.add(where)
        return None

    def _redirect(self, path: str) -> str:
        snap = self._current
        if snap is None:
            return path
        final = os.path.abspath(snap.final_dir)
        p = os.path.abspath(path)
        if p == final or p.startswith(final + os.sep):
            return snap.tmp_dir + p[len(final) :]
        return path

    def makedirs(self, path, exist_ok=False):
        """``os.makedirs`` (into the snapshot's temporary directory); a failure is this rank's
        failed write of the snapshot, reported through the commit (never raised: DeepSpeed calls
        this on rank 0 alone, before a barrier the other ranks wait in)."""
        try:
            os.makedirs(self._redirect(path), exist_ok=exist_ok)
        except OSError as err:
            why = f"{path}: cannot create the directory ({errno_name(err.errno)}: {err.strerror or err})"
            if self._current is None:
                self._early_error = self._early_error or why
            elif self._current.error is None:
                self._current.error = why

    def save(self, state_dict, path: str):
        if self._current is None:
            raise DynatrainError("SnapshotCheckpointEngine.save called outside create/commit")
        if isinstance(state_dict, dict) and "global_steps" in state_dict:
            self._current.saved_step = state_dict["global_steps"]
        if self._current.error is not None:
            return  # this rank cannot write this snapshot; the commit reports why
        if (
            self.module_from_master
            and not self.hold_module
            and os.path.basename(path) == MODEL_FILE
            and isinstance(state_dict, dict)
        ):
            state_dict = strip_working(state_dict, self.module_from_master)
        job = _FileJob(self._redirect(path), DictStateProvider(state_dict, tensor_attrs=self.tensor_attrs))
        if torch.cuda.is_available():
            job.ready = torch.cuda.Event()
            job.ready.record()
        self._current.jobs.append(job)
        if self.asynchronous:
            self._queue.put(("file", job))
        else:
            self._write_file(job)

    def commit(self, info: CheckpointCommitInfo):
        snap, self._current = self._current, None
        if snap is None:
            return True
        latest = info.save_latest if self.publish_latest is None else self.publish_latest
        self.publish_latest = None
        snap.info = CheckpointCommitInfo(tag=info.tag, save_dir=info.save_dir, save_latest=latest)
        snap.committed = True
        snap.save_s = time.perf_counter() - snap.t0
        self._last = snap
        if self.asynchronous:
            self._queue.put(("commit", snap))
        else:
            self._finish(snap)
            self._report(self._settle())
        return True

    def load(self, path: str, map_location=None):
        """The state dict of ``path`` (this project's format, every byte checked, or DeepSpeed's
        ``torch.save`` format), from :attr:`read_ahead` when a load read it first.

        Raises:
            CheckpointCorruptError, CheckpointIncompleteError: see
                :func:`~ds_dynatrain.checkpoint.state_file.read_state_file`.
        """
        kept = self.read_ahead.take(path)
        return kept if kept is not None else read_state_file(path, map_location)

    # ---------------------------------------------------------------- waits
    def wait_captured(self) -> float:
        """Block until every queued file is captured (sources may change after). Returns the
        seconds waited. Raises :class:`SnapshotWriteError` after ``timeout_s``."""
        jobs = [j for s in (self._last, self._current) if s is not None for j in s.jobs]
        t0 = time.perf_counter()
        for j in jobs:
            if not j.captured.wait(self.timeout_s):
                raise SnapshotWriteError(f"capture of {j.path} did not finish within {self.timeout_s:.0f} s")
        waited = time.perf_counter() - t0
        self.stats["capture_wait_s"] += waited
        self._poll()
        return waited

    def wait(self) -> None:
        """Block until the last committed snapshot is published or failed, on every rank.

        Raises:
            SnapshotWriteError: it was not committed (whatever ``on_write_error`` says: this is
                the explicit question), or a failure noted under ``"raise"`` is still unraised:
                names the tag, every failed rank and its error (or that no outcome came within
                ``timeout_s``); ``latest`` names the previous snapshot. When the store gives no
                outcome but the files show the snapshot committed (published, this save's files,
                ``latest`` naming it: :func:`~.snapshot_outcome.published`), it is committed,
                with a warning that says so.
        """
        err = self._settle()
        if err is not None:
            raise err

    def close(self) -> None:
        """Finish pending work (bounded by ``timeout_s``), stop the worker, free the host cache.
        Safe to call twice and on a half-built engine."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        err = None
        try:
            err = self._settle()
        except Exception as e:  # noqa: BLE001 - closing (at exit, at a resize): say why, go on
            err = e
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(self.timeout_s)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for stage in self._stages:
            stage.release()
        self._stores.clear()
        if err is not None:
            logger.warning(f"{err}")

    def abandon(self) -> None:
        """Stop without waiting for the snapshot in flight (an in-place recovery: its commit needs
        a rank that died). The worker ends after its current task; that snapshot is never
        published (rank 0's wait for the ranks fails after ``timeout_s`` and removes its
        temporary directory)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
        self._stores.clear()

    def cleanup(self):
        self.close()
