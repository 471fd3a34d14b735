"""The next generation from the engine's side: who its members are, publishing it and having its
joiners started, switching this process into it (group, launch environment, DeepSpeed comm), or
leaving the job."""

from __future__ import annotations

from typing import Sequence, Tuple

from ..elastic.launch_env import enter_generation, member_id
from ..elastic.membership import GenerationRecord
from ..elastic.placement import place_joiners
from ..errors import ResizeRefusedError
from ..log import logger
from ..planner.assignment import next_members
from ..zero.comm import start_deepspeed_comm
from ..zero.geometry import layout_of
from .state import ElasticState


def request_joiners(engine, world_size: int, must_leave: Tuple[str, ...] = ()) -> Tuple[str, ...]:
    """Publish the next generation for ``world_size`` and have its joiners started (once).

    The members are :func:`~ds_dynatrain.planner.assignment.next_members`: a recent generation's
    (its process groups are cached: 4 -> 2 -> 4 reuses the groups of the first 4), else the
    planner's best assignment, standby processes before new joiners (a new joiner is named after
    the rank it takes). If joiners were already started for the next generation with another
    membership (a scheduled grow, then a manual resize to another size), they are cancelled first.
    Returns the members in rank order.
    """
    dt = engine._dt
    g = dt.generation + 1
    new_members = dt.assigned.get((g, world_size, must_leave)) or planned_members(engine, world_size, must_leave)
    dt.assigned[(g, world_size, must_leave)] = new_members
    joiners = tuple(m for m in new_members if m not in set(dt.members) and m not in dt.standby)
    if dt.published.get(g) == new_members:
        return new_members
    if engine.global_rank == 0:
        _publish_generation(dt, g, world_size, new_members, joiners, engine.global_steps)
    dt.spawned_for[g] = joiners
    dt.published[g] = new_members
    dt.published_step[g] = engine.global_steps
    return new_members


def planned_members(engine, world_size: int, must_leave: Tuple[str, ...] = ()) -> Tuple[str, ...]:
    """The members, in rank order, that :func:`request_joiners` would publish for a change to
    ``world_size`` ranks now (:func:`~ds_dynatrain.planner.assignment.next_members`; a new joiner
    named after the rank it takes). Pure: nothing is published or remembered. Not collective: every
    rank computes the same members from the same state."""
    dt = engine._dt
    g = dt.generation + 1
    return next_members(
        layout_of(engine),
        dt.members,
        dt.standby,
        dt.history,
        world_size,
        must_leave,
        joiner_name=lambda r: member_id(g, r),
    )


def _publish_generation(
    dt: ElasticState, g: int, world_size: int, members: Tuple[str, ...], joiners: Tuple[str, ...], step: int
) -> None:
    """Rank 0: cancel joiners started for another membership of ``g``, publish ``g``, and ask the
    agents for its joiners (on the node a ``dynatrain join`` named, else by free slots)."""
    stale = dt.spawned_for.get(g, ())
    if stale:
        dt.membership.cancel_spawn(g, stale)
    header_rank = members.index(dt.members[0]) if dt.members[0] in members else 0
    dt.membership.publish(GenerationRecord(g, world_size, members, step, header_rank, tuple(dt.members)))
    if not joiners:
        return
    join = dt.join_node
    if join is not None and join[0] == dt.requests_seen - 1:
        nodes = {j: join[1] for j in joiners}
    else:
        staying = tuple(members) + tuple(dt.standby)
        try:
            nodes = place_joiners(dt.membership.store, staying, joiners)
        except ResizeRefusedError as err:
            # requests were checked when rank 0 read them and the schedule at launch: a host lost
            # since (or hosts unlike node 0) gets here, and an engine.resize, which no rank checks
            # first; the ranks are past the decision
            logger.warning(f"generation {g}: {err}; its joiners start on the least loaded hosts")
            nodes = place_joiners(dt.membership.store, staying, joiners, force=True)
    dt.membership.request_spawn(g, world_size, [members.index(j) for j in joiners], joiners, nodes)


def form_generation(dt: ElasticState, generation: int, members: Sequence[str], timeout_s: float, step: int = 0) -> bool:
    """Switch this process into ``generation`` (``members`` in rank order, published at ``step``):
    its default process group (cached, built in the background, or built now), the launch
    environment DeepSpeed reads, and DeepSpeed's comm on the new group. Returns True when a cached
    group was reused.

    Raises:
        TransitionAbortedError: the rendezvous did not complete within ``timeout_s``.
    """
    reused = dt.membership.form(generation, members, timeout_s, step=step)
    enter_generation(list(members).index(dt.member), len(members), dt.membership.ctx.local_rank)
    start_deepspeed_comm(dt.backend)
    return reused


def reports(dt: ElasticState, first: str) -> bool:
    """Whether this process answers a request and writes the record of a change that the process
    ``first`` (old rank 0) took part in: ``first`` where it stays in the job, else new rank 0 (a
    grow may give rank 0 to a joiner, which read no request and has no resize record)."""
    return not dt.retired and dt.member == (first if first in dt.members else dt.members[0])


def evict_groups(dt: ElasticState) -> None:
    """Shut down cached groups with a member that is neither in the job nor standing by."""
    alive = set(dt.members) | set(dt.standby)
    dt.membership.groups.evict(lambda members: set(members) <= alive)


def leave_job(engine, rec) -> None:
    """This process is not in the new world (a shrink's ``rec``, a resize record): it has handed
    its partitions over; it tears its engine down and leaves the process group (its script sees
    ``engine.is_member`` False)."""
    import torch.distributed as tdist

    from ..zero.rebuild import teardown

    dt = engine._dt
    teardown(engine)
    dt.retired = True
    logger.info(
        f"member {dt.member} left the job after step {engine.global_steps} "
        f"({rec.bytes_sent / 2**20:.2f} MiB handed over)"
    )
    if tdist.is_initialized():
        tdist.destroy_process_group()
