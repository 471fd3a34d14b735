"""In-place recovery: a worker died without notice, the survivors go on without a restart
(DESIGN.md "Recovery in place"; ``recovery.peer_replicas``).

A collective of the training group fails on every survivor within moments of the death (gloo
closes the dead peer's connections). On each survivor, in order:

1. **detect**: the running replica refresh ends; the survivor posts its *offer* (the steps of its
   complete own copies and of the replica it holds) and waits until every member of the
   generation has either posted one or been reported dead by its agent (``dynatrain/dead/<m>``).
   No member reported dead: the failure was not a death, the original error is raised.
2. **agree**: every survivor computes the same recovery step from the offers
   (:func:`~ds_dynatrain.planner.recovery.recovery_step`): the newest step of which every
   survivor has its own copy and every dead member's holder a complete replica. The new world is
   the largest the survivors serve; its members and the plan come from the planner as for a
   shrink that the dead members must leave.
3. **transfer**: over a private gloo group of the survivors, the live ranks' transfers from their
   own copies, then the dead ranks' from their holders' replicas
   (:func:`~ds_dynatrain.planner.recovery.split_recovery_plan`).
4. **rebuild**: the new default group, ``DeepSpeedEngine.__init__`` again on the same object, the
   copy's state installed (:func:`~ds_dynatrain.engine.replicas.install_copy`).

The failed step is abandoned: its gradients are dropped with the old engine, the copies are of the
step before (nothing half-updated survives), and the returned loader serves that step's samples
again. A death inside a shrink, before the new generation forms, is recovered the same way from the
old generation's copies (:class:`InResize`; a leaver that already left is served by its holder's
replica). When the copies cannot serve (a dead member's holder died too, no replica yet, a grow or
a resize past its switch in flight) the survivors mark a fallback with the reason, and the dead
worker's agent restarts the job from its latest snapshot (:mod:`~ds_dynatrain.elastic.agent`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as tdist
import torch.utils._pytree as pytree
from deepspeed.accelerator import get_accelerator

from io_engine import BadLatestError, read_latest

from ..batch import largest_world_size
from ..elastic.keys import (
    DEAD_KEY,
    FALLBACK_KEY,
    LEFT_KEY,
    OFFER_KEY,
    RECOVERED_KEY,
    SNAPSHOT_SEEN_KEY,
    group_prefix,
)
from ..errors import DynatrainError, TransitionAbortedError
from ..log import logger
from ..planner.assignment import next_members
from ..planner.plan import plan_transition
from ..planner.recovery import Offer, RecoveryNotPossibleError, recovery_step, split_recovery_plan
from ..transition.buffers import allocate_partitions
from ..transition.execute import execute_plan, transition_group
from ..zero.geometry import layout_of
from .broken import Kept, collect, release
from .construct import construct, ds_config_for, keep_returned_optimizer
from .members import evict_groups, form_generation
from .records import RecoveryRecord
from .replicas import close_replicas, install_copy, replicas_enabled

POLL_S = 0.02
SLOW_PEER_S = 0.2  # a member silent this long after our release: collect the garbage once (broken.collect)
# what torch's and gloo's errors say when a peer is gone or silent
PEER_FAILURE_WORDS = ("connection", "closed by peer", "reset by peer", "broken pipe", "timed out", "timeout", "gloo")


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failed collective or transfer: a ``TransitionAbortedError``, or a
    ``RuntimeError`` of torch or gloo naming a connection or a timeout (none of ours)."""
    if isinstance(err, TransitionAbortedError):
        return True
    if not isinstance(err, RuntimeError) or isinstance(err, DynatrainError):
        return False
    text = str(err).lower()
    return isinstance(err, tdist.DistError) or any(w in text for w in PEER_FAILURE_WORDS)


def handles(engine, err: BaseException) -> bool:
    """Whether ``err``, raised by ``backward``/``step``, is for the recovery: replicas are on and
    it is a failure of a collective (a ``RuntimeError`` of torch or gloo naming a connection or a
    timeout, or of a replica refresh), none of ours."""
    dt = getattr(engine, "_dt", None)
    if dt is None or dt.retired or dt.config.recovery.peer_replicas == 0 or dt.membership is None:
        return False
    return not isinstance(err, DynatrainError) and is_peer_failure(err)


@dataclass(frozen=True)
class InResize:
    """The resize a death interrupted (:func:`recover` from inside
    :func:`~ds_dynatrain.engine.resize.resize`): the old generation's layout, the size it went to
    and the members it sent away. The recovery starts from the old generation's copies, removes
    the dead and these members, and goes to at most ``world_size`` ranks."""

    layout: Any
    world_size: int
    must_leave: Tuple[str, ...]
    grow: bool


def recover(engine, err: BaseException, resize: Optional[InResize] = None) -> Optional[RecoveryRecord]:
    """Recover this survivor in place after ``err`` (see the module). Returns the record on the
    members of the new world, None in a survivor the smaller world leaves out. ``resize``: the
    failure came inside a resize (the engine may be detached already).

    Raises:
        ``err`` itself: no member was reported dead (the failure was not a death; the engine
            cannot train on).
        TransitionAbortedError: the recovery could not proceed and nobody ended this process after
            it asked for the fallback.
    """
    dt = engine._dt
    cfg = dt.config.recovery
    t0 = time.perf_counter()
    failed_step, from_world = engine.global_steps, engine.dp_world_size
    logger.warning(
        f"member {dt.member}: a collective failed at step {failed_step} ({_first_line(err)}); recovering in place"
    )
    if resize is None:
        why = _cannot_recover(engine)
        layout = layout_of(engine) if why is None else None
    else:
        why = "a grow was in flight (its joiners hold no copies)" if resize.grow else None
        layout = resize.layout
    t = time.perf_counter()
    kept = release(engine, err)  # peers waiting on this rank fail now too
    release_s = time.perf_counter() - t
    rs = dt.replicas
    if rs is not None:
        rs.settle(cfg.timeout_s)
    usable = rs is not None and rs.generation == dt.generation
    mine = rs.offer() if usable else Offer(dt.member, ())
    store = dt.membership.store
    store.set(OFFER_KEY.format(dt.generation, dt.member), json.dumps(mine.to_dict()))
    offers, dead, left, missing = _collect(dt, cfg.timeout_s)
    if not dead:
        raise err  # nobody died: not ours to handle
    detect_s = time.perf_counter() - t0
    try:
        if missing:
            raise RecoveryNotPossibleError(
                f"{missing} neither answered nor were reported dead within {cfg.timeout_s:.0f} s"
            )
        if why:
            raise RecoveryNotPossibleError(why)
        step, served = recovery_step(offers, dead + left)
        snap = _agreed_snapshot_step(dt)
        if snap is not None and snap > step:
            raise RecoveryNotPossibleError(
                f"the replicas (step {step}) are older than the latest snapshot (step {snap})"
            )
        rec = RecoveryRecord(
            dead=list(dead),
            step=step,
            failed_step=failed_step,
            steps_lost=failed_step - step,
            from_world_size=from_world,
            generation=dt.generation + 1,
            served_by=dict(served),
        )
        stays = _recover_at(engine, kept, layout, offers, dead + left, rec, resize)
    except (RecoveryNotPossibleError, RuntimeError) as problem:
        _fall_back(dt, dead, str(problem))
    if not stays:
        return None
    rec.detect_s, rec.release_s = detect_s, release_s
    rec.seconds = time.perf_counter() - t0
    if engine.global_rank == 0:
        for d in dead:
            store.set(RECOVERED_KEY.format(d), json.dumps(rec.to_dict()))
        dt.metrics.write(rec)
        logger.info(format_recovery(rec))
    return rec


def fall_back_if_dead(engine, err: BaseException) -> None:
    """A resize's transfer or group failed with ``err``: where replicas are on and a member of the
    generation was reported dead, this survivor asks for the restart from the snapshot and waits
    to be ended (:func:`_fall_back`) instead of exiting, so that its agent restarts the job on the
    live workers. Returns (the caller raises ``err``) otherwise.

    Raises:
        TransitionAbortedError: after the fallback, nobody ended this process in time.
    """
    dt = getattr(engine, "_dt", None)
    if dt is None or dt.config.recovery.peer_replicas == 0 or dt.membership is None:
        return
    if not isinstance(err, TransitionAbortedError):
        return
    store = dt.membership.store
    dead = [m for m in dt.members if store.check([DEAD_KEY.format(m)])]
    if dead:
        _fall_back(dt, dead, f"a resize was in flight ({_first_line(err)})")


def _cannot_recover(engine) -> Optional[str]:
    dt = engine._dt
    if not replicas_enabled(engine):
        return "no replicas are kept (a job of one rank)"
    if dt.pending is not None or dt.preparing is not None:
        return "a resize was in flight"
    if dt.frontend is not None:
        return f"the {dt.frontend} front-end's loop cannot go back a step in place"
    return None


def _collect(dt, timeout_s: float) -> Tuple[List[Offer], List[str], List[str], List[str]]:
    """Wait until every member has posted an offer, was reported dead or left in a resize
    (:data:`~ds_dynatrain.elastic.keys.LEFT_KEY`), at most ``timeout_s``. Returns the offers (in
    rank order), the dead members, those that left and those that did none of these."""
    store, g = dt.membership.store, dt.generation
    start = time.monotonic()
    deadline, collected = start + timeout_s, False
    offers: Dict[str, Offer] = {}
    gone: Dict[str, str] = {}
    while True:
        if not collected and time.monotonic() - start > SLOW_PEER_S:
            collect()  # a peer may be waiting on a group of ours that only a reference cycle keeps
            collected = True
        for m in dt.members:
            if m in offers or m in gone:
                continue
            if store.check([DEAD_KEY.format(m)]):
                gone[m] = "dead"
            elif store.check([OFFER_KEY.format(g, m)]):
                offers[m] = Offer.from_dict(json.loads(store.get(OFFER_KEY.format(g, m))))
            elif store.check([LEFT_KEY.format(g, m)]):
                gone[m] = "left"
        missing = [m for m in dt.members if m not in offers and m not in gone]
        if not missing or time.monotonic() > deadline:
            ranked = [offers[m] for m in dt.members if m in offers]
            dead = [m for m in dt.members if gone.get(m) == "dead"]
            return ranked, dead, [m for m in dt.members if gone.get(m) == "left"], missing
        time.sleep(POLL_S)


def _recover_at(
    engine, kept: Kept, layout, offers: List[Offer], gone: List[str], rec: RecoveryRecord, resize: Optional[InResize]
) -> bool:
    """Phases 2 to 4 on this survivor; fills ``rec``. ``gone``: the members whose partitions come
    from replicas (dead, or left in the interrupted resize). False when the smaller world leaves
    this survivor out."""
    dt = engine._dt
    timeout, step, served = dt.config.recovery.timeout_s, rec.step, rec.served_by
    clock = time.perf_counter
    t = clock()
    survivors = tuple(o.member for o in offers)
    must_leave = tuple(gone) + (() if resize is None else tuple(m for m in resize.must_leave if m not in gone))
    stay_at_most = len([m for m in survivors if m not in must_leave])
    if resize is not None:
        stay_at_most = min(stay_at_most, resize.world_size)  # the interrupted resize's target at most
    world = largest_world_size(dt.global_batch, dt.micro_batch, stay_at_most, dt.config.max_world_size)
    if world == 0:
        raise RecoveryNotPossibleError(f"no world size of at most {stay_at_most} ranks keeps the global batch")
    rec.to_world_size = world
    new_members = next_members(
        layout, dt.members, (), dt.history, world, must_leave, joiner_name=lambda r: f"~unused{r}"
    )
    plan = plan_transition(layout, layout.with_world_size(world), dt.members, new_members)
    live, from_replicas = split_recovery_plan(plan, served)
    rs = dt.replicas
    own, meta = rs.own_at(step)
    rec.plan_s = clock() - t
    t = clock()
    prefix = group_prefix(dt.generation + 1, survivors, step, kind="recover")
    group = transition_group(dt.membership.new_client(), prefix, survivors, dt.member, timeout)
    rec.group_s = clock() - t
    t = clock()
    stays = dt.member in new_members
    dests = allocate_partitions(plan, dt.member, rs.kinds, own[0]["fp32"].dtype, "cpu") if stays else None
    run = dict(timeout_s=timeout, max_inflight_bytes=dt.config.max_inflight_bytes, ranks=survivors)
    try:
        a = execute_plan(live, dt.member, group, rs.kinds, own, dests, **run)
        held = rs.replica_at(step) if dt.member in served.values() else None
        b = execute_plan(from_replicas, dt.member, group, rs.kinds, held, dests, **run)
    finally:
        group.shutdown()
    rec.bytes_received = a.bytes_received + b.bytes_received
    rec.transfer_s = clock() - t
    close_replicas(dt)
    if not stays:
        dt.retired = True
        logger.info(f"member {dt.member} left the job at the recovery to step {step} (the smaller world needs no more)")
        return False
    t = clock()
    form_generation(dt, dt.generation + 1, new_members, timeout, step=step)
    rec.group_s += clock() - t
    t = clock()
    dt.members = new_members
    dt.generation += 1
    dt.history = (dt.history + [tuple(new_members)])[-8:]
    dt.rebuild_broadcast = "none"  # the working parameters come from the recovered master
    cfg = ds_config_for(dt, dt.split(world), client_objects=True)
    construct(engine, dt, kept.model, kept.optimizer, None, kept.lr_scheduler, cfg, light=True, reuse_flat=kept.flat)
    keep_returned_optimizer(engine)
    evict_groups(dt)
    device = get_accelerator().current_device_name()
    install_copy(engine, {g: {k: v.to(device) for k, v in p.items()} for g, p in dests.items()}, meta)
    rec.rebuild_s = clock() - t
    dt.loss_sum, dt.loss_count, dt.step_t0 = 0.0, 0, None
    return True


def _fall_back(dt, dead: List[str], reason: str) -> None:
    """Ask the dead members' agents to restart the job from its snapshot, and wait to be ended.

    Raises:
        TransitionAbortedError: nobody ended this process within twice the recovery timeout.
    """
    logger.warning(f"member {dt.member}: in-place recovery from {', '.join(dead)} is not possible: {reason}")
    store = dt.membership.store
    for d in dead:
        store.set(FALLBACK_KEY.format(d), json.dumps({"reason": reason}))
    time.sleep(2 * dt.config.recovery.timeout_s)
    raise TransitionAbortedError(
        f"in-place recovery from {', '.join(dead)} was not possible ({reason}) and no restart came"
    )


def format_recovery(r: RecoveryRecord) -> str:
    """The console line of a recovery."""
    return (
        f"recovered from the death of {', '.join(r.dead)}: back to step {r.step} ({r.steps_lost} steps lost), "
        f"world {r.from_world_size} \u2192 {r.to_world_size}, {r.seconds:.2f} s (detect {r.detect_s:.2f} s, "
        f"plan {r.plan_s:.2f} s, group {r.group_s:.2f} s, transfer {r.transfer_s:.3f} s, rebuild {r.rebuild_s:.2f} s)"
    )


def output_template(out: Any) -> Tuple[Any, List[Any]]:
    """The structure of a forward's output (a ``torch.utils._pytree`` spec: tensors, tuples, dicts,
    Hugging Face ``ModelOutput``) and, per leaf, ``(shape, dtype)`` for a tensor or the value
    itself; no tensor is kept."""
    leaves, spec = pytree.tree_flatten(out)
    return spec, [_TensorLeaf(tuple(x.shape), x.dtype) if torch.is_tensor(x) else x for x in leaves]


@dataclass(frozen=True)
class _TensorLeaf:
    shape: Tuple[int, ...]
    dtype: Any


def abandoned_output(template: Optional[Tuple[Any, List[Any]]]) -> Any:
    """What ``forward`` returns for a step abandoned inside it: the last output's structure
    (:func:`output_template`) with NaN floating-point tensors (zeros of other dtypes), on the
    accelerator; a NaN scalar where no forward completed before."""
    device = get_accelerator().current_device_name()
    if template is None:
        return torch.full((), float("nan"), device=device)
    spec, leaves = template
    out = []
    for leaf in leaves:
        if isinstance(leaf, _TensorLeaf):
            fill = float("nan") if leaf.dtype.is_floating_point else 0
            out.append(torch.full(leaf.shape, fill, dtype=leaf.dtype, device=device))
        else:
            out.append(leaf)
    return pytree.tree_unflatten(out, spec)


def _agreed_snapshot_step(dt) -> Optional[int]:
    """:func:`_latest_snapshot_step` as the first survivor to ask read it (the store's
    compare-and-set): a snapshot whose ranks had all written before the death may still commit
    during the recovery, and every survivor must decide alike."""
    key = SNAPSHOT_SEEN_KEY.format(dt.generation)
    store = dt.membership.store
    store.compare_set(key, "", json.dumps(_latest_snapshot_step(dt)))
    return json.loads(store.get(key))


def _latest_snapshot_step(dt) -> Optional[int]:
    """The step of the snapshot the agents would restart from (``latest`` of the snapshot
    directory, where ``snapshot.restore_on_failure`` is on); None without one."""
    snap = dt.config.snapshot
    if not (snap.interval_steps and snap.restore_on_failure and snap.dir):
        return None
    try:
        tag = read_latest(snap.dir)
    except BadLatestError:
        return None  # the restore tries the older snapshots: nothing newer than the replicas to prefer
    match = re.fullmatch(r"global_step(\d+)", tag or "")
    return int(match.group(1)) if match else None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"
