"""Failure is collective: a problem found on one rank becomes the same error on every rank.

A rank that raised alone would leave the others waiting in their next collective; so each rank
hands its problem (or None) to :func:`raise_on_every_rank`, which gathers them over the process
group and raises, on every rank, one error naming each rank and its problem.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Type

import torch.distributed as tdist


def describe_problems(problems: Sequence[Optional[str]]) -> List[Tuple[int, str]]:
    """``[(rank, problem)]`` of the ranks that reported one, in rank order."""
    return [(r, p) for r, p in enumerate(problems) if p]


def raise_on_every_rank(
    problem: Optional[str], error: Type[Exception], what: str, own_error: Optional[Type[Exception]] = None, group=None
) -> None:
    """Gather every rank's ``problem`` (None: this rank has none) over ``group`` (default: the
    default process group); if any rank has one, raise on every rank ``error(what + ": rank r:
    problem; ...")``. ``own_error``: the class raised instead on a rank whose own problem it is
    (a rank that found a wrong layout raises ``LayoutMismatchError``, its peers
    ``TransitionAbortedError``). Collective: every rank of the group calls it.

    Raises:
        error (or own_error): naming every rank's problem.
    """
    problems: List[Optional[str]] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(problems, problem, group=group)
    bad = describe_problems(problems)
    if not bad:
        return
    text = f"{what}: " + "; ".join(f"rank {r}: {p}" for r, p in bad)
    raise (own_error if problem and own_error is not None else error)(text)
