"""Failure is collective: a problem found on one rank becomes the same error on every rank.

A rank that raised alone would leave the others waiting in their next collective; so each rank
hands its problem (or None) to :func:`raise_on_every_rank`, which gathers them over the process
group and raises, on every rank, one error naming each problem once and the ranks that had it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Type, Union

import torch.distributed as tdist

from ..errors import DynatrainError

Problem = Union[None, str, BaseException]


def describe_problems(problems: Sequence[Optional[str]]) -> List[Tuple[int, str]]:
    """``[(rank, problem)]`` of the ranks that reported one, in rank order."""
    return [(r, p) for r, p in enumerate(problems) if p]


def _wire(problem: Problem) -> Optional[Tuple[Optional[str], str]]:
    """What a rank sends: ``(error class name or None, text)``; None for no problem."""
    if problem is None or isinstance(problem, str):
        return (None, problem) if problem else None
    return type(problem).__name__, str(problem)


def _our_class(name: Optional[str]) -> Optional[Type[Exception]]:
    """The error class of ds_dynatrain (:class:`DynatrainError` or below it) called ``name``;
    None for any other name (no other class is ever chosen by a name a peer sent)."""
    todo = [DynatrainError]
    while name and todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    return None


def _ranks(ranks: Sequence[int], world_size: int) -> str:
    if len(ranks) == world_size and world_size > 1:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def summarize(reports: Sequence[Optional[Tuple[Optional[str], str]]], error: Type[Exception]):
    """The class to raise and the text naming each distinct problem once with its ranks
    (``"every rank: P"``, ``"rank 1: P; ranks 0, 2: Q"``), or None when no rank reported one.

    The class is ``error``, unless every rank that reported a problem reported an error of
    ``ds_dynatrain.errors`` of one class: then that class (a model mismatch found on every rank
    is a :class:`~ds_dynatrain.errors.LayoutMismatchError` everywhere). A problem's class name is
    left out of the text when it is the class raised.
    """
    bad = [(r, rep) for r, rep in enumerate(reports) if rep]
    if not bad:
        return None
    classes = {_our_class(name) for _r, (name, _t) in bad}
    cls = classes.pop() if len(classes) == 1 and None not in classes else error
    grouped: dict = {}
    for r, (name, text) in bad:
        shown = text if name is None or _our_class(name) is cls else f"{name}: {text}"
        grouped.setdefault(shown, []).append(r)
    text = "; ".join(f"{_ranks(ranks, len(reports))}: {shown}" for shown, ranks in grouped.items())
    return cls, text


def raise_on_every_rank(
    problem: Problem, error: Type[Exception], what: str, own_error: Optional[Type[Exception]] = None, group=None
) -> None:
    """Gather every rank's ``problem`` over ``group`` (default: the default process group); if
    any rank has one, raise on every rank one error ``what + ": " + `` each distinct problem once
    with the ranks that had it (see :func:`summarize`).

    ``problem``: None (this rank has none), a string, or the exception this rank met (its class
    travels: when every rank that failed met an error of ``ds_dynatrain.errors`` of one class,
    that class is raised instead of ``error``). ``own_error``: the class raised instead on a rank
    whose own problem it is (a rank that found a wrong layout raises ``LayoutMismatchError``, its
    peers ``TransitionAbortedError``). Collective: every rank of the group calls it.

    Raises:
        error (or own_error, or the problems' common class): naming every distinct problem.
    """
    reports: List[Optional[Tuple[Optional[str], str]]] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(reports, _wire(problem), group=group)
    found = summarize(reports, error)
    if found is None:
        return
    cls, text = found
    if problem and own_error is not None:
        cls = own_error
    raise cls(f"{what}: {text}")
