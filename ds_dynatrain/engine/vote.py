"""The step-boundary vote: what every rank brings to the one all-reduce after each optimizer step,
encoded and decoded here alone.

Each rank's :class:`StepVote` (its loss, rank 0's pending request, the standby processes it
found gone and the signal the launcher was sent, whether this rank received a preemption notice,
how its background builds stand) is
encoded as a float64 vector; the vectors are summed by one ``all_reduce``; :func:`decode` turns the
sum into a :class:`StepTally` that every rank reads alike, so every rank decides the same at this
step.

Sets of ranks (and of standby processes) travel as bitmasks, one bit per rank, packed into words
of :data:`WORD_BITS` bits, each word one float64 element. A float64 holds every integer below
2**53 exactly, and a word sums distinct powers of two below 2**52, so the sum is exact whatever the
reduction order and the world size (a single float64 bitmask is exact only up to 53 ranks: the
preemption of rank 60 of 64 would vanish).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DynatrainError

WORD_BITS = 52
_HEAD = 6  # loss_sum, loss_count, request world size, request index + 1, ready, failed
_TAIL = 1  # after the masks: the signal that stops the job (0: none)


def words_for(n: int) -> int:
    """Float64 words that hold a bitmask of ``n`` bits."""
    return -(-n // WORD_BITS)


def vote_length(world_size: int, n_standby: int) -> int:
    """Elements of the encoded vote at ``world_size`` ranks with ``n_standby`` standby processes."""
    return _HEAD + words_for(world_size) + words_for(n_standby) + _TAIL


@dataclass(frozen=True)
class StepVote:
    """One rank's contribution to the step boundary.

    Attributes:
        loss_sum, loss_count: this rank's summed micro-batch losses and their number since the
            last boundary.
        request: rank 0 only: ``(index, world size)`` of the next resize request, or None.
        preempted: this rank received a preemption notice (SIGTERM).
        standby_gone: rank 0 only: indices (into the job's standby list) of standby processes
            that are gone.
        ready, failed: this rank's background builds of a prepared request are done / failed.
        stop: rank 0 only: the signal number sent to the launcher to stop the job (SIGTERM,
            SIGINT), read from the store; 0: none.
    """

    loss_sum: float = 0.0
    loss_count: int = 0
    request: Optional[Tuple[int, int]] = None
    preempted: bool = False
    standby_gone: FrozenSet[int] = frozenset()
    ready: bool = False
    failed: bool = False
    stop: int = 0


@dataclass(frozen=True)
class StepTally:
    """The sum of every rank's vote, decoded: the same on every rank.

    Attributes:
        loss_sum, loss_count: over every rank.  request: ``(index, world size)`` or None.
        preempted: the ranks that received a preemption notice.  standby_gone: indices of the
        standby processes that are gone.  ready, failed: how many ranks have their builds done /
        failed.  stop: the signal that stops the job at this boundary (0: none).
    """

    loss_sum: float
    loss_count: int
    request: Optional[Tuple[int, int]]
    preempted: FrozenSet[int]
    standby_gone: FrozenSet[int]
    ready: int
    failed: int
    stop: int = 0

    @property
    def loss(self) -> float:
        """The mean loss of the step over every rank's micro-batches."""
        return self.loss_sum / max(self.loss_count, 1)


def _pack(bits, n: int) -> List[float]:
    words = [0] * words_for(n)
    for b in bits:
        if not 0 <= b < n:
            raise ValueError(f"bit {b} outside a mask of {n}")
        words[b // WORD_BITS] |= 1 << (b % WORD_BITS)
    return [float(w) for w in words]


def _unpack(words: Sequence[float], n: int, what: str) -> FrozenSet[int]:
    out = set()
    for i, w in enumerate(words):
        if w != int(w) or not 0 <= w < 2**WORD_BITS:
            raise DynatrainError(
                f"step vote: {what} word {i} is {w!r}, not a sum of distinct bits "
                "(ranks voted with different world sizes?)"
            )
        v = int(w)
        while v:
            low = v & -v
            out.add(i * WORD_BITS + low.bit_length() - 1)
            v ^= low
    return frozenset(b for b in out if b < n)


def encode(vote: StepVote, rank: int, world_size: int, n_standby: int) -> List[float]:
    """The float64 vector of ``vote`` from ``rank`` (length :func:`vote_length`).

    Raises:
        ValueError: a rank other than 0 carries a request, standby marks or a stop, a standby
            index is out of range, or the stop is not a signal number.
    """
    if rank != 0 and (vote.request is not None or vote.standby_gone or vote.stop):
        raise ValueError(f"rank {rank}: only rank 0 votes requests, gone standby processes and stops")
    if not 0 <= int(vote.stop) < 2**WORD_BITS:
        raise ValueError(f"stop {vote.stop!r}: expected a signal number (0: none)")
    index, size = vote.request if vote.request is not None else (-1, 0)
    head = [
        float(vote.loss_sum),
        float(vote.loss_count),
        float(size),
        float(index + 1),
        float(vote.ready),
        float(vote.failed),
    ]
    masks = _pack([rank] if vote.preempted else [], world_size) + _pack(vote.standby_gone, n_standby)
    return head + masks + [float(vote.stop)]


def decode(totals: Sequence[float], world_size: int, n_standby: int) -> StepTally:
    """The :class:`StepTally` of the summed votes ``totals``.

    Raises:
        DynatrainError: ``totals`` has the wrong length, a mask word is not a sum of distinct bits
            or the stop is not a signal number.
    """
    totals = [float(x) for x in totals]
    if len(totals) != vote_length(world_size, n_standby):
        raise DynatrainError(f"step vote: {len(totals)} elements, expected {vote_length(world_size, n_standby)}")
    size, index = int(totals[2]), int(totals[3]) - 1
    w = words_for(world_size)
    stop = totals[-1]
    if stop != int(stop) or not 0 <= stop < 2**WORD_BITS:
        raise DynatrainError(f"step vote: stop is {stop!r}, not a signal number (more than rank 0 voted one?)")
    return StepTally(
        loss_sum=totals[0],
        loss_count=int(totals[1]),
        request=(index, size) if index >= 0 else None,
        preempted=_unpack(totals[_HEAD : _HEAD + w], world_size, "preemption"),
        standby_gone=_unpack(totals[_HEAD + w : len(totals) - _TAIL], n_standby, "standby"),
        ready=int(totals[4]),
        failed=int(totals[5]),
        stop=int(stop),
    )


def exchange(vote: StepVote, rank: int, world_size: int, n_standby: int, device) -> StepTally:
    """All-reduce (sum) every rank's ``vote`` over the default process group and decode the sum.
    Collective: every rank calls it with the same ``world_size`` and ``n_standby``. ``device``: where
    the vector is reduced (NCCL reduces device tensors only)."""
    import torch
    import torch.distributed as tdist

    t = torch.tensor(encode(vote, rank, world_size, n_standby), dtype=torch.float64, device=device)
    tdist.all_reduce(t)
    return decode(t.cpu().numpy().astype(np.float64).tolist(), world_size, n_standby)
