"""A pipeline job under ``dynatrain launch``: the job's membership beside the group its script
started, what rank 0 publishes for the launcher, a stop of the job and resize requests at the step
boundary.

The script starts ``torch.distributed`` itself before it builds its ``PipelineModule``
(``deepspeed.init_distributed()`` over the store the launcher hands processes started together),
and the module's groups are made on that group, so the job keeps it. What the launcher needs from
the job goes through the job's store: the generation and the global batch a restart's world size is
checked against, and the last step (a restart from a snapshot counts the steps it loses); a signal
to the launcher ends the job at the next step, after a final snapshot. A worker
that dies is the launcher's restart on the processes left (``snapshot.restore_on_failure``); the
restarted script builds its module at the PP degree it picks for its world, and
:func:`~ds_dynatrain.engine.restore.restore` loads the snapshot there (any PP and DP degree).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator

from ..config import DynatrainConfig
from ..elastic.launch_env import LaunchContext
from ..elastic.membership import GenerationRecord, Membership
from ..errors import ResizeRefusedError
from ..log import logger
from .lifecycle import stop_job
from .pp_switch import switch_pipeline_parallel


def launched_membership(ctx: Optional[LaunchContext], dt_cfg: DynatrainConfig) -> Optional[Membership]:
    """The job's membership (its store) when ``dynatrain launch`` started this process, else
    None. A pipeline job keeps the group its script started (``deepspeed.init_distributed()``
    over the launcher's store for processes started together): its ``PipelineModule`` was built
    on it."""
    if ctx is None:
        return None
    return Membership(ctx, dt_cfg.collective_timeout_s, tdist.get_backend())


def publish_launched(engine) -> None:
    """Rank 0 of a launched pipeline job publishes its generation and what the launcher checks a
    restart's world size against (the global batch and micro-batch)."""
    dt = engine._dt
    if engine.global_rank == 0:
        world = len(dt.members)
        dt.membership.publish(GenerationRecord(dt.generation, world, dt.members, engine.global_steps))
        dt.membership.publish_job(dt.global_batch, dt.micro_batch, dt.config.max_world_size, world)


def _read_request(engine) -> Tuple[int, int]:
    """Rank 0: ``(index, PP degree)`` of the next request when it is a PP change at this job's
    world size (served at this step by every rank), else ``(-1, 0)``; any other request is
    answered as refused here, with the reason."""
    dt = engine._dt
    while (request := dt.membership.pending_request(dt.requests_seen)) is not None:
        index, body = request
        dt.requests_seen = index + 1
        world, pp = int(body.get("world_size", 0)), body.get("pipeline_parallel")
        if "join" not in body and pp is not None and world == len(dt.members):
            return index, int(pp)
        why = (
            f"a PipelineModule job changes its PP degree over its {len(dt.members)} processes "
            f"(dynatrain resize --world-size {len(dt.members)} --pipeline-parallel P); another number of processes "
            "is not served yet (it restarts from its snapshots on the processes left when one dies)"
        )
        dt.membership.answer(index, False, why)
        logger.info(f"resize request {index}: refused: {why}")
    return -1, 0


def _serve(engine, index: int, pp: int) -> None:
    """Every rank: request ``index``'s change to PP degree ``pp``; rank 0 answers it (the record,
    or why it was refused: nothing changed then)."""
    dt = engine._dt
    try:
        rec = switch_pipeline_parallel(engine, pp).to_dict() if pp != dt.pp_layout.pp else None
    except ResizeRefusedError as err:
        if engine.global_rank == 0:
            dt.membership.answer(index, False, str(err))
            logger.info(f"resize request {index}: {err}")
        return
    if engine.global_rank == 0:
        msg = (
            f"PP {rec['pipeline_parallel_from']} -> {rec['pipeline_parallel_to']} over {rec['to']} processes "
            f"after step {rec['step']} in {rec['seconds']:.2f} s"
            if rec
            else f"the job already runs at PP {pp}"
        )
        dt.membership.answer(index, True, msg, rec)


def at_step_boundary(engine) -> None:
    """After each ``train_batch`` of a launched pipeline job, before its periodic snapshot: a
    signal to the launcher (SIGTERM, SIGINT) ends the job here on every rank, after a final
    snapshot of this step (:func:`~ds_dynatrain.engine.lifecycle.stop_job`); else a ``dynatrain
    resize --pipeline-parallel P`` request at the job's world size is served (the PP switch of
    :mod:`.pp_switch`) and any other request answered as refused. Rank 0 reads the store, one
    all-reduce of three numbers tells every rank. Collective.

    Raises:
        SystemExit: the job was stopped (status 0).
    """
    dt = engine._dt
    said = [0.0, -1.0, 0.0]
    if engine.global_rank == 0:
        dt.membership.set_last_step(engine.global_steps)  # a restart from a snapshot counts the steps it loses
        signum = dt.membership.stop_requested()
        index, pp = _read_request(engine) if not signum else (-1, 0)
        said = [float(signum), float(index), float(pp)]
    flat = torch.tensor(said if engine.global_rank == 0 else [0.0, 0.0, 0.0], dtype=torch.float64)
    flat = flat.to(get_accelerator().current_device_name())
    tdist.all_reduce(flat)
    signum, index, pp = (int(x) for x in flat.tolist())
    if signum:
        stop_job(engine, signum, "the launcher was signalled")
    if index >= 0:
        dt.requests_seen = index + 1
        _serve(engine, index, pp)
