"""Resize requests from outside the job (``dynatrain resize``, ``dynatrain join``), served at step
boundaries: refused, served at once, or prepared in the background and switched to when every rank
has the new world ready (a grow or shrink) or at the step the preparation names (another TP or PP
degree at the job's world size), or given up."""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

from ..elastic.keys import REQUEST_KEY
from ..errors import ResizeRefusedError
from ..log import logger, plural
from ..transition.execute import transition_members
from ..zero.geometry import zero_optimizer_of
from .members import reports, request_joiners
from .records import ResizeRecord
from .resize import resize
from .state import BandRequest, Preparation
from .switch_memory import release_switch_memory
from .tp_grow import assign_grow, grow_tensor_parallel
from .tp_switch import tp_degree_for
from .transfer import background_xfer

REFUSED = 0  # the world size of a request rank 0 refused as it read it (already answered)


def serve_request(engine, index: int, world_size: int) -> None:
    """``dynatrain resize`` request ``index``, at this step boundary on every rank (each learned
    it from the step's vote); rank 0 of the world that results answers it.

    With ``background_groups`` (the default) a grow or shrink is only *prepared* here
    (:func:`prepare`): training goes on while the next world is built, and the switch happens at
    the first step boundary where every rank has it ready (:func:`finish_request`)."""
    dt = engine._dt
    first = dt.members[0]  # old rank 0 answers where it stays (a grow may give its rank to a joiner)
    dt.requests_seen = index + 1  # before the resize: its header hands the count to joiners
    if world_size == REFUSED:
        return  # rank 0 refused it when it read it (no free slots) and answered the requester
    try:
        if dt.in_place_loop is not None and world_size > engine.dp_world_size:
            raise ResizeRefusedError(
                f"a grow to {world_size} ranks: this job's training loop ({dt.frontend}, outside Hugging Face "
                "Trainer) runs on through resizes in its processes and cannot be entered by a new one at the "
                "job's step; it can shrink (resize down, preemption) but not grow"
            )
        tp = requested_tensor_parallel(dt, index)  # ResizeRefusedError: a PP degree (no pipeline here)
        if dt.config.background_groups and world_size != engine.dp_world_size and dt.tp_layout is None and tp is None:
            dt.split(world_size)
            zero_optimizer_of(engine)  # refuse engines we cannot resize before anything changes
            prepare(engine, index, world_size)
            return
        if dt.config.background_groups and dt.tp_layout is not None and world_size > len(dt.members):
            prepare_tensor_parallel_grow(engine, index, world_size, tp)
            return
        switch = dt.tp_layout is not None and world_size == len(dt.members) and tp not in (None, dt.tp)
        if switch and defer_band_switch(engine, index, world_size, tensor_parallel=tp):
            return
        rec = engine.resize(world_size) if tp is None else engine.resize(world_size, tensor_parallel=tp)
    except ResizeRefusedError as err:
        if engine.global_rank == 0:
            dt.membership.answer(index, False, str(err))
            logger.info(f"resize request {index}: {err}")
        return
    if rec is not None and rec.get("event") != "resize":
        return  # this process stood by and was taken back by a later resize
    if engine.is_member and reports(dt, first):
        dt.membership.answer(index, True, resized_message(rec, world_size), rec)


def resized_message(rec: Optional[dict], world_size: int) -> str:
    """The answer to a served request of a DP or AutoTP job: ``resized 2 -> 1 (TP 2 -> 1) after
    step S in T s`` of its record (a dict; None: nothing changed)."""
    if rec is None:
        return f"the job already runs on {plural(world_size, 'rank')}"
    tp = f" (TP {rec['tensor_parallel_from']} -> {rec['tensor_parallel_to']})" if "tensor_parallel_to" in rec else ""
    return f"resized {rec['from']} -> {rec['to']}{tp} after step {rec['step']} in {rec['seconds']:.2f} s"


def defer_band_switch(engine, index: int, world_size: int, **degree: int) -> bool:
    """Request ``index`` for another TP or PP degree at the job's world size (``degree``:
    ``tensor_parallel=M`` or ``pipeline_parallel=P``), with ``dynatrain.warm_switch_steps`` above
    0: checked as the switch will be and its memory touched from now on (``engine.
    prepare_resize``), the switch due that many steps later (:class:`~ds_dynatrain.engine.state.
    BandRequest`, made by :func:`finish_band_switch`). Returns False, doing nothing, where
    ``warm_switch_steps`` is 0. Every rank calls it.

    Raises:
        ResizeRefusedError: the layout the switch would refuse; nothing has changed.
    """
    dt = engine._dt
    ahead = dt.config.warm_switch_steps
    if ahead <= 0:
        return False
    engine.prepare_resize(world_size, **degree)
    ((key, value),) = degree.items()
    dt.band_request = BandRequest(index, key, value, engine.global_steps + ahead)
    if engine.global_rank == 0:
        label = "TP" if key == "tensor_parallel" else "PP"
        logger.info(
            f"resize request {index}: {label} {value} after step {dt.band_request.step}, its memory touched "
            "while training goes on"
        )
    return True


def finish_band_switch(engine, describe: Callable[[Optional[dict]], str]) -> None:
    """Every rank, at the step a deferred switch names (:func:`defer_band_switch`): switch now
    (``engine.resize``); rank 0 answers with ``describe(record)``, or why the switch was refused
    (a change since made the layout impossible; nothing changed)."""
    dt = engine._dt
    req, dt.band_request = dt.band_request, None
    try:
        rec = engine.resize(len(dt.members), **{req.key: req.degree})
    except ResizeRefusedError as err:
        if engine.global_rank == 0:
            dt.membership.answer(req.index, False, str(err))
            logger.info(f"resize request {req.index}: {err}")
        return
    if engine.global_rank == 0:
        dt.membership.answer(req.index, True, describe(rec), rec)


def drop_band_switch(engine, why: str) -> None:
    """Every rank: give up a deferred switch (a preemption or a scheduled change came first); its
    memory is let go and rank 0 tells the requester why."""
    dt = engine._dt
    req, dt.band_request = dt.band_request, None
    release_switch_memory(dt)
    if engine.global_rank == 0:
        label = "TP" if req.key == "tensor_parallel" else "PP"
        dt.membership.answer(req.index, False, f"{label} {req.degree} abandoned: {why}", aborted=True)
        logger.info(f"resize request {req.index} abandoned: {why}")


def requested_tensor_parallel(dt, index: int) -> Optional[int]:
    """The TP degree request ``index`` asks for (``dynatrain resize --tensor-parallel``), or None;
    every rank reads it from the store (the step's vote carries the world size only).

    Raises:
        ResizeRefusedError: the request gives a PP degree (``--pipeline-parallel``): this job has
            no pipeline.
    """
    body = json.loads(dt.membership.store.get(REQUEST_KEY.format(index)))
    if body.get("pipeline_parallel") is not None:
        raise ResizeRefusedError(f"PP degree {body['pipeline_parallel']} refused: this job is not a PipelineModule job")
    tp = body.get("tensor_parallel")
    return None if tp is None else int(tp)


def prepare(
    engine, index: int, world_size: int, tensor_parallel: Optional[int] = None, pipeline_parallel: Optional[int] = None
) -> None:
    """Publish the next generation, start its joiners (or take back standby processes) and build
    its default group and (a data-parallel resize) transition group in background threads;
    return at once. ``tensor_parallel``: an AutoTP job's grow to that TP degree (its members
    assigned already, :func:`prepare_tensor_parallel_grow`); ``pipeline_parallel``: a pipeline
    job's grow to that PP degree (its members assigned already,
    :func:`~ds_dynatrain.engine.pp_grow.assign_pp_grow`)."""
    dt = engine._dt
    t0 = time.perf_counter()
    members = request_joiners(engine, world_size)
    g = dt.generation + 1
    step = dt.published_step[g]
    if engine.global_rank == 0:
        dt.membership.go(g)  # joiners and standby processes form it as soon as they are up
    timeout = dt.group_timeout_s
    dt.membership.prepare(g, members, step, timeout)
    xfer = None
    band = tensor_parallel is not None or pipeline_parallel is not None
    if not band:
        xfer = background_xfer(dt, transition_members(dt.members, members), g, step, timeout)
    degrees = dict(tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
    dt.preparing = Preparation(index, world_size, g, members, step, xfer, t0, **degrees)
    if engine.global_rank == 0:
        logger.info(
            f"resize request {index}: preparing generation {g} ({len(dt.members)} -> {world_size} "
            f"{'processes' if band else 'ranks'}) while training goes on"
        )


def prepare_tensor_parallel_grow(engine, index: int, world_size: int, tensor_parallel: Optional[int]) -> None:
    """An AutoTP job's grow request, prepared as :func:`prepare` does: the TP degree (the requested
    one, else the job's where it divides ``world_size``, else the largest smaller one) and the
    ranks the survivors take decided now.

    Raises:
        ResizeRefusedError: the layout is refused (the TP degree does not divide the world size,
            the DP size cannot keep the global batch, AutoTP cannot cut the model at it); nothing
            has changed.
    """
    tp = tp_degree_for(engine._dt, world_size, tensor_parallel)
    assign_grow(engine, world_size, tp)
    prepare(engine, index, world_size, tensor_parallel=tp)


def finish_request(engine, prep: Preparation) -> None:
    """Every rank has the prepared groups: switch to the new world now."""
    dt = engine._dt
    dt.preparing = None
    first = dt.members[0]
    if prep.tensor_parallel is not None:
        rec = grow_tensor_parallel(engine, prep.world_size, prep.tensor_parallel, prepared=prep)
    else:
        rec = resize(engine, prep.world_size, dt.split(prep.world_size), prepared=prep)
    if not isinstance(rec, ResizeRecord):
        return  # this process left (or stood by and was taken back later: a join record)
    if engine.is_member and reports(dt, first):
        tp = "" if rec.tensor_parallel_to is None else f" (TP {rec.tensor_parallel_from} -> {rec.tensor_parallel_to})"
        dt.membership.answer(
            prep.index,
            True,
            f"resized {rec.from_world_size} -> {rec.to_world_size}{tp} after step "
            f"{rec.step} in {rec.seconds:.2f} s ({rec.prepare_s:.2f} s prepared in the background)",
            rec.to_dict(),
        )


def abandon(engine, prep: Preparation, why: str) -> None:
    """Give up a prepared request: its joiners are stopped, the requester told why."""
    dt = engine._dt
    dt.preparing = None
    release_switch_memory(dt)  # held for this request's world
    if engine.global_rank == 0:
        # the agents' cancellation first: a joiner that sees the generation given up exits, and
        # its agent must already know it was cancelled (not a joiner that died before it joined)
        stale = dt.spawned_for.pop(prep.generation, ())
        if stale:
            dt.membership.cancel_spawn(prep.generation, stale)
        dt.membership.abandon(prep.generation)
        band = prep.tensor_parallel is not None or prep.pipeline_parallel is not None  # its size counts processes
        size = plural(prep.world_size, "process", "processes") if band else plural(prep.world_size, "rank")
        message = f"resize to {size} abandoned: {why}"
        dt.membership.answer(prep.index, False, message, aborted=True)
        logger.info(f"resize request {prep.index} abandoned: {why}")
    dt.published.pop(prep.generation, None)
    dt.assigned = {k: v for k, v in dt.assigned.items() if k[0] != prep.generation}
    if prep.xfer is not None:
        prep.xfer.close()
    # a joiner's id comes back when the generation is published again: a group built with the
    # cancelled joiner must not pass for the new one's
    gone = set(prep.members) - set(dt.members) - set(dt.standby)
    dt.membership.groups.evict(lambda members: not set(members) & gone)


def cancel_pending_joiners(engine) -> None:
    """Stop joiners started for a generation that will not be formed (the job is ending). A
    prepared request is given up on every rank (each closes its background builds); rank 0 asks
    the agents to stop the joiners."""
    dt = engine._dt
    if dt.membership is None:
        return
    if dt.preparing is not None:
        abandon(engine, dt.preparing, "the job ended first")
    if engine.global_rank != 0:
        return
    for g, joiners in sorted(dt.spawned_for.items()):
        if g > dt.generation and joiners:
            dt.membership.cancel_spawn(g, joiners)
    dt.spawned_for = {g: j for g, j in dt.spawned_for.items() if g <= dt.generation}
