"""Batch arithmetic across world sizes.

DeepSpeed asserts ``train_batch_size == micro_batch * gradient_accumulation_steps * dp_world_size``
at initialisation. An elastic job keeps the *global* batch (``train_batch_size``) fixed, so that the
optimisation is the same whatever the world size, and lets the per-rank split absorb the change:
the configured micro-batch is kept when it divides the per-rank share, otherwise the largest
smaller micro-batch that does is taken, and gradient accumulation makes up the rest.

(DeepSpeed 0.19 no longer ships ``deepspeed.elasticity``; this is the small part of it we need.)
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ResizeRefusedError


@dataclass(frozen=True)
class BatchSplit:
    """How one global batch is split at one world size.

    ``train_batch_size == micro_batch * gradient_accumulation_steps * world_size`` always holds
    (samples, not tokens)."""

    world_size: int
    micro_batch: int
    gradient_accumulation_steps: int

    @property
    def train_batch_size(self) -> int:
        return self.micro_batch * self.gradient_accumulation_steps * self.world_size


def largest_world_size(train_batch_size: int, micro_batch: int, at_most: int, max_world_size: int | None = None) -> int:
    """The largest world size ``<= at_most`` that :func:`split_global_batch` accepts; 0 if none
    (e.g. the processes left after a failure or a preemption, at_most = how many are alive)."""
    for n in range(at_most, 0, -1):
        try:
            split_global_batch(train_batch_size, micro_batch, n, max_world_size)
            return n
        except ResizeRefusedError:
            continue
    return 0


def split_global_batch(
    train_batch_size: int,
    micro_batch: int,
    world_size: int,
    max_world_size: int | None = None,
    what: str = "world size",
) -> BatchSplit:
    """Split a fixed global batch over ``world_size`` data-parallel ranks.

    Args:
        train_batch_size: global batch in samples (DeepSpeed's ``train_batch_size``), > 0.
        micro_batch: the configured ``train_micro_batch_size_per_gpu``, the largest allowed, > 0.
        world_size: data-parallel world size to split over.
        max_world_size: optional upper bound on ``world_size``.
        what: how the refusal names ``world_size`` (``"DP size"`` in a TP or pipeline job).

    Returns:
        The split keeping ``micro_batch`` when it divides the per-rank share, else the largest
        micro-batch below it that does.

    Raises:
        ResizeRefusedError: ``world_size`` < 1, above ``max_world_size``, or not a divisor of
            ``train_batch_size`` (the global batch could not be kept).
    """
    if train_batch_size <= 0 or micro_batch <= 0:
        raise ResizeRefusedError(
            f"train_batch_size ({train_batch_size}) and micro batch ({micro_batch}) must be positive"
        )
    if world_size < 1:
        raise ResizeRefusedError(f"{what} {world_size} refused: a job needs at least one rank")
    if max_world_size is not None and world_size > max_world_size:
        raise ResizeRefusedError(f"{what} {world_size} refused: above max_world_size={max_world_size}")
    if train_batch_size % world_size:
        raise ResizeRefusedError(
            f"{what} {world_size} refused: the global batch train_batch_size={train_batch_size} "
            f"is not divisible by it, so the global batch could not be kept"
        )
    per_rank = train_batch_size // world_size
    micro = min(micro_batch, per_rank)
    while per_rank % micro:
        micro -= 1
    return BatchSplit(world_size=world_size, micro_batch=micro, gradient_accumulation_steps=per_rank // micro)
