"""A resize, phase by phase, at one step boundary on every member of the current generation
(DESIGN.md "Hot switch").

1. **plan**: the members of the new generation (:func:`~ds_dynatrain.engine.members.request_joiners`),
   the planner's intersection of the old and new :class:`~ds_dynatrain.vps.layout.ZeroLayout`,
   this rank's partitions; ZeRO-3 gathers the working parameters whole on the old group;
2. **agree**: a grow forms the new generation's group first (joiners started ahead by the agent);
   old rank 0 broadcasts the header and every process checks it before any byte moves;
3. **transfer**: the master partitions (bf16/fp16) and then, in a background thread, the moments
   move over a private gloo group of the old members and the joiners;
4. **leave** (a process not in the new world): hand everything over, then exit or stand by;
5. **rebuild** (a survivor): a shrink forms the new group now; ``DeepSpeedEngine.__init__`` runs again
   on the same object under :func:`~ds_dynatrain.zero.rebuild.light_rebuild`, and the header's state
   is installed; the moments follow (``transfer_overlap``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as tdist

from ..batch import BatchSplit
from ..elastic.keys import LEFT_KEY
from ..log import logger
from ..planner.plan import Plan, plan_transition, scalars_for
from ..transition.buffers import reused_bytes
from ..zero.geometry import is_zero3, layout_of, zero_optimizer_of
from ..zero.rebuild import teardown
from ..zero.state import PartitionState, extract_partitions, moment_kinds
from ..zero.zero3 import gather_whole_params, release_zero3_params
from .construct import close_snapshots, construct, ds_config_for, keep_returned_optimizer
from .header import TransitionHeader, agree_on_header, install_header_state, make_header
from .join import stand_by
from .members import evict_groups, form_generation, request_joiners
from .pending import complete_pending, publish, start_peak_rss
from .records import Record, ResizeRecord
from .recover import InResize, fall_back_if_dead, is_peer_failure, recover
from .replicas import close_replicas
from .state import PendingResize, Preparation
from .switch_memory import record_key, release_switch_memory
from .transfer import begin_transition, post_params


@dataclass
class _Resize:
    """One resize in progress on this process (what the phases hand on)."""

    world_size: int
    split: BatchSplit
    must_leave: Tuple[str, ...]
    prepared: Optional[Preparation]
    t0: float
    rss_base: Optional[int]
    grow: bool
    generation: int
    plan: Plan = None
    state: PartitionState = None
    whole: Optional[Dict[str, torch.Tensor]] = None  # ZeRO-3: the working parameters gathered whole
    header: Optional[TransitionHeader] = None
    stays: bool = True
    record: ResizeRecord = None
    dests: Any = None
    transfer: Any = None
    overlap: str = "rebuild"
    xfer: Any = None
    transfer_t0: float = 0.0  # time.perf_counter() when the transfer began


def resize(
    engine, world_size: int, split: BatchSplit, must_leave: Tuple[str, ...] = (), prepared: Optional[Preparation] = None
) -> Optional[Record]:
    """Change the world size of ``engine`` now (collective over the current generation).

    Returns the resize record on members of the new generation, the join record on a process that
    stood by and was taken back by a later resize, None in a process that left. With peer replicas,
    a member that dies during a shrink before the switch is recovered from: the recovery record
    (:func:`~ds_dynatrain.engine.recover.recover` with :class:`~ds_dynatrain.engine.recover.InResize`).

    Raises:
        LayoutMismatchError, TransitionAbortedError: the ranks disagreed or a peer failed (and no
            in-place recovery took it over).
    """
    # the old generation's replicas are kept until the next one refreshes its own: a death during
    # this resize is recovered from them (recover.InResize)
    r = None
    try:
        r = _plan(engine, world_size, split, must_leave, prepared)
        _agree(engine, r)
        _start_transfer(engine, r)
        if not r.stays:
            return _leave(engine, r)
        _rebuild(engine, r)
        return _finish(engine, r)
    except RuntimeError as err:
        dt = engine._dt
        dt.params_posted = None  # a grow's parameter messages posted ahead are this resize's only
        rs = dt.replicas
        old_generation = r is not None and dt.generation == r.generation - 1  # not switched yet
        if not (is_peer_failure(err) and old_generation and rs is not None and rs.generation == dt.generation):
            fall_back_if_dead(engine, err)  # a member died: the restart from the snapshot (peer replicas on)
            raise
        return recover(engine, err, InResize(r.plan.old_layout, r.world_size, r.must_leave, r.grow))


def _plan(
    engine, world_size: int, split: BatchSplit, must_leave: Tuple[str, ...], prepared: Optional[Preparation]
) -> _Resize:
    dt = engine._dt
    t0 = time.perf_counter()
    r = _Resize(
        world_size,
        split,
        must_leave,
        prepared,
        t0,
        start_peak_rss(),
        world_size > engine.dp_world_size,
        dt.generation + 1,
    )
    new_members = request_joiners(engine, world_size, must_leave)
    old_layout = layout_of(engine)
    r.plan = plan_transition(old_layout, old_layout.with_world_size(world_size), dt.members, new_members)
    r.state = extract_partitions(engine)
    # ZeRO-3: the working parameters are partitioned too; every old rank takes part in gathering
    # them whole on the old group (before a grow re-forms it), and the rebuild partitions them
    # for the new world
    if is_zero3(zero_optimizer_of(engine)):
        r.whole = gather_whole_params(engine.module)
    if engine.global_rank == 0:
        r.header = make_header(engine, r.plan, r.state, must_leave)
        dt.membership.go(r.generation)  # every formed generation has it: standby processes follow them
    r.stays = dt.member in r.plan.new_members
    r.record = ResizeRecord(
        step=engine.global_steps,
        from_world_size=engine.dp_world_size,
        to_world_size=world_size,
        generation=r.generation,
        plan_s=time.perf_counter() - t0,
    )
    return r


def _agree(engine, r: _Resize) -> None:
    dt, plan, clock = engine._dt, r.plan, time.perf_counter
    if r.grow:
        # the new generation's group carries the header; the old engine stays as it is (its
        # groups detached) until the plan is agreed
        t = clock()
        if engine.global_rank == 0:
            dt.membership.switching(r.generation, dt.published_step[r.generation])  # joiners may wait for it now
        r.record.group_reused = form_generation(
            dt, r.generation, plan.new_members, dt.group_timeout_s, step=dt.published_step[r.generation]
        )
        r.record.group_s += clock() - t
    t = clock()
    # a grow agrees on the new group, where old rank 0 (a survivor) may hold another rank
    src = plan.new_members.index(plan.old_members[0]) if r.grow else 0
    r.header = agree_on_header(
        r.header, lambda h: "plan digest differs" if h.digest != plan.digest() else None, src=src
    )
    r.record.plan_s += clock() - t
    t = clock()
    r.xfer = r.prepared.xfer.get(dt.group_timeout_s) if r.prepared is not None else None
    r.record.xfer_group_s = clock() - t


def _start_transfer(engine, r: _Resize) -> None:
    dt, plan, header = engine._dt, r.plan, r.header
    # held for this resize (one for another world size too): its partition tensors become the new
    # partitions, written ahead; the rest is freed here, before the new engine allocates
    held = release_switch_memory(dt, r.record, key=record_key(r.record))
    r.transfer_t0 = time.perf_counter()
    r.dests, stats, r.transfer, r.overlap, r.xfer = begin_transition(
        plan, dt, r.generation, header, r.state.tensors, r.stays, r.xfer, held
    )
    r.record.partitions_held_bytes = reused_bytes(r.dests, held) if r.dests is not None else 0
    del held
    if r.grow and r.stays:
        post_params(dt, plan, engine.module)
    elsize = r.state.tensors[0]["fp32"].element_size()
    moved_kinds = len(header.kinds) if header.master_moves else len(moment_kinds(header.kinds))
    rec = r.record
    rec.bytes_moved = plan.numel_moved * elsize * moved_kinds
    rec.bytes_kept = plan.numel_kept * elsize * moved_kinds
    rec.transfer_s, rec.keep_s = stats.exchange_seconds, stats.keep_seconds
    rec.transfer_overlap = r.overlap
    rec.peak_staging_bytes, rec.messages = stats.peak_staging_bytes, stats.messages
    rec.bytes_sent, rec.bytes_received = stats.bytes_sent, stats.bytes_received
    if not r.stays and dt.config.leaver_nice:
        # the rest of a leaver's life (teardown, then an interpreter exit with torch loaded:
        # about 0.5 s of CPU) must not slow the survivors' rebuild and first steps where they
        # share the host. Linux sets the nice value per thread: this one only, not the threads
        # still sending the leaver's partitions.
        os.nice(dt.config.leaver_nice)


def _leave(engine, r: _Resize) -> Optional[Record]:
    """This process is not in the new world: it hands everything over, then exits the job or
    (``standby``, not preempted) stands by."""
    dt = engine._dt
    basic, scheduler, model = engine.optimizer.optimizer, engine.lr_scheduler, engine.module
    close_snapshots(engine)
    teardown(engine)
    standby = dt.config.standby and dt.member not in r.must_leave and not dt.preempted
    dt.retired = True
    dt.pending = PendingResize(r.transfer, None, [], r.record, r.rss_base, r.xfer)
    complete_pending(engine)  # a leaver hands everything over before it goes
    if dt.replicas is not None:  # its copies go with it: a recovery of this resize takes its replicas
        close_replicas(dt)
        dt.membership.store.set(LEFT_KEY.format(dt.generation, dt.member), "1")
    logger.info(
        f"member {dt.member} left the job after step {engine.global_steps} "
        f"({r.record.bytes_sent / 2**20:.2f} MiB handed over)" + ("; it stands by" if standby else "")
    )
    if not standby:
        if tdist.is_initialized():
            tdist.destroy_process_group()
        return None
    if r.whole is not None:
        release_zero3_params(model, r.whole, dt.param_attrs)
    return stand_by(engine, r.generation, model, basic, scheduler)


def _rebuild(engine, r: _Resize) -> None:
    """This process stays: rebuild the engine in place on the new world and install the state."""
    dt, plan, clock = engine._dt, r.plan, time.perf_counter
    basic, scheduler, model = engine.optimizer.optimizer, engine.lr_scheduler, engine.module
    zopt = zero_optimizer_of(engine)
    old_flat = () if is_zero3(zopt) else tuple(zopt.bit16_groups_flat)
    t = clock()
    close_snapshots(engine)
    teardown(engine)
    if r.whole is not None:
        release_zero3_params(model, r.whole, dt.param_attrs)
        r.whole = None
    rebuild_s = clock() - t
    if not r.grow:
        t = clock()
        r.record.group_reused = form_generation(
            dt, r.generation, plan.new_members, dt.group_timeout_s, step=dt.published_step[r.generation]
        )
        r.record.group_s += clock() - t
    t = clock()
    dt.members = plan.new_members
    dt.generation += 1  # before construct: the new snapshot engine keys the store by generation
    dt.rebuild_broadcast = plan.survivor_ranks if r.grow else "none"
    dt.params_spread = None
    construct(
        engine,
        dt,
        model,
        basic,
        None,
        scheduler,
        ds_config_for(dt, r.split, client_objects=True),
        light=True,
        reuse_flat=old_flat,
    )
    old_flat = None
    if dt.params_spread is not None:  # a grow: the joiners' working parameters, beside the moments
        r.record.params_bytes, end = dt.params_spread
        r.record.params_s = end - r.transfer_t0
        dt.params_spread = None
    keep_returned_optimizer(engine)
    install_header_state(engine, r.header, r.dests, joiner=False)
    r.record.rebuild_s = rebuild_s + clock() - t
    dt.pending = PendingResize(r.transfer, r.dests, scalars_for(plan, r.header.scalars), r.record, r.rss_base, r.xfer)


def count_preparation(rec: ResizeRecord, prepared: Preparation, t0: float) -> None:
    """Put into ``rec`` (a resize that switched at ``t0``, ``time.perf_counter()``) how much of the
    new world's construction (joiners' start-up, group rendezvous) ran behind training: from the
    request to ``prepared.ready_at``; what is left at the switch is ``group_s + xfer_group_s``."""
    built = (prepared.ready_at or t0) - prepared.started
    rec.request, rec.prepare_s, rec.background_build_s = prepared.index, t0 - prepared.started, built
    rec.hidden_fraction = built / max(built + rec.group_s + rec.xfer_group_s, 1e-9)


def _finish(engine, r: _Resize) -> ResizeRecord:
    dt, rec = engine._dt, r.record
    if r.prepared is not None:
        count_preparation(rec, r.prepared, r.t0)
    evict_groups(dt)
    r.state = None  # the old partitions go as soon as the transfer is done with them
    if r.overlap != "step" or r.transfer.done():
        complete_pending(engine)
    rec.seconds = time.perf_counter() - r.t0
    if dt.pending is None:
        publish(engine, rec)  # else wait_transition publishes it
    return rec
