"""The steps a grow of a band layout shares (AutoTP, :mod:`.tp_grow`; pipeline, :mod:`.pp_grow`):
who takes the new world's ranks (the survivors where they keep the most state, joiners at the
others); the survivors' way into the new generation (its group formed with the joiners, old rank
0's header agreed, their state sent by the plan, the engine rebuilt and the state installed); a
joiner's receipt of its state; and a joiner's record."""

from __future__ import annotations

import time
from typing import Callable, Dict, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as tdist

from ..elastic.launch_env import member_id
from ..planner.box_plan import BoxPlan, assign_box_members_best
from ..transition.boxes import BoxTransferStats, execute_box_plan
from ..zero.state import extract_partitions
from .box_state import (
    count_transfer,
    install_moved_state,
    kinds_of,
    message_bytes,
    new_partitions,
    new_scalars,
    transfer_group,
)
from .header import TransitionHeader, agree_on_header, install_header_state, make_header
from .members import evict_groups, form_generation
from .pending import publish
from .records import JoinRecord, ResizeRecord
from .resize import count_preparation
from .switch_memory import release_switch_memory

_JOINER = "\0joiner-"  # placeholder of a joiner before it is named after its rank (no id starts with NUL)


def grow_members(old, new, members: Sequence[str], generation: int) -> Tuple[str, ...]:
    """The processes of ``new``'s ranks (``old``, ``new``: the band layouts before and after, a
    :class:`~ds_dynatrain.vps.tensor_parallel.TensorParallelLayout` or a
    :class:`~ds_dynatrain.vps.pipeline.PipelineLayout`): every old member at the rank that keeps the most of its
    state in place (:func:`~ds_dynatrain.planner.box_plan.assign_box_members_best`), a joiner named
    ``member_id(generation, rank)`` at each other rank. In rank order."""
    placeholders = tuple(f"{_JOINER}{i}" for i in range(new.world_size - len(members)))
    drafted, _ = assign_box_members_best(old, new, members, placeholders)
    return tuple(member_id(generation, r) if m.startswith(_JOINER) else m for r, m in enumerate(drafted))


def move_into_new_world(
    dt, plan: BoxPlan, old: Sequence[Dict[str, torch.Tensor]], dests, kinds: Sequence[str]
) -> BoxTransferStats:
    """Move this process's rows of a grow's ``plan`` over the new generation's group (every old
    member is in it): the plan's old ranks become the ranks their processes have there. ``old``:
    this process's old partitions (empty in a joiner); ``dests``: its new ones (written)."""
    rank_in_new = {m: j for j, m in enumerate(plan.new_members)}
    table = plan.table.copy()
    table[:, 0] = np.asarray([rank_in_new[m] for m in plan.old_members], dtype=np.int64)[table[:, 0]]
    me = rank_in_new[dt.member]
    group = transfer_group()
    try:
        return execute_box_plan(table, me, list(old), dests, tuple(kinds), group, me, None, message_bytes(dt))
    finally:
        if group is not None:
            tdist.destroy_process_group(group)


def survivors_move(engine, plan: BoxPlan, g: int, rec: ResizeRecord) -> Tuple[dict, list, TransitionHeader]:
    """A survivor's side of a grow to generation ``g`` by ``plan`` (published, its joiners asked
    for): old rank 0 makes the header and tells the joiners the survivors switch; every process
    forms the new generation's group (waiting there for joiners still starting), agrees on the
    header, and sends and keeps its state by the plan. Returns ``(new partitions, their scalars,
    header)``; the group, plan and transfer figures go into ``rec``. Collective over the new world.

    Raises:
        TransitionAbortedError: the rendezvous did not complete, a process planned differently,
            or a peer failed during the transfer.
    """
    dt = engine._dt
    members, new_members = plan.old_members, plan.new_members
    state = extract_partitions(engine)
    header = make_header(engine, plan, state) if engine.global_rank == 0 else None
    step = dt.published_step[g]
    if engine.global_rank == 0:
        dt.membership.go(g)
        dt.membership.switching(g, step)  # the joiners enter the header's broadcast once formed
    t = time.perf_counter()
    rec.group_reused = form_generation(dt, g, new_members, dt.group_timeout_s, step=step)
    rec.group_s = time.perf_counter() - t
    t = time.perf_counter()
    header = agree_on_header(
        header,
        lambda h: "plan digest differs" if h.digest != plan.digest() else None,
        src=new_members.index(members[0]),
    )
    rec.plan_s += time.perf_counter() - t
    new_rank = new_members.index(dt.member)
    dests = new_partitions(plan.new_layout, new_rank, kinds_of(state))
    count_transfer(rec, plan, state, move_into_new_world(dt, plan, state.tensors, dests, tuple(state.tensors[0])))
    scalars = new_scalars(plan.old_layout, members.index(dt.member), plan.new_layout, new_rank, state.scalars)
    return dests, scalars, header


def grow_in_place(
    engine, plan: BoxPlan, g: int, rec: ResizeRecord, t0: float, rebuild: Callable[[], None], prepared=None
) -> ResizeRecord:
    """A survivor's grow to generation ``g`` by ``plan``, once it is published and its joiners
    asked for: :func:`survivors_move`, then ``rebuild()`` (the engine rebuilt at the new layout,
    which it makes the job's), the moved state and the header's installed; ``rec`` completed
    (``t0``: ``time.perf_counter()`` at the decision; ``prepared``: the request's
    :class:`~ds_dynatrain.engine.state.Preparation`, whose time behind training it counts) and
    published by old rank 0. The grow's counterpart of
    :func:`~ds_dynatrain.engine.box_state.switch_in_place`.

    Raises:
        TransitionAbortedError: as :func:`survivors_move`.
    """
    dt = engine._dt
    release_switch_memory(dt)  # held for another layout: not this change's
    dests, scalars, header = survivors_move(engine, plan, g, rec)
    t = time.perf_counter()
    dt.members, dt.generation = plan.new_members, g  # before the rebuild: its snapshot engine keys by generation
    rebuild()
    install_moved_state(engine, dests, scalars)
    install_header_state(engine, header, None, joiner=False)
    evict_groups(dt)
    rec.rebuild_s = time.perf_counter() - t
    rec.seconds = time.perf_counter() - t0
    if prepared is not None:
        count_preparation(rec, prepared, t0)
    publish(engine, rec, first=plan.old_members[0])
    return rec


def joiner_receives(dt, plan: BoxPlan, header: TransitionHeader) -> Tuple[dict, list, BoxTransferStats]:
    """A joiner's side of the transfer of a grow by ``plan``: its new partitions (of the header's
    kinds and dtype), received over the new generation's group, and their scalars (every
    partition of old rank 0 steps with all others: its scalars are every rank's). Returns
    ``(partitions, scalars, transfer figures)``.

    Raises:
        TransitionAbortedError: a peer failed during the transfer.
    """
    new_rank = plan.new_members.index(dt.member)
    kinds = {k: getattr(torch, header.dtype) for k in header.kinds}
    dests = new_partitions(plan.new_layout, new_rank, kinds)
    stats = move_into_new_world(dt, plan, (), dests, tuple(kinds))
    return dests, new_scalars(plan.old_layout, 0, plan.new_layout, new_rank, header.scalars), stats


def publish_join(engine, generation: int, reused: bool, t0: float, stats: BoxTransferStats) -> JoinRecord:
    """A joiner's record of joining ``generation`` (``t0``: ``time.perf_counter()`` when it began;
    ``stats``: its transfer), kept and returned."""
    dt = engine._dt
    record = JoinRecord(
        step=engine.global_steps,
        generation=generation,
        group_reused=reused,
        seconds=time.perf_counter() - t0,
        warmup_s=dt.warmup_s,
    )
    record.transfer_s, record.messages = stats.exchange_seconds, stats.messages
    record.bytes_received, record.peak_staging_bytes = stats.bytes_received, stats.peak_staging_bytes
    publish(engine, record)
    return record
