"""Hugging Face Trainer's checkpoint choices made safe for asynchronous snapshots.

A snapshot returns from ``save_checkpoint`` before it is durable: the files flush in the
background and the commit renames the tag directory and writes ``latest`` last
(:mod:`ds_dynatrain.checkpoint.snapshot`). Trainer (transformers 5, ``trainer.py``) assumes the
opposite in two places, both functions it imports from ``trainer_utils``:

* ``get_last_checkpoint`` (``resume_from_checkpoint=True``) returns the highest-numbered
  ``checkpoint-N`` directory, complete or not, and a half-written one makes the resume fail;
* ``rotate_checkpoints`` (``save_total_limit``) keeps only the newest directory, so with a limit
  of 1 the last durable checkpoint is deleted while the new one is still flushing.

When ``transformers.trainer`` is imported (before or after ``import ds_dynatrain``; a post-import
hook of ``wrapt``), those two names in it are replaced: the last *complete* checkpoint is chosen,
and rotation also keeps the newest complete one. Directories that hold no DeepSpeed checkpoint are
judged as Trainer judges them.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from typing import Optional

from ..errors import CheckpointIncompleteError
from ..log import logger

TRAINER_MODULE = "transformers.trainer"
TRAINER_STATE = "trainer_state.json"  # Trainer's TRAINER_STATE_NAME, written after the engine's save
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # Trainer's PREFIX_CHECKPOINT_DIR and numbering
_HOOKED = "__ds_dynatrain_hooked__"


def incomplete_reason(folder: str) -> Optional[str]:
    """Why the Trainer checkpoint ``folder`` (``checkpoint-N``) cannot be resumed from, or None.

    A folder with a DeepSpeed checkpoint in it (a ``latest`` file, a ``global_step*`` directory or
    a snapshot's ``.tmp-*`` directory) is complete when ``latest`` names a tag whose every file of
    the saving world is present and complete (:class:`~ds_dynatrain.checkpoint.saved.SavedCheckpoint`,
    metadata only) and Trainer's ``trainer_state.json`` is there. Other folders: None.
    """
    from ..checkpoint.saved import SavedCheckpoint

    try:
        names = os.listdir(folder)
    except OSError as err:
        return f"cannot list it ({err.strerror or err})"
    if not any(n == "latest" or n.startswith(("global_step", ".tmp-")) for n in names):
        return None
    try:
        SavedCheckpoint(folder).close()
    except CheckpointIncompleteError as err:
        why = str(err)
        return why[len(folder) + 2 :] if why.startswith(folder + ": ") else why
    if TRAINER_STATE not in names:
        return f"no {TRAINER_STATE}"
    return None


def _by_number(paths) -> list:
    """The ``checkpoint-N`` among ``paths``, oldest (lowest N) first."""
    found = [(int(m.group(1)), p) for p in map(os.fspath, paths) if (m := _CHECKPOINT.match(os.path.basename(p)))]
    return [p for _, p in sorted(found)]


def _numbered(folder: str) -> list:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return _by_number(p for p in (os.path.join(folder, n) for n in names) if os.path.isdir(p))


def _first_rank() -> bool:
    import torch.distributed as tdist

    return not tdist.is_initialized() or tdist.get_rank() == 0


def last_complete_checkpoint(folder: str) -> Optional[str]:
    """The highest-numbered ``checkpoint-N`` under ``folder`` that can be resumed from (see
    :func:`incomplete_reason`), or None. Each newer one passed over is logged with the reason (by
    the first rank)."""
    for path in reversed(_numbered(folder)):
        why = incomplete_reason(path)
        if why is None:
            return path
        if _first_rank():
            logger.warning(f"ds_dynatrain: not resuming from {path}: incomplete ({why})")
    return None


def _newest_complete(checkpoints) -> Optional[str]:
    return next((p for p in reversed(_by_number(checkpoints)) if incomplete_reason(p) is None), None)


def rotation_keeping_durable(sort_checkpoints):
    """Trainer's ``rotate_checkpoints(output_dir, save_total_limit, best_model_checkpoint,
    use_mtime, checkpoint_prefix)``: delete the oldest checkpoints beyond ``save_total_limit``,
    never the newest, the best, or the newest complete one (which may be older than the newest
    while that one flushes). ``sort_checkpoints`` is transformers' own ordering."""

    def rotate_checkpoints(
        output_dir, save_total_limit=None, best_model_checkpoint=None, use_mtime=False, checkpoint_prefix="checkpoint"
    ):
        if save_total_limit is None or save_total_limit <= 0:
            return
        checkpoints = [os.fspath(c) for c in sort_checkpoints(output_dir, checkpoint_prefix, use_mtime)]
        if len(checkpoints) <= save_total_limit:
            return
        protected = {checkpoints[-1]}
        if best_model_checkpoint is not None:
            protected.add(os.fspath(best_model_checkpoint))
        durable = _newest_complete(checkpoints)
        if durable is not None and durable not in protected:
            logger.info(f"ds_dynatrain: keeping {durable}, the newest complete checkpoint, while newer ones flush")
            protected.add(durable)
        keep = max(save_total_limit, len(protected))
        remaining = len(checkpoints)
        for path in checkpoints:
            if remaining <= keep:
                break
            if path not in protected:
                shutil.rmtree(path, ignore_errors=True)
                remaining -= 1

    return rotate_checkpoints


def _mark_trainer_accelerator(wrapped, instance, args, kwargs):
    """``Trainer.create_accelerator_and_postprocess``: its accelerator is marked as Trainer's, whose
    data loaders Trainer prepares anew for each loop and evaluation (no elastic shard,
    :mod:`.accelerate_loop`)."""
    out = wrapped(*args, **kwargs)
    accelerator = getattr(instance, "accelerator", None)
    if accelerator is not None:
        accelerator._dt_trainer = True
    return out


def _hook(module) -> None:
    if getattr(module, _HOOKED, False):
        return
    if hasattr(module, "get_last_checkpoint"):
        module.get_last_checkpoint = functools.wraps(module.get_last_checkpoint)(last_complete_checkpoint)
    utils = getattr(module, "sort_checkpoints", None)
    if hasattr(module, "rotate_checkpoints") and utils is not None:
        module.rotate_checkpoints = functools.wraps(module.rotate_checkpoints)(rotation_keeping_durable(utils))
    else:
        logger.debug("ds_dynatrain: this transformers release rotates checkpoints inside Trainer; rotation not guarded")
    import wrapt

    from .restart import skip_live_load, train_resuming_after_resizes

    wrapt.wrap_function_wrapper(module, "Trainer.train", train_resuming_after_resizes)
    if hasattr(module.Trainer, "create_accelerator_and_postprocess"):
        wrapt.wrap_function_wrapper(module, "Trainer.create_accelerator_and_postprocess", _mark_trainer_accelerator)
    if hasattr(module, "deepspeed_load_checkpoint"):
        module.deepspeed_load_checkpoint = skip_live_load(module.deepspeed_load_checkpoint)
    setattr(module, _HOOKED, True)


def _hook_args(module) -> None:
    import wrapt

    from .restart import accumulation_for_world

    wrapt.wrap_function_wrapper(module, "TrainingArguments.__post_init__", accumulation_for_world)


def _hook_state(module) -> None:
    import wrapt

    from .restart import generation_view

    wrapt.wrap_function_wrapper(module, "PartialState.__init__", generation_view)


def install_trainer_hooks() -> None:
    """Replace Trainer's ``get_last_checkpoint`` and ``rotate_checkpoints`` once
    ``transformers.trainer`` is imported (at once if it already is)."""
    import wrapt

    wrapt.register_post_import_hook(_hook, TRAINER_MODULE)
    wrapt.register_post_import_hook(_hook_args, "transformers.training_args")
    wrapt.register_post_import_hook(_hook_state, "accelerate.state")
