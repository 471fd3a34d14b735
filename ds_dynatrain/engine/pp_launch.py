"""A pipeline job under ``dynatrain launch``: the job's membership beside the group its script
started, what rank 0 publishes for the launcher, and the step boundary: a stop of the job,
preemption notices, a grow prepared behind training, and resize requests
(:mod:`~ds_dynatrain.engine.pp_requests`).

The script starts ``torch.distributed`` itself before it builds its ``PipelineModule``
(``deepspeed.init_distributed()`` over the store the launcher hands processes started together),
and the module's groups are made on that group, so the job keeps it. What the launcher needs from
the job goes through the job's store: the generation and the global batch a restart's world size is
checked against, and the last step (a restart from a snapshot counts the steps it loses); a signal
to the launcher ends the job at the next step, after a final snapshot. A worker that dies is the
launcher's restart on the processes left (``snapshot.restore_on_failure``); the
restarted script builds its module at the PP degree it picks for its world, and
:func:`~ds_dynatrain.engine.restore.restore` loads the snapshot there (any PP and DP degree).
"""

from __future__ import annotations

import signal
from typing import Optional, Sequence

import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator

from ..config import DynatrainConfig
from ..elastic.launch_env import LaunchContext
from ..elastic.membership import GenerationRecord, Membership
from ..log import logger, plural
from .lifecycle import stop_job
from .pp_requests import finish_grow, read_request, serve, switch_message
from .pp_resize import largest_pp_layout, shrink_pipeline_parallel
from .requests import abandon, drop_band_switch, finish_band_switch


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
        dt.membership.publish_job(dt.global_batch, dt.micro_batch, dt.config.max_world_size, world, pipeline=True)


def _leave_preempted(engine, preempted: Sequence[int]) -> None:
    """Every rank: the members of old ranks ``preempted`` leave; the others go on at the largest
    layout they serve (:func:`~ds_dynatrain.engine.pp_resize.largest_pp_layout`), or the job
    stops when none is left."""
    dt = engine._dt
    gone = tuple(dt.members[r] for r in preempted)
    world, pp = largest_pp_layout(engine, len(dt.members) - len(gone))
    if world == 0:
        stop_job(engine, signal.SIGTERM, "every member was preempted")
    if engine.global_rank == 0:
        logger.info(
            f"preemption of {list(gone)} after step {engine.global_steps}: the job goes on with "
            f"{plural(world, 'process', 'processes')} at PP {pp} x DP {world // pp}"
        )
    shrink_pipeline_parallel(engine, world, pp, must_leave=gone)


def at_step_boundary(engine) -> None:
    """After each ``train_batch`` of a launched pipeline job, before its periodic snapshot: a
    signal to the launcher (SIGTERM, SIGINT) ends the job here on every rank, after a final
    snapshot of this step (:func:`~ds_dynatrain.engine.lifecycle.stop_job`); else preempted
    members leave (a preemption notice, SIGTERM to a worker: the others shrink without them, and a
    grow being prepared is given up); else a prepared grow whose group every process has built is
    finished, or one whose build failed given up; else a prepared PP switch whose step has come is
    made (a preemption gives it up); else the next request is served or answered as refused
    (:mod:`~ds_dynatrain.engine.pp_requests`). Rank 0 reads the store; one all-reduce of
    ``6 + world`` numbers tells every rank, each adding its own preemption notice and whether its
    part of a prepared grow is ready or failed. Collective.

    Raises:
        SystemExit: the job was stopped (status 0).
    """
    dt = engine._dt
    world, rank, prep = len(dt.members), engine.global_rank, dt.preparing
    said = [0.0] * (6 + world)
    said[6 + rank] = float(dt.preempted)
    error = None
    if prep is not None:
        ready, error = prep.state(dt, rank == 0)
        said[4:6] = [float(ready), float(error is not None)]
    if rank == 0:
        dt.membership.set_last_step(engine.global_steps)  # a restart from a snapshot counts the steps it loses
        said[0] = float(dt.membership.stop_requested())
        reading = not said[0] and prep is None and dt.band_request is None  # one change at a time
        said[1:4] = [float(x) for x in read_request(engine)] if reading else [-1.0, 0.0, 0.0]
    flat = torch.tensor(said, dtype=torch.float64).to(get_accelerator().current_device_name())
    tdist.all_reduce(flat)
    signum, index, req_world, pp, ready, failed, *flags = (int(x) for x in flat.tolist())
    if signum:
        stop_job(engine, signum, "the launcher was signalled")  # a prepared grow is given up there
    preempted = [r for r, f in enumerate(flags) if f]
    if prep is not None and (preempted or failed):
        unbuilt = f"{plural(failed, 'process', 'processes')} could not build the new generation's group"
        why = "a preemption came first" if preempted else f"the new world could not be formed: {error or unbuilt}"
        abandon(engine, prep, why)
    elif prep is not None and ready == world:
        finish_grow(engine, prep)
    if preempted and dt.band_request is not None:
        drop_band_switch(engine, "a preemption came first")
    if preempted:  # a request read now waits for the next step (it is not answered yet)
        _leave_preempted(engine, preempted)
    elif dt.band_request is not None and engine.global_steps >= dt.band_request.step:
        finish_band_switch(engine, switch_message)
    elif index >= 0:
        serve(engine, index, req_world, pp)
    if len(dt.members) != world and not dt.retired:  # the new world's rank 0 reads on from the answered ones
        dt.requests_seen = dt.membership.served()
