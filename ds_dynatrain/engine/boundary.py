"""The step boundary: what happens after each optimizer step, the same decision on every rank.

One all-reduce (:mod:`~ds_dynatrain.engine.vote`) carries the loss, rank 0's pending request,
the preemption notices, the standby processes found gone, a stop of the job (a signal to the
launcher) and how the background builds of a prepared request stand. Then, in this order: the
step record; the end of the job when it was stopped or every member was preempted (a final
snapshot, then every process exits: :func:`~ds_dynatrain.engine.lifecycle.stop_job`); the
periodic snapshot; and at most one change of the world: a prepared request given up (a
preemption, a scheduled resize or a failed build came first), the preempted members leaving, the
scheduled resize, a requested TP switch whose step has come (prepared
``dynatrain.warm_switch_steps`` steps ahead), the switch to a prepared world, or a new request
served; finally joiners of a scheduled grow are started ahead.
"""

from __future__ import annotations

import signal
import time
from typing import Optional, Tuple

import torch
from deepspeed.accelerator import get_accelerator

from ..batch import largest_world_size
from ..elastic.keys import ENDED_KEY
from ..elastic.placement import place_joiners
from ..errors import ResizeRefusedError
from ..log import logger, plural
from ..zero.state import relink_optimizer_state
from . import replicas
from .lifecycle import stop_job
from .members import request_joiners
from .pp_grow import assign_pp_grow
from .records import StepRecord, format_step
from .requests import (
    REFUSED,
    abandon,
    drop_band_switch,
    finish_band_switch,
    finish_request,
    resized_message,
    serve_request,
)
from .state import ElasticState
from .switch_memory import prepare_scheduled
from .tp_grow import assign_grow
from .tp_resize import largest_tp_layout
from .tp_switch import tp_degree_for
from .vote import StepTally, StepVote, exchange


def after_optimizer_step(engine) -> None:
    """Run the step boundary after optimizer step ``engine.global_steps`` (collective)."""
    dt = engine._dt
    step = engine.global_steps
    step_s = time.perf_counter() - dt.step_t0 if dt.step_t0 is not None else 0.0
    dt.step_t0 = None
    if not dt.hp_linked:
        # DeepSpeed 0.19.8 (stage_1_and_2.py ``_optimizer_step``) links every parameter's
        # optimizer-state fragment right after group 0's first step, when the later groups
        # have no state yet, and never again: ``safe_get_full_optimizer_state`` then fails
        # for every parameter outside group 0. Link once more now that all groups have state.
        relink_optimizer_state(engine)
        dt.hp_linked = True
    prep = dt.preparing
    ready, error = prep.state(dt, engine.global_rank == 0) if prep is not None else (False, None)
    quiet = prep is None and dt.band_request is None and step not in dt.schedule  # one change at a time
    request = _read_request(engine) if quiet else None
    gone = _gone_standby(engine)
    stop = dt.membership.stop_requested() if dt.membership is not None and engine.global_rank == 0 else 0
    replicas.before_vote(engine)  # a completed vote proves every replica of the last refresh complete
    vote = StepVote(
        loss_sum=dt.loss_sum,
        loss_count=dt.loss_count,
        request=request,
        preempted=dt.preempted,
        standby_gone=gone,
        ready=ready,
        failed=error is not None,
        stop=stop,
    )
    world = len(dt.members)  # processes (an AutoTP job has fewer DP ranks)
    tally = exchange(vote, engine.global_rank, world, len(dt.standby), get_accelerator().current_device_name())
    if tally.standby_gone:
        dt.standby = tuple(m for i, m in enumerate(dt.standby) if i not in tally.standby_gone)
    dt.loss_sum, dt.loss_count = 0.0, 0
    dt.step_losses.append((engine.global_steps, tally.loss))
    record_step(engine, tally.loss, step_s)
    if tally.stop or len(tally.preempted) == world:
        _end_job(engine, tally)  # raises SystemExit(0) on every rank
    replicas.after_vote(engine)
    _snapshot(engine)
    _decide(engine, tally, error)


def _read_request(engine) -> Optional[Tuple[int, int]]:
    """Rank 0: the next request of the store as ``(index, world size)`` (a ``dynatrain join`` is a
    grow by its slots, its joiners placed on its node), or None. A grow whose new workers find no
    free slot (:mod:`~ds_dynatrain.elastic.placement`) is refused here and answered: its world size
    is :data:`~ds_dynatrain.engine.requests.REFUSED`."""
    dt = engine._dt
    if dt.membership is None or engine.global_rank != 0:
        return None
    request = dt.membership.pending_request(dt.requests_seen)
    if request is None:
        return None
    index, body = request
    if "join" in body:
        dt.join_node = (index, int(body["join"]))
        return index, len(dt.members) + int(body["slots"])
    world_size = int(body["world_size"])
    if dt.membership.answered(index):
        return index, REFUSED  # refused when read at an earlier boundary that served something else
    new = world_size - len(dt.members) - len(dt.standby)  # standby processes are taken back first
    if new > 0:
        try:
            place_joiners(dt.membership.store, tuple(dt.members) + tuple(dt.standby), [f"new{i}" for i in range(new)])
        except ResizeRefusedError as err:
            dt.membership.answer(index, False, f"resize to {world_size} ranks refused: {err}")
            logger.info(f"resize request {index}: refused: {err}")
            return index, REFUSED  # every rank counts it served
    return index, world_size


def _gone_standby(engine) -> frozenset:
    """Rank 0: indices of the standby processes that are gone (preempted while standing by)."""
    dt = engine._dt
    if dt.membership is None or engine.global_rank != 0 or not dt.standby:
        return frozenset()
    gone = set(dt.membership.gone_standby(dt.standby))
    return frozenset(i for i, m in enumerate(dt.standby) if m in gone)


def record_step(engine, loss, step_s: float) -> None:
    """Rank 0: the step record of the step just completed (``loss``: its mean over every rank, a
    float or a 0-d tensor, read here only, so that no other rank waits for its device; ``step_s``
    seconds), and every ``log_interval_steps`` a step line whose step time and throughput are
    those of the steps since the last line. Other ranks: nothing."""
    dt, step = engine._dt, engine.global_steps
    if engine.global_rank != 0:
        return
    lr = float(engine.get_lr()[0]) if engine.get_lr() else float("nan")
    rec = StepRecord.of(step, engine.dp_world_size, float(loss), lr, dt.global_batch, step_s, dt.tokens_per_sample)
    rec.threads = torch.get_num_threads()
    dt.metrics.write(rec)
    if dt.membership is not None:
        dt.membership.set_last_step(step)  # a restore from a snapshot counts the steps it loses
    steps, seconds, samples = dt.window
    dt.window = (steps + 1, seconds + step_s, samples + rec.samples)
    if step % dt.config.log_interval_steps == 0:
        logger.info(format_step(rec, *dt.window))
        dt.window = (0, 0.0, 0)


def _snapshot(engine) -> None:
    dt, step = engine._dt, engine.global_steps
    snap = dt.config.snapshot
    if not (snap.interval_steps and step % snap.interval_steps == 0):
        return
    # its record is written once its outcome is known (the snapshot engine's on_outcome)
    engine.save_checkpoint(snap.dir, tag=f"global_step{step}")


def _decide(engine, tally: StepTally, error: Optional[str]) -> None:
    """At most one change of the world at this boundary (the order of the module docstring)."""
    dt = engine._dt
    prep = dt.preparing
    target = dt.schedule.get(engine.global_steps)
    if prep is not None and (tally.preempted or target is not None or tally.failed):
        unbuilt = f"{plural(tally.failed, 'rank')} could not build its groups"
        why = (
            f"the new world could not be formed: {error or unbuilt}"
            if tally.failed and not tally.preempted and target is None
            else "a preemption or a scheduled resize came first"
        )
        abandon(engine, prep, why)
        prep = None
    if dt.band_request is not None and (tally.preempted or target is not None):
        drop_band_switch(engine, "a preemption or a scheduled resize came first")
    if tally.preempted:
        leave_preempted(engine, tally.preempted)
    elif target is not None:
        tp = dt.tp_schedule.get(engine.global_steps)  # an AutoTP job's entry may give a TP degree
        if dt.tp_layout is None:
            engine.resize(target) if tp is None else engine.resize(target, tensor_parallel=tp)
        else:
            try:  # checked at launch, but a preemption may have made it a grow since
                engine.resize(target, tensor_parallel=tp)
            except ResizeRefusedError as err:
                if engine.global_rank == 0:
                    logger.warning(f"the resize scheduled after step {engine.global_steps} was refused: {err}")
    elif dt.band_request is not None:
        if engine.global_steps >= dt.band_request.step:
            finish_band_switch(engine, lambda rec: resized_message(rec, len(dt.members)))
    elif prep is not None:
        if tally.ready == len(dt.members):
            finish_request(engine, prep)
    elif tally.request is not None:
        serve_request(engine, *tally.request)
    if engine.is_member:
        spawn_ahead(engine)
        prepare_scheduled(engine)  # a scheduled TP switch's memory, touched in the background


def leave_preempted(engine, ranks) -> None:
    """Members that received SIGTERM (``ranks``) leave now, after handing over their partitions:
    the job shrinks to the largest world size the others can serve (the global batch rule
    decides; surplus processes leave too)."""
    dt = engine._dt
    leavers = tuple(dt.members[r] for r in sorted(ranks))
    if dt.tp_layout is not None:  # an AutoTP job: the largest layout the others can serve
        size, tp = largest_tp_layout(
            dt.global_batch, dt.micro_batch, len(dt.members) - len(leavers), dt.tp, dt.config.max_world_size
        )
        if engine.global_rank == 0:
            logger.info(
                f"preemption of {list(leavers)} after step {engine.global_steps}: the job goes on with "
                f"{plural(size, 'rank')} at TP {tp} x DP {size // tp}"
            )
        engine.resize(size, must_leave=leavers, tensor_parallel=tp)
        return
    size = largest_world_size(
        dt.global_batch, dt.micro_batch, engine.dp_world_size - len(leavers), dt.config.max_world_size
    )
    if engine.global_rank == 0:
        logger.info(
            f"preemption of {list(leavers)} after step {engine.global_steps}: "
            f"the job goes on with {plural(size, 'rank')}"
        )
    engine.resize(size, must_leave=leavers)


def _end_job(engine, tally: StepTally) -> None:
    """The launcher was sent SIGTERM/SIGINT, or every member was preempted: the job ends at this
    boundary (the stop comes before any change of the world), after a final snapshot."""
    dt = engine._dt
    if tally.stop:
        stop_job(engine, tally.stop, "the launcher was signalled")
    if engine.global_rank == 0:
        dt.membership.store.set(ENDED_KEY, str(engine.global_steps))  # the launcher says why
    stop_job(engine, signal.SIGTERM, "every member was preempted")


def spawn_ahead(engine) -> None:
    """Ask the agent to start the joiners of the next scheduled grow a few steps early, so that
    their start-up (imports, model construction) overlaps training."""
    dt: ElasticState = engine._dt
    if dt.membership is None or not engine.is_member or dt.preparing is not None:
        return  # a request being prepared owns the next generation
    upcoming = [(s, w) for s, w in sorted(dt.schedule.items()) if s >= engine.global_steps]
    if not upcoming:
        return
    step, world_size = upcoming[0]
    if step == engine.global_steps or world_size <= len(dt.members):
        return
    if step - engine.global_steps > dt.config.spawn_lookahead_steps:
        return
    if dt.tp_layout is not None or dt.pp_layout is not None:  # joiners take the ranks the grow gives them
        if dt.published.get(dt.generation + 1) is not None:
            return
        try:
            if dt.tp_layout is not None:
                assign_grow(engine, world_size, tp_degree_for(dt, world_size, dt.tp_schedule.get(step)))
            else:
                assign_pp_grow(engine, world_size, dt.pp_schedule[step])
        except ResizeRefusedError:
            return  # refused at the grow itself, with the reason
    request_joiners(engine, world_size)
