"""The working parameters of a grown world: each joiner receives every parameter from one of the
processes that stayed, over point-to-point messages of the default group."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as tdist

from ..errors import TransitionAbortedError


class PostedSpread:
    """The messages of :func:`post_to_joiners`, in flight until :meth:`wait`."""

    def __init__(self, works: List[Tuple[int, int, object]], nbytes: int, tensors: Sequence[torch.Tensor]):
        self._works, self.nbytes = works, nbytes
        self._tensors = list(tensors)  # alive until the messages are done

    def wait(self) -> int:
        """Wait for every message (each within the default group's timeout); returns the bytes
        the joiners receive in all (every joiner each tensor).

        Raises:
            TransitionAbortedError: a message failed or timed out, naming the peer and the tensor.
        """
        works, self._works = self._works, []
        for k, peer, work in works:
            try:
                work.wait()
            except RuntimeError as err:
                raise TransitionAbortedError(
                    f"parameter {k} to or from rank {peer} after the grow failed: {err}"
                ) from err
        self._tensors = []
        return self.nbytes


def post_to_joiners(tensors: Sequence[torch.Tensor], holders: Sequence[int]) -> PostedSpread:
    """Post the messages that fill ``tensors`` on every rank of the default group that is not in
    ``holders`` (the joiners) from the ranks that are: tensor ``k`` from ``holders[k % len(holders)]``,
    sent to each joiner. Every message is posted before any is waited for, so each holder sends
    over its own connections while the others do; a holder receives nothing (it holds the same
    values). Replaces DeepSpeed's set-up broadcast after a grow, which sends every tensor to every
    rank (``DeepSpeedEngine._broadcast_model``): at 2 -> 3 ranks each holder also sent the other
    holder what it held. Collective over the default group: every rank calls it with tensors of
    the same shapes and dtypes in the same order; empty tensors (partitioned ZeRO-3 parameters)
    are skipped. The tensors must not be written, nor a receiving rank's read, until
    :meth:`PostedSpread.wait` returns.

    Raises:
        ValueError: a tensor is not contiguous (before any message is posted; the other ranks
            then fail by the group's timeout).
    """
    me, world = tdist.get_rank(), tdist.get_world_size()
    holders = list(holders)
    joiners = [r for r in range(world) if r not in holders]
    if not joiners or not holders:
        return PostedSpread([], 0, ())
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
    nbytes = len(joiners) * sum(t.numel() * t.element_size() for t in tensors)
    return PostedSpread(works, nbytes, tensors)
