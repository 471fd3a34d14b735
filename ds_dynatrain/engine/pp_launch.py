"""A pipeline job under ``dynatrain launch``: the job's membership beside the group its script
started, what rank 0 publishes for the launcher, and resize requests answered as refused.

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

from typing import Optional

import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator

from ..config import DynatrainConfig
from ..elastic.launch_env import LaunchContext
from ..elastic.membership import GenerationRecord, Membership
from ..log import logger
from .lifecycle import stop_job


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


def refuse_requests(engine) -> None:
    """Rank 0 answers every ``dynatrain resize`` / ``join`` request of a launched pipeline job as
    refused (not served yet), so no requester waits for an answer."""
    dt = engine._dt
    if dt.membership is None or engine.global_rank != 0:
        return
    while (request := dt.membership.pending_request(dt.requests_seen)) is not None:
        index, _body = request
        why = (
            "a PipelineModule job does not serve resize requests yet: it changes its PP degree by "
            "engine.resize(world_size, pipeline_parallel=P) or dynatrain.resize_schedule, and restarts from its "
            "snapshots on the processes left when one dies"
        )
        dt.membership.answer(index, False, why)
        logger.info(f"resize request {index}: refused: {why}")
        dt.requests_seen = index + 1


def at_step_boundary(engine) -> None:
    """After each ``train_batch`` of a launched pipeline job, before its periodic snapshot: a
    signal to the launcher (SIGTERM, SIGINT) ends the job here on every rank, after a final
    snapshot of this step (:func:`~ds_dynatrain.engine.lifecycle.stop_job`; rank 0 reads the
    store, one all-reduce of one number tells every rank); else rank 0 records the step and
    answers pending requests (:func:`refuse_requests`). Collective.

    Raises:
        SystemExit: the job was stopped (status 0).
    """
    dt = engine._dt
    signum = dt.membership.stop_requested() if engine.global_rank == 0 else 0
    flag = torch.tensor([float(signum)], device=get_accelerator().current_device_name())
    tdist.all_reduce(flag)
    if int(flag.item()):
        stop_job(engine, int(flag.item()), "the launcher was signalled")
    if engine.global_rank == 0:
        dt.membership.set_last_step(engine.global_steps)  # a restart from a snapshot counts the steps it loses
        refuse_requests(engine)
