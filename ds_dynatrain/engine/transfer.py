"""Starting a transition's transfers from the engine's side: the transition group, the new
partitions, the master phase in the foreground and the moments in a background thread."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed.accelerator import get_accelerator

from ..elastic.groups import BackgroundGroup
from ..elastic.keys import group_prefix
from ..elastic.membership import GenerationRecord
from ..planner.plan import Plan
from ..transition.buffers import allocate_partitions
from ..transition.execute import (
    PendingTransition,
    TransitionStats,
    execute_plan,
    start_plan,
    transition_group,
    transition_ranks,
)
from ..transition.spread import post_to_joiners
from ..zero.geometry import working_dtype
from ..zero.state import MASTER, moment_kinds
from .header import TransitionHeader
from .state import ElasticState


def xfer_prefix(ranks: Tuple[str, ...], generation: int, step: int) -> str:
    """Store prefix of the transition group over ``ranks`` into ``generation`` published at ``step``."""
    return group_prefix(generation, ranks, step, kind="xfer")


def background_xfer(
    dt: ElasticState, ranks: Tuple[str, ...], generation: int, step: int, timeout_s: float
) -> BackgroundGroup:
    """Start building the transition group over ``ranks`` (the old members, then the joiners) into
    ``generation`` in a daemon thread, on its own store connection."""
    connect, me = dt.membership.new_client, dt.member
    return BackgroundGroup(
        lambda: transition_group(connect(), xfer_prefix(ranks, generation, step), ranks, me, timeout_s),
        name=f"dynatrain-xfer-{generation}",
    )


def build_joiner_xfer(dt: ElasticState, rec: GenerationRecord, timeout_s: float) -> BackgroundGroup:
    """A joiner starts building the transition group of ``rec`` before it waits for the header:
    the old members may have built theirs ahead (a prepared request) and wait for it."""
    return background_xfer(dt, rec.transition_members, rec.generation, rec.step, timeout_s)


def data_plane(plan: Plan, dt: ElasticState, generation: int, group=None):
    """``(ranks, group, overlap)`` of the transition into ``generation``: the member of each rank,
    the private gloo group the bytes go through (:func:`transition_group`, or ``group`` when it
    was built ahead), and the ``transfer_overlap`` mode that applies. State on an accelerator is
    staged through host buffers and completes before the rebuild (overlap ``"none"``): a
    background thread would copy device memory on another stream than training's."""
    ranks = transition_ranks(plan)
    if group is None:
        group = transition_group(
            dt.membership.new_client(),
            xfer_prefix(ranks, generation, dt.published_step.get(generation, 0)),
            ranks,
            dt.member,
            dt.config.collective_timeout_s,
        )
    on_host = get_accelerator().device_name() == "cpu"
    return ranks, group, dt.config.transfer_overlap if on_host else "none"


def begin_transition(
    plan: Plan,
    dt: ElasticState,
    generation: int,
    header: TransitionHeader,
    sources,
    receives: bool,
    group=None,
    held: Sequence[torch.Tensor] = (),
) -> Tuple[Optional[Dict[int, Dict[str, torch.Tensor]]], TransitionStats, PendingTransition, str, object]:
    """Start moving this process's share of ``plan`` into ``generation`` (survivors, leavers and
    joiners alike, after the header is agreed).

    The master partitions move first when the header says they must (bf16/fp16 training); the
    optimizer moments then move in a background thread, waited for here when the
    ``transfer_overlap`` that applies is ``"none"``.

    Args:
        sources: this process's old partitions (``PartitionState.tensors``), None for a joiner.
        receives: whether this process is in the new world (its new partitions are allocated).
        group: the transition group when it was built ahead (None: built here).
        held: 1-D tensors written ahead that may become new partitions of their length and dtype
            (:func:`~ds_dynatrain.transition.buffers.allocate_partitions`).

    Returns:
        ``(dests, stats of the master phase, PendingTransition of the moments, overlap mode,
        the transition group)``; shut the group down once the moments have arrived.

    Raises:
        TransitionAbortedError: a peer failed or a wait timed out (names the peer and step).
    """
    kinds = tuple(header.kinds)
    moments = moment_kinds(kinds)
    dests = None
    if receives:
        dests = allocate_partitions(
            plan,
            dt.member,
            kinds if header.master_moves else moments,
            getattr(torch, header.dtype),
            get_accelerator().current_device_name(),
            reuse=held,
        )
    ranks, group, overlap = data_plane(plan, dt, generation, group)
    run = dict(
        dests=dests, timeout_s=dt.config.collective_timeout_s, max_inflight_bytes=header.max_inflight_bytes, ranks=ranks
    )
    stats = execute_plan(
        plan, dt.member, group, (MASTER,) if header.master_moves else (), sources=_only(sources, (MASTER,)), **run
    )
    # the background thread holds only the moments: the old master goes with the old engine
    transfer = start_plan(plan, dt.member, group, moments, sources=_only(sources, moments), **run)
    if overlap == "none":
        transfer.wait()  # every wait inside is bounded by collective_timeout_s
    return dests, stats, transfer, overlap, group


def _only(parts: Optional[List[Dict[str, torch.Tensor]]], kinds) -> Optional[List[Dict[str, torch.Tensor]]]:
    """``parts`` restricted to ``kinds`` (references, no copies); None stays None."""
    return None if parts is None else [{k: g[k] for k in kinds if k in g} for g in parts]


def post_params(dt: ElasticState, plan: Plan, model: torch.nn.Module) -> None:
    """A grow at ZeRO-1/2, on every member of the new world as its transfer begins: post the
    messages that give the joiners the working parameters
    (:func:`~ds_dynatrain.transition.spread.post_to_joiners`, over the new default group), so
    that they cross beside the moments instead of after the engine set-up's first part; the
    set-up waits for them (``ElasticEngine._broadcast_model``). Left to the set-up (which posts
    them itself; each side's messages meet the other's whenever it posts them) at ZeRO-3, whose
    working parameters are partitioned then, and on a joiner whose parameters DeepSpeed's set-up
    will replace before its broadcast: cast to bf16/fp16 or moved to the device
    (``DeepSpeedEngine._configure_distributed_model``)."""
    if plan.new_layout.stage >= 3:
        return
    tensors = [p.data for _, p in model.named_parameters()]
    dtype = working_dtype(dt.ds_config, model)
    device = torch.device(get_accelerator().current_device_name())
    if all(t.dtype == dtype and t.device == device for t in tensors):
        dt.params_posted = post_to_joiners(tensors, list(plan.survivor_ranks))
