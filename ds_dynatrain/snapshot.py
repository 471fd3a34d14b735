"""The snapshot checkpoint engine: DeepSpeed's ``CheckpointEngine`` interface, committed atomically.

DeepSpeed 0.19 has no registry for third-party checkpoint engines, so the elastic engine sets
``engine.checkpoint_engine`` to this one after every (re)build. ``engine.save_checkpoint()`` then
writes each rank's files into ``<dir>/.tmp-<tag>/``; :meth:`commit` agrees across ranks that every
write succeeded (one collective with a timeout), renames the directory to ``<dir>/<tag>``, replaces
``latest`` atomically and prunes old snapshots to ``keep_last``. A write that fails on any rank
becomes a :class:`SnapshotWriteError` on every rank at the commit, and ``latest`` does not move.

This engine writes synchronously with ``torch.save``; loading uses ``torch.load(weights_only=True)``
with an explicit allow-list of DeepSpeed's own types, so loading never executes code from a file.
"""
from __future__ import annotations

import os
import shutil
from typing import List, Optional

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from io_engine import LATEST, TMP_PREFIX, prune_snapshots, publish_dir, read_latest, write_atomic

from .errors import DynatrainError

ENGINE_NAME = "DynatrainSnapshotEngine"


class SnapshotWriteError(DynatrainError):
    """A snapshot could not be written on some rank; ``latest`` still names the previous one."""


def _safe_globals() -> list:
    """Types DeepSpeed puts in its checkpoint dicts, allowed for ``weights_only`` loading."""
    allowed = []
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        allowed += [LossScaler, DynamicLossScaler]
    except ImportError:  # pragma: no cover - depends on DeepSpeed version
        pass
    try:
        from deepspeed.utils.tensor_fragment import fragment_address
        allowed.append(fragment_address)
    except ImportError:  # pragma: no cover
        pass
    try:
        from deepspeed.runtime.zero.config import ZeroStageEnum
        allowed.append(ZeroStageEnum)
    except ImportError:  # pragma: no cover
        pass
    return allowed


class SnapshotCheckpointEngine(CheckpointEngine):
    """Synchronous, atomically committed checkpoint engine.

    Args:
        keep_last: complete snapshots kept in a save directory after a commit (None: all).
        timeout_s: limit of the commit's collective, seconds.

    Call order (DeepSpeed's ``save_checkpoint``): ``create`` -> ``makedirs``/``save`` (any
    number) -> ``commit``; all ranks call ``create`` and ``commit``.
    """

    def __init__(self, keep_last: Optional[int] = None, timeout_s: float = 300.0):
        super().__init__(None)
        self.name = ENGINE_NAME
        self.keep_last = keep_last
        self.timeout_s = timeout_s
        self._info: Optional[CheckpointCommitInfo] = None
        self._error: Optional[BaseException] = None
        self._written: List[str] = []

    def _final_dir(self) -> str:
        return os.path.join(self._info.save_dir, self._info.tag)

    def _tmp_dir(self) -> str:
        return os.path.join(self._info.save_dir, f"{TMP_PREFIX}{self._info.tag}")

    def _redirect(self, path: str) -> str:
        if self._info is None:
            return path
        final = os.path.abspath(self._final_dir())
        p = os.path.abspath(path)
        if p == final or p.startswith(final + os.sep):
            return self._tmp_dir() + p[len(final):]
        return path

    def create(self, info: CheckpointCommitInfo):
        self._info = info
        self._error = None
        self._written = []

    def makedirs(self, path, exist_ok=False):
        os.makedirs(self._redirect(path), exist_ok=exist_ok)

    def save(self, state_dict, path: str):
        target = self._redirect(path)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            self._write(state_dict, target)
            self._written.append(target)
        except OSError as err:  # surfaced collectively at commit
            self._error = OSError(err.errno, f"{err.strerror or err} (writing {target})")

    def _write(self, state_dict, target: str) -> None:
        """Write one file durably (the seam where tests inject write errors)."""
        with open(target, "wb") as f:
            torch.save(state_dict, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)

    def commit(self, info: CheckpointCommitInfo):
        import torch.distributed as tdist
        mine = None if self._error is None else str(self._error)
        errors = [mine]
        if tdist.is_initialized():
            errors = [None] * tdist.get_world_size()
            tdist.all_gather_object(errors, mine)
        rank = tdist.get_rank() if tdist.is_initialized() else 0
        final = os.path.join(info.save_dir, info.tag)
        if any(errors):
            if rank == 0:
                shutil.rmtree(self._tmp_dir(), ignore_errors=True)
            self._info = None
            failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
            raise SnapshotWriteError(f"snapshot {final} was not committed, a write failed ({failed}); "
                                     f"'latest' still names {read_latest(info.save_dir)!r}")
        if rank == 0:
            publish_dir(self._tmp_dir(), final)
            if info.save_latest:
                write_atomic(os.path.join(info.save_dir, LATEST), info.tag.encode())
            if self.keep_last is not None:
                prune_snapshots(info.save_dir, self.keep_last, protect=[info.tag])
        if tdist.is_initialized():
            tdist.barrier()
        self._info = None
        return True
