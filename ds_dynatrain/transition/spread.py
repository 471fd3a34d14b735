"""The working parameters of a grown world: each joiner receives every parameter from one of the
processes that stayed, over point-to-point messages of the default group."""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as tdist

from ..errors import TransitionAbortedError


def send_to_joiners(tensors: Sequence[torch.Tensor], holders: Sequence[int]) -> int:
    """Fill ``tensors`` on every rank of the default group that is not in ``holders`` (the
    joiners) from the ranks that are: tensor ``k`` from ``holders[k % len(holders)]``, sent to
    each joiner. Every message is posted before any is waited for, so each holder sends over its
    own connections while the others do; a holder receives nothing (it holds the same values).
    Replaces DeepSpeed's set-up broadcast after a grow, which sends every tensor to every rank
    (``DeepSpeedEngine._broadcast_model``): at 2 -> 3 ranks each holder also sent the other holder
    what it held. Collective over the default group: every rank calls it with tensors of the same
    shapes and dtypes in the same order; empty tensors (partitioned ZeRO-3 parameters) are
    skipped.

    Returns:
        the bytes the joiners receive in all (every joiner each tensor), bytes; 0 where the
        default group has no joiner or no holder.

    Raises:
        ValueError: a tensor is not contiguous (before any message is posted; the other ranks
            then fail by the group's timeout).
        TransitionAbortedError: a message failed or timed out (the group's timeout), naming the
            peer and the tensor.
    """
    me, world = tdist.get_rank(), tdist.get_world_size()
    holders = list(holders)
    joiners = [r for r in range(world) if r not in holders]
    if not joiners or not holders:
        return 0
    bent = [k for k, t in enumerate(tensors) if not t.is_contiguous()]
    if bent:  # before any message is posted
        raise ValueError(f"tensors {bent} are not contiguous: they cannot be sent or received in place")
    works: List[tuple] = []
    for k, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        src = holders[k % len(holders)]
        flat = t.view(-1).view(torch.uint8)
        if me == src:
            works.extend((k, j, tdist.isend(flat, dst=j, tag=k)) for j in joiners)
        elif me in joiners:
            works.append((k, src, tdist.irecv(flat, src=src, tag=k)))
    for k, peer, work in works:
        try:
            work.wait()
        except RuntimeError as err:
            raise TransitionAbortedError(f"parameter {k} to or from rank {peer} after the grow failed: {err}") from err
    return len(joiners) * sum(t.numel() * t.element_size() for t in tensors)
