"""The optimizer state of a change of band layout (AutoTP or pipeline, with ZeRO), shared by every
such change: this rank's new partitions, their scalars, the box transfer between the two, its
figures in the resize record, the install into the rebuilt engine, and the switch over the same
processes that strings them together."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as tdist

from ..planner.box_plan import band_scalars
from ..transition.boxes import execute_box_plan
from ..zero.state import MASTER, extract_partitions, install_master, install_optimizer_state, working_from_master
from .pending import publish
from .records import ResizeRecord
from .switch_memory import record_key, release_switch_memory


def kinds_of(state) -> Dict[str, torch.dtype]:
    """``{kind: dtype}`` of a ``PartitionState``'s partitions (fp32 master and moments)."""
    return {k: v.dtype for k, v in state.tensors[0].items()}


def new_partitions(layout, rank: int, kinds: Dict[str, torch.dtype]) -> List[Dict[str, torch.Tensor]]:
    """New partitions of global ``rank`` under ``layout`` (a band layout: TP or pipeline), one
    ``{kind: 1-D tensor}`` per partition, of the given kinds and dtypes (:func:`kinds_of`): the
    padding zeroed, every element a fragment covers left for the transfer to write (every one of
    them is in the plan)."""
    zl = layout.zero_of(rank)
    out = [
        {k: torch.empty(zl.partition_numel(b), dtype=dtype) for k, dtype in kinds.items()}
        for b in range(zl.num_partitions)
    ]
    covered = [[] for _ in out]
    for f in zl.fragments(layout.dp_rank_of(rank)):
        covered[f.group].append((f.local, f.local + f.numel))
    for part, spans in zip(out, covered):
        pos = 0
        for lo, hi in sorted(spans) + [(len(next(iter(part.values()))),) * 2]:
            if lo > pos:
                for t in part.values():
                    t[pos:lo].zero_()
            pos = max(pos, hi)
    return out


def new_scalars(old, old_rank: int, new, new_rank: int, scalars) -> list:
    """The optimizer's non-partition state (Adam's ``step``) of each new partition of global
    ``new_rank`` under band layout ``new``, copied from ``scalars`` (those of old global
    ``old_rank``'s partitions) by :func:`~ds_dynatrain.planner.box_plan.band_scalars` (at ZeRO-3
    the number of sub-groups changes with the layout; a pipeline stage's optimizer groups change
    with its layers; every partition steps together)."""
    src = band_scalars(old, old_rank, new, new_rank, scalars)
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in src]


def transfer_group():
    """The group a box transfer's CPU messages go over: the world's default group when it is gloo,
    else a gloo group over the same processes (NCCL carries no CPU tensor; collective: every process
    calls it). The caller destroys a group made here once the transfer is done."""
    if tdist.get_backend() == "gloo":
        return None
    return tdist.new_group(backend="gloo")


def move_state(dt, plan, rank: int, state, dests, new_rank: Optional[int] = -1, peers=None):
    """Move this process's rows of ``plan`` (fp32 master and moments of ``state`` into ``dests``)
    over the world's processes (:func:`transfer_group`), in messages of :func:`message_bytes`;
    returns the transfer's figures."""
    group = transfer_group()
    kinds = tuple(state.tensors[0])
    try:
        return execute_box_plan(
            plan.table, rank, state.tensors, dests, kinds, group, new_rank, peers, message_bytes(dt)
        )
    finally:
        if group is not None:
            tdist.destroy_process_group(group)


def message_bytes(dt) -> int:
    """The largest message of a box transfer: a quarter of ``dynatrain.max_inflight_bytes`` (one
    message per peer and direction in flight, as a DP resize's two each way)."""
    return max(dt.config.max_inflight_bytes // 4, 1)


def count_transfer(rec: ResizeRecord, plan, state, stats) -> None:
    """Put a box plan's totals (bytes of every state kind) and this process's transfer figures
    into ``rec``."""
    kinds = len(state.tensors[0])
    elsize = state.tensors[0][MASTER].element_size()
    rec.bytes_moved = plan.numel_moved * elsize * kinds
    rec.bytes_kept = plan.numel_kept * elsize * kinds
    rec.transfer_s, rec.keep_s, rec.messages = stats.exchange_seconds, stats.keep_seconds, stats.messages
    rec.bytes_sent, rec.bytes_received = stats.bytes_sent, stats.bytes_received
    rec.peak_staging_bytes = stats.peak_staging_bytes


def install_moved_state(engine, dests, scalars) -> None:
    """The moved partitions (``dests``: per new partition ``{kind: tensor}``) become the rebuilt
    engine's fp32 master and moments (``scalars``: Adam's step per partition), and the working
    parameters are made from the master (collective over the DP group)."""
    install_master(engine, [d[MASTER] for d in dests])
    install_optimizer_state(engine, [{k: v for k, v in d.items() if k != MASTER} for d in dests], scalars)
    working_from_master(engine)


def switch_in_place(engine, plan, rec: ResizeRecord, t0: float, rebuild: Callable[[], None]) -> ResizeRecord:
    """A change of band layout over the same processes, once ``plan`` is made (a TP or a PP
    switch): this rank's fp32 master and moments moved by ``plan`` into new partitions,
    ``rebuild()`` (the engine rebuilt at the new layout, which it makes the job's), the moved
    state installed; memory held for the switch (:mod:`~ds_dynatrain.engine.switch_memory`) is
    freed first; ``rec`` completed (``t0``: ``time.perf_counter()`` at the decision) and
    published. Collective: every rank calls it.

    Raises:
        TransitionAbortedError: a peer failed during the transfer.
    """
    dt, rank = engine._dt, tdist.get_rank()
    # held for this switch (one for another layout too): freed just before the new partitions and engine
    release_switch_memory(dt, rec, key=record_key(rec))
    state = extract_partitions(engine)
    dests = new_partitions(plan.new_layout, rank, kinds_of(state))
    count_transfer(rec, plan, state, move_state(dt, plan, rank, state, dests))
    scalars = new_scalars(plan.old_layout, rank, plan.new_layout, rank, state.scalars)
    state = None  # the old partitions go with the old engine
    t = time.perf_counter()
    rebuild()
    install_moved_state(engine, dests, scalars)
    rec.rebuild_s = time.perf_counter() - t
    rec.seconds = time.perf_counter() - t0
    publish(engine, rec)
    return rec
