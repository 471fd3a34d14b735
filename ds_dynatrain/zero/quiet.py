"""Two messages every worker printed because of how the plugin builds DeepSpeed engines, fixed or
filtered where they arise.

* DeepSpeed's warm-up schedulers (``WarmupLR``, ``WarmupCosineLR``, ...) call their own
  ``get_lr()`` in ``__init__`` to set the first learning rate, before any step, and that call logs
  "Attempting to get learning rate from scheduler before it has started". The engine is built at
  start, by every joiner and at a restore, so each worker printed it. :func:`scheduler_start_quiet`
  drops exactly that message while an engine is constructed; the same call from the user's code
  at any other time still warns.
* torch 2.13 deprecates ``torch.distributed.all_gather_into_tensor`` and ``reduce_scatter_tensor``
  (``FutureWarning``) in favour of ``all_gather_single`` and ``reduce_scatter_single``, which take
  the same arguments; DeepSpeed 0.19's comm backend picks the old names at its start.
  :func:`use_current_collectives` points it at the new ones where torch has them.
"""

from __future__ import annotations

import contextlib
import logging

SCHEDULER_NOT_STARTED = "Attempting to get learning rate from scheduler before it has started"


class _DropSchedulerStart(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(SCHEDULER_NOT_STARTED)


@contextlib.contextmanager
def scheduler_start_quiet():
    """While the block runs, DeepSpeed's logger drops the scheduler's "before it has started"
    warning (its own constructor's call); every other record passes."""
    from deepspeed.utils import logger

    f = _DropSchedulerStart()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def use_current_collectives() -> bool:
    """Point DeepSpeed's started comm backend at ``torch.distributed.all_gather_single`` and
    ``reduce_scatter_single`` when torch has them (same arguments as the deprecated
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` it chose). Returns True when the backend
    was changed; False when DeepSpeed's comm has not started or torch has only the old names."""
    import deepspeed.comm.comm as dcomm
    import torch.distributed as tdist

    cdb = dcomm.cdb
    if cdb is None or not hasattr(cdb, "all_gather_function"):
        return False
    changed = False
    if getattr(tdist, "all_gather_single", None) is not None:
        cdb.all_gather_function = tdist.all_gather_single
        changed = True
    if getattr(tdist, "reduce_scatter_single", None) is not None and hasattr(cdb, "reduce_scatter_function"):
        cdb.reduce_scatter_function = tdist.reduce_scatter_single
        changed = True
    return changed
