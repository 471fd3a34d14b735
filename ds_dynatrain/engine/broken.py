"""Letting go of a generation whose collective failed: the engine is detached and every process
group of the generation released, so that the peers still waiting in one of them fail too.

gloo closes a process's connections only when the group's context is destroyed, and a failed
operation's work object (kept alive by the exception's traceback) holds that context. A survivor
whose own collective failed at once but keeps its groups would leave a peer that waits on *it*
(not on the dead rank) blocked until the group's timeout. Dropping the traceback, DeepSpeed's
references (engine, ZeRO optimizer, every parameter's ``_dp_group``, ``deepspeed.comm``) and
``torch.distributed``'s tables destroys the contexts by reference counting; the peers' waits fail
within moments and they recover too. A context kept by a reference cycle goes at the next full
collection (:func:`collect`, which the recovery runs when a peer is slow to answer: about 0.25 s
on the demo model, so not on the fast path).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Tuple

import torch
import torch.distributed as tdist

from ..errors import without_frames
from ..log import logger
from ..zero.comm import release_default_arguments, reset_deepspeed_comm
from ..zero.geometry import is_zero3, zero_optimizer_of
from ..zero.rebuild import teardown
from ..zero.zero3 import release_zero3_params

releases = 0  # generations this process let go of (engine.lifecycle collects their cycles at exit)


@dataclass
class Kept:
    """What the rebuild needs of the released engine: the client's torch optimizer, LR scheduler and
    model, and the ZeRO-1/2 flat parameter buffers (the parameters still live in them)."""

    optimizer: Any
    lr_scheduler: Any
    model: torch.nn.Module
    flat: Tuple[torch.Tensor, ...]


def release(engine, err: BaseException) -> Kept:
    """Detach ``engine`` and release the process groups of its generation (see the module).

    The engine cannot train afterwards until it is built again; the returned parts are what that
    build takes back.
    """
    global releases
    releases += 1
    dt = engine._dt
    zopt = zero_optimizer_of(engine)
    zero3 = is_zero3(zopt)
    kept = Kept(zopt.optimizer, engine.lr_scheduler, engine.module, () if zero3 else tuple(zopt.bit16_groups_flat))
    params = kept.model.named_parameters()  # full shapes (plain already where a resize released them)
    shapes = {n: (getattr(p, "ds_shape", p.shape), p.dtype) for n, p in params} if zero3 else {}
    without_frames(err)
    _abandon_snapshot(engine)
    try:
        teardown(engine)
    except Exception as e:  # noqa: BLE001 - a half-broken engine: what matters is letting go of it
        logger.warning(f"detaching the failed engine: {e}")
    if zero3:
        whole = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in shapes.items()}
        release_zero3_params(kept.model, whole, dt.param_attrs)
        offload = getattr(zopt, "parameter_offload", None)
        if offload is not None:  # its coordinator holds the gathers in flight
            vars(getattr(offload, "param_coordinator", offload)).clear()
            vars(offload).clear()
    zopt.__dict__.clear()  # the ZeRO optimizer (shared with the object returned at start) held the groups
    for p in kept.model.parameters():
        p.grad = None  # the abandoned step's gradients (the backward that failed accumulated some)
    for obj in (engine, *kept.model.parameters()):  # DeepSpeed tags each parameter with its group
        for name, value in list(vars(obj).items()):
            if _holds_group(value):
                setattr(obj, name, None)
    release_default_arguments()  # torch.distributed.nn.functional's, once ZeRO-3 imported it
    reset_deepspeed_comm()
    if dt.membership is not None:
        dt.membership.groups.close()  # the default group and the cached ones: formed again as needed
    elif tdist.is_initialized():
        tdist.destroy_process_group()
    return kept


def collect() -> None:
    """A full garbage collection: groups held only by reference cycles go (see the module)."""
    gc.collect()


def _holds_group(value, depth: int = 0) -> bool:
    if isinstance(value, tdist.ProcessGroup):
        return True
    if depth < 2 and isinstance(value, (list, tuple)):
        return any(_holds_group(v, depth + 1) for v in value)
    if depth < 2 and isinstance(value, dict):
        return any(_holds_group(v, depth + 1) for v in value.values())
    return False


def _abandon_snapshot(engine) -> None:
    """The snapshot in flight is given up: its commit needs the dead rank."""
    from ..checkpoint.snapshot import SnapshotCheckpointEngine

    ce = getattr(engine, "checkpoint_engine", None)
    if isinstance(ce, SnapshotCheckpointEngine):
        try:
            ce.abandon()
        except Exception as e:  # noqa: BLE001 - the snapshot is lost, training is not
            logger.warning(f"the snapshot in flight at the failure was given up: {e}")
