"""Joining a running job, the one path for every process that enters a generation it was not in: a
new process the agent started, and a standby process taken back (which also waits here, standing
by, until a generation names it or the job ends)."""

from __future__ import annotations

import time
from typing import Callable, List, Optional

from ..elastic.launch_env import LaunchContext
from ..elastic.membership import GenerationRecord
from ..elastic.priority import return_to_job_priority
from ..errors import NotAMemberError, TransitionAbortedError
from ..log import logger
from ..planner.plan import scalars_for
from ..transition.buffers import reused_bytes
from .construct import construct, ds_config_for, keep_returned_optimizer, own_layout
from .header import install_header_state, join_header
from .members import evict_groups, form_generation
from .pending import wait_transition
from .records import JoinRecord
from .state import ElasticState, PendingResize
from .transfer import begin_transition, build_joiner_xfer, post_params

POLL_S = 0.02


def wait_unless_given_up(
    dt: ElasticState, rec: GenerationRecord, done: Callable[[], bool], what: str, timeout_s: float
) -> None:
    """A process joining generation ``rec`` waits for ``done()`` (polled), at most ``timeout_s``.

    Raises:
        TransitionAbortedError: generation ``rec`` was given up or the job ended first, or
            ``what`` did not happen within ``timeout_s``.
    """
    membership = dt.membership
    deadline = time.monotonic() + timeout_s
    while not done():
        if membership.is_abandoned(rec.generation, rec.step) or membership.job_over():
            raise TransitionAbortedError(f"generation {rec.generation} was given up before it formed")
        if time.monotonic() > deadline:
            raise TransitionAbortedError(f"generation {rec.generation}: {what} within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def joined_generation(dt: ElasticState, ctx: LaunchContext) -> GenerationRecord:
    """A joiner waits until its generation forms (the survivors decided to switch), returns to the
    workers' priority, and reads the generation.

    Raises:
        NotAMemberError: the generation does not name this process (it was cancelled).
        TransitionAbortedError: the generation was not published within the timeout.
    """
    dt.membership.wait_go(ctx.generation, dt.group_timeout_s)
    started_at = return_to_job_priority()  # the agent started it below the workers: back to their priority
    rec = dt.membership.read(ctx.generation, dt.group_timeout_s)
    if ctx.member not in rec.members:
        raise NotAMemberError(
            f"member {ctx.member} is not in generation {rec.generation} ({list(rec.members)}): it was cancelled"
        )
    lower = f" (started at nice {started_at} until now)" if started_at is not None else ""
    logger.info(
        f"member {ctx.member} joining generation {rec.generation} as rank {ctx.rank} of {rec.world_size}{lower}"
    )
    return rec


def join_generation(
    engine, rec: GenerationRecord, model, optimizer, model_parameters, lr_scheduler, groups: List[list], rebuilt: bool
) -> JoinRecord:
    """Join generation ``rec`` (its membership names this process): form its process groups,
    receive and check the header, receive this process's partitions, build the engine, install
    the state. Returns the join record (completed when the moments have arrived).

    Args:
        engine: the engine object to build (a new one, or this standby process's own).
        model, optimizer, model_parameters, lr_scheduler: what ``DeepSpeedEngine.__init__`` takes.
        groups: the parameter groups the optimizer will hold, as lists of parameters.
        rebuilt: the optimizer and scheduler are live objects of an earlier engine (a standby
            process): their config sections are left out.

    Raises:
        TransitionAbortedError: the generation was given up, a rendezvous or the header failed.
        LayoutMismatchError: this process's model differs from rank 0's.
    """
    dt = engine._dt
    t0 = time.perf_counter()
    timeout = dt.group_timeout_s
    reused = enter_generation(dt, rec, timeout)
    xfer = build_joiner_xfer(dt, rec, timeout)
    own = own_layout(dt, model, groups, rec.world_size)
    wait_for_switch(dt, rec, timeout)
    # the memory held until now (the warm-up's, the engine's): partition tensors among it become
    # the new partitions; the rest is freed before the set-up and the first step, which reuse it
    held, dt.held = dt.held, []
    header, plan = join_header(rec, own)
    dests, _, transfer, overlap, xfer = begin_transition(
        plan, dt, rec.generation, header, None, receives=True, group=xfer.get(timeout), held=held
    )
    held_bytes = reused_bytes(dests, held)
    del held
    post_params(dt, plan, model)
    if held_bytes:
        logger.info(f"joiner receives its partitions into {held_bytes / 2**20:.0f} MiB held since its warm-up")
    dt.members = plan.new_members
    dt.generation = rec.generation
    dt.retired = False
    dt.rebuild_broadcast = plan.survivor_ranks
    construct(
        engine,
        dt,
        model,
        optimizer,
        model_parameters,
        lr_scheduler,
        ds_config_for(dt, dt.split(rec.world_size), client_objects=rebuilt),
        light=True,
    )
    dt.params_spread = None
    keep_returned_optimizer(engine)
    install_header_state(engine, header, dests, joiner=True)
    record = JoinRecord(
        step=engine.global_steps,
        generation=rec.generation,
        group_reused=reused,
        seconds=time.perf_counter() - t0,
        warmup_s=dt.warmup_s,
        partitions_held_bytes=held_bytes,
    )
    dt.pending = PendingResize(transfer, dests, scalars_for(plan, header.scalars), record, None, xfer)
    if overlap != "step":
        wait_transition(engine)
    evict_groups(dt)
    return record


def enter_generation(dt, rec: GenerationRecord, timeout: float) -> bool:
    """A joiner's way into generation ``rec``'s process groups: built in the background
    (:func:`build_groups`), then made this process's default (survivors reach the same
    rendezvous). Returns True when a cached group was reused.

    Raises:
        TransitionAbortedError: as :func:`build_groups`, or the rendezvous did not complete.
    """
    dt.published_step[rec.generation] = rec.step
    build_groups(dt, rec, timeout)
    return form_generation(dt, rec.generation, rec.members, timeout, step=rec.step)


def wait_for_switch(dt, rec: GenerationRecord, timeout: float) -> None:
    """A joiner of generation ``rec``, its groups formed, waits for the survivors to switch before
    it enters the header's broadcast: they may still give the request up (a preemption at the
    boundary where all were ready). They switch once every process of the generation has its
    groups (each build bounded by ``timeout``, the last one started up to ``timeout`` after this
    one) or give the request up, so twice the timeout is a bound that a live job never reaches.

    Raises:
        TransitionAbortedError: the request was given up, or the survivors did not switch in time
            (this process's groups are detached).
    """
    membership = dt.membership
    try:
        wait_unless_given_up(
            dt,
            rec,
            lambda: membership.is_switching(rec.generation, rec.step),
            "the survivors did not switch",
            2 * timeout,
        )
    except TransitionAbortedError:
        membership.groups.detach()
        raise


def build_groups(dt, rec: GenerationRecord, timeout: float) -> None:
    """The generation's process groups, built in the background, so that a request given up (or
    the job's end) does not leave this process stuck in a rendezvous its peers never reach.

    Raises:
        TransitionAbortedError: the request was given up (also after a failed build: no second
            rendezvous in the foreground, the survivors' builds failed with this one and they give
            the request up; a standby process then waits on).
    """
    membership = dt.membership
    membership.prepare(rec.generation, rec.members, rec.step, timeout)
    wait_unless_given_up(
        dt, rec, lambda: membership.groups.ready(rec.members), "the process group was not built", timeout + 5.0
    )
    failed = membership.groups.error(rec.members)
    if failed is not None:
        wait_unless_given_up(
            dt, rec, lambda: False, f"the process group was not built ({failed}) and it was not given up", timeout
        )


def stand_by(engine, formed: int, model, basic, scheduler) -> Optional[JoinRecord]:
    """This process left at a shrink and stands by: it keeps its process groups (detached) and
    waits until a later generation takes it back (then it joins as a joiner would, reusing its
    model and optimizer objects, and this returns the join record) or the job ends (then it
    returns None and the engine stays retired)."""
    dt = engine._dt
    membership = dt.membership
    membership.groups.detach()
    membership.stop_waiting = lambda: dt.preempted
    while True:
        rec = membership.wait_recall(formed, dt.member)
        if rec is None:
            if dt.preempted:
                membership.leave_standby(dt.member)
            logger.info(
                f"member {dt.member} stops standing by: " + ("preemption notice" if dt.preempted else "the job ended")
            )
            membership.groups.close()
            return None
        logger.info(
            f"member {dt.member} taken back as rank {rec.members.index(dt.member)} of {rec.world_size} "
            f"(generation {rec.generation})"
        )
        try:
            return join_generation(
                engine,
                rec,
                model,
                basic,
                None,
                scheduler,
                [list(g["params"]) for g in basic.param_groups],
                rebuilt=True,
            )
        except TransitionAbortedError:
            if membership.is_abandoned(rec.generation, rec.step):
                formed = rec.generation - 1
                continue
            if membership.job_over():
                membership.groups.close()
                return None
            raise
