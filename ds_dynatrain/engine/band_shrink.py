"""The steps a shrink of a band layout shares (AutoTP, :mod:`.tp_resize`; pipeline,
:mod:`.pp_resize`): the next generation published, the plan agreed on every process, the state
handed over with the processes that leave, and the new generation's group formed."""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import torch.distributed as tdist

from ..errors import LayoutMismatchError
from ..zero.state import extract_partitions
from .box_state import count_transfer, kinds_of, move_state, new_partitions, new_scalars
from .members import form_generation, leave_job, request_joiners
from .records import ResizeRecord
from .switch_memory import release_switch_memory


def publish_shrink(engine, world_size: int, must_leave: Sequence[str], new_members: Tuple[str, ...]) -> int:
    """Publish the next generation, ``new_members`` (no joiner), and tell the agents it forms now;
    returns its number."""
    dt = engine._dt
    g = dt.generation + 1
    dt.assigned[(g, world_size, tuple(must_leave))] = new_members
    request_joiners(engine, world_size, tuple(must_leave))  # publishes generation g (no joiner)
    if engine.global_rank == 0:
        dt.membership.go(g)
    return g


def agree_on_plan(plan, n_processes: int, what: str) -> None:
    """Every process computed the same plan (its digest; collective).

    Raises:
        LayoutMismatchError: the processes planned ``what`` differently.
    """
    digests: List[Optional[str]] = [None] * n_processes
    tdist.all_gather_object(digests, plan.digest())
    if len(set(digests)) != 1:
        raise LayoutMismatchError(f"the processes planned the {what} differently: digests {sorted(set(digests))}")


def hand_over(engine, plan, rec: ResizeRecord) -> Optional[Tuple[list, list]]:
    """Move this process's fp32 master and Adam moments by ``plan`` (old members to new members,
    leavers included), its figures into ``rec``. Returns the new partitions and their scalars in
    a process that stays; None in one that left (its engine torn down, out of the group)."""
    dt = engine._dt
    members, new_members = plan.old_members, plan.new_members
    rank = members.index(dt.member)
    stays = dt.member in new_members
    new_rank = new_members.index(dt.member) if stays else None
    release_switch_memory(dt)  # held for another layout: not this change's
    state = extract_partitions(engine)
    dests = new_partitions(plan.new_layout, new_rank, kinds_of(state)) if stays else None
    peers = [members.index(m) for m in new_members]
    count_transfer(rec, plan, state, move_state(dt, plan, rank, state, dests, new_rank, peers))
    if not stays:
        leave_job(engine, rec)
        return None
    return dests, new_scalars(plan.old_layout, rank, plan.new_layout, new_rank, state.scalars)


def form_shrunk(engine, g: int, rec: ResizeRecord) -> None:
    """Form generation ``g`` of the plan's new members (its group the default one), the time in
    ``rec``."""
    dt = engine._dt
    t = time.perf_counter()
    new_members = dt.published[g]
    rec.group_reused = form_generation(dt, g, new_members, dt.group_timeout_s, step=dt.published_step[g])
    rec.group_s = time.perf_counter() - t
    dt.members, dt.generation = new_members, g
