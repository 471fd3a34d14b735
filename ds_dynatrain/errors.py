"""Typed errors of ds_dynatrain.

One root, :class:`DynatrainError`, so a caller can catch everything the plugin raises; below it
one class per kind of problem, so a caller can tell "your input is wrong" (config, world size,
layout) from "the job failed underneath us" (transition aborted, peer lost). Messages name the
rank, parameter, key or file involved.
"""

import traceback


class DynatrainError(RuntimeError):
    """Root of every error raised by ds_dynatrain."""


class ConfigError(DynatrainError, ValueError):
    """The ``"dynatrain"`` section (or the DeepSpeed config around it) is invalid.

    Raised at start, before any process group or engine is touched.
    """


class ResizeRefusedError(DynatrainError, ValueError):
    """A requested world size cannot be served (0, above ``max_world_size``, or it cannot keep
    the global batch). Raised before anything changes: training goes on in the old world."""


class LayoutMismatchError(DynatrainError, ValueError):
    """Two layouts, or a layout and a model, describe different parameter sets or shapes.

    The message names the first differing parameter. Raised before any byte moves."""


class TransitionAbortedError(DynatrainError):
    """A transition could not complete: a peer disappeared, a wait timed out, or ranks disagreed
    about the plan. The message names the peer and the phase."""


class RecoveryNotPossibleError(TransitionAbortedError):
    """An in-place recovery cannot serve a worker's death (a dead member's replica holder died too,
    no replica was complete yet, a resize was in flight); the job falls back to the restart from
    its snapshot. The message says why."""


class NotAMemberError(DynatrainError):
    """This process left the job at a resize; its engine can no longer train."""


class CheckpointIncompleteError(DynatrainError, ValueError):
    """A checkpoint directory lacks files of its saving world, or some are truncated or damaged.

    Raised before anything is loaded; the message lists every problem file."""


class CheckpointNotPartitionedError(CheckpointIncompleteError):
    """A checkpoint saved without ZeRO partitions (ZeRO stage 0): nothing of it can be loaded at
    another layout; DeepSpeed's own load reads its module."""


class CheckpointCorruptError(CheckpointIncompleteError):
    """Bytes of a checkpoint file do not match the checksum its footer records (a flipped bit, a
    partial overwrite). The message names the file, the item and the byte offset; raised before
    the damaged bytes are used."""


class SnapshotNotFoundError(CheckpointIncompleteError):
    """A restore was asked for, but the snapshot directory holds no complete snapshot (no readable
    ``latest``). Raised before anything is loaded; the message names the directory."""


class SnapshotWriteError(DynatrainError):
    """A snapshot could not be written on some rank; ``latest`` still names the previous one."""


def without_frames(err: BaseException) -> BaseException:
    """``err`` with the tracebacks of it and of every exception it chains (``__cause__``,
    ``__context__``) dropped, and the locals of their finished frames cleared
    (``traceback.clear_frames``; a frame still running keeps its own), for an error kept past the
    code that raised it: the frames would keep that code's locals alive (a process group, its
    unfinished works, a failed generation's engine). Returns ``err``."""
    todo, seen = [err], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        todo += [e.__cause__, e.__context__]
    return err
