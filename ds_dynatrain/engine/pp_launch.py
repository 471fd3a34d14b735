"""A pipeline job under ``dynatrain launch``: the job's membership beside the group its script
started, what rank 0 publishes for the launcher, and the step boundary: a stop of the job,
preemption notices and resize requests.

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
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator

from ..config import DynatrainConfig
from ..elastic.launch_env import LaunchContext
from ..elastic.membership import GenerationRecord, Membership
from ..errors import ResizeRefusedError
from ..log import logger, plural
from .lifecycle import stop_job
from .pp_resize import largest_pp_layout, pp_for_world, shrink_pipeline_parallel
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
        dt.membership.publish_job(dt.global_batch, dt.micro_batch, dt.config.max_world_size, world, pipeline=True)


def _read_request(engine) -> Tuple[int, int, int]:
    """Rank 0: ``(index, world size, PP degree)`` of the next request this job serves at this step
    (a PP change at its world size, or fewer processes; PP 0: the job's choice), else
    ``(-1, 0, 0)``; any other request (a grow, ``dynatrain join``) is answered as refused here."""
    dt = engine._dt
    while (request := dt.membership.pending_request(dt.requests_seen)) is not None:
        index, body = request
        dt.requests_seen = index + 1
        world, pp = int(body.get("world_size", 0)), body.get("pipeline_parallel")
        if "join" not in body and body.get("tensor_parallel") is None and 0 < world <= len(dt.members):
            return index, world, int(pp or 0)
        why = (
            f"a PipelineModule job of {plural(len(dt.members), 'process', 'processes')} changes its PP degree "
            f"(dynatrain resize --world-size {len(dt.members)} --pipeline-parallel P) or shrinks; it does not grow "
            "and has no TP degree"
        )
        dt.membership.answer(index, False, why)
        logger.info(f"resize request {index}: refused: {why}")
    return -1, 0, 0


def _serve(engine, index: int, world: int, pp: int) -> None:
    """Every rank: request ``index`` (``world`` processes at PP degree ``pp``; 0: the degree
    :func:`~ds_dynatrain.engine.pp_resize.pp_for_world` picks); rank 0 answers it (the record, or
    why it was refused: nothing changed then)."""
    dt = engine._dt
    try:
        if world == len(dt.members):
            pp = pp or dt.pp_layout.pp
            rec = switch_pipeline_parallel(engine, pp).to_dict() if pp != dt.pp_layout.pp else None
        else:
            pp = pp or pp_for_world(engine, world) or dt.pp_layout.pp  # none: the shrink refuses, saying why
            rec = shrink_pipeline_parallel(engine, world, pp)
            rec = rec.to_dict() if rec is not None else None
    except ResizeRefusedError as err:
        if engine.global_rank == 0:
            dt.membership.answer(index, False, str(err))
            logger.info(f"resize request {index}: {err}")
        return
    if dt.retired or engine.global_rank != 0:
        return
    msg = (
        f"PP {rec['pipeline_parallel_from']} x DP {rec['from'] // rec['pipeline_parallel_from']} -> "
        f"PP {rec['pipeline_parallel_to']} x DP {rec['to'] // rec['pipeline_parallel_to']} after step {rec['step']} "
        f"in {rec['seconds']:.2f} s"
        if rec
        else f"the job already runs at PP {pp}"
    )
    dt.membership.answer(index, True, msg, rec)


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
            f"{world} ranks at PP {pp} x DP {world // pp}"
        )
    shrink_pipeline_parallel(engine, world, pp, must_leave=gone)


def at_step_boundary(engine) -> None:
    """After each ``train_batch`` of a launched pipeline job, before its periodic snapshot: a
    signal to the launcher (SIGTERM, SIGINT) ends the job here on every rank, after a final
    snapshot of this step (:func:`~ds_dynatrain.engine.lifecycle.stop_job`); else preempted
    members leave (a preemption notice, SIGTERM to a worker: the others shrink without them); else
    the next request is served (a PP change at the job's world size, or fewer processes) or
    answered as refused. Rank 0 reads the store; one all-reduce of ``4 + world`` numbers tells
    every rank, each adding its own preemption notice. Collective.

    Raises:
        SystemExit: the job was stopped (status 0).
    """
    dt = engine._dt
    world, rank = len(dt.members), engine.global_rank
    said = [0.0] * (4 + world)
    said[4 + rank] = float(dt.preempted)
    if rank == 0:
        dt.membership.set_last_step(engine.global_steps)  # a restart from a snapshot counts the steps it loses
        said[0] = float(dt.membership.stop_requested())
        said[1:4] = [float(x) for x in _read_request(engine)] if not said[0] else [-1.0, 0.0, 0.0]
    flat = torch.tensor(said, dtype=torch.float64).to(get_accelerator().current_device_name())
    tdist.all_reduce(flat)
    signum, index, req_world, pp, *flags = (int(x) for x in flat.tolist())
    if signum:
        stop_job(engine, signum, "the launcher was signalled")
    preempted = [r for r, f in enumerate(flags) if f]
    if preempted:  # a request read now waits for the next step (it is not answered yet)
        _leave_preempted(engine, preempted)
    elif index >= 0:
        _serve(engine, index, req_world, pp)
    if len(dt.members) != world and not dt.retired:  # the new world's rank 0 reads on from the answered ones
        dt.requests_seen = dt.membership.served()
