"""Rank assignment: which process takes which rank of the new world (pure).

DynaTrain chooses the assignment of staying processes to new ranks that keeps the most state in
place: an assignment problem over the overlaps of old and new regions. Before that, a recent
membership is taken again when it fits (its process groups are cached, so no rendezvous is
needed: the elastic device manager's group reuse).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

from ..vps.layout import ZeroLayout
from .intersect import shared_transfer_table

_NEW = "\0new-joiner-"  # placeholder of a new joiner (no member id starts with a NUL)


def assign_members(old_members: Sequence[str], new_world_size: int, joiner_ids: Sequence[str]) -> Tuple[str, ...]:
    """Keep-in-place rank assignment: old rank ``r`` stays rank ``r`` while ``r < new_world_size``;
    the highest old ranks leave on a shrink, joiners take the new highest ranks on a grow.

    Raises:
        ValueError: the number of joiners does not make up the new world size.
    """
    stay = list(old_members[:new_world_size])
    if len(stay) + len(joiner_ids) != new_world_size:
        raise ValueError(
            f"{len(stay)} staying ranks and {len(joiner_ids)} joiners do not make world size {new_world_size}"
        )
    return tuple(stay) + tuple(joiner_ids)


def overlap_matrix(old: ZeroLayout, new: ZeroLayout):
    """``K[i, j]``: elements old rank ``i`` holds that new rank ``j`` needs (int64, shape
    ``(old.world_size, new.world_size)``): what stays in place if process ``i`` becomes rank ``j``."""
    import numpy as np

    old.check_same_model(new)
    t = shared_transfer_table(old, new)  # the plan of the chosen assignment reuses it
    k = np.zeros(old.world_size * new.world_size, dtype=np.int64)
    np.add.at(k, t[:, 0] * new.world_size + t[:, 1], t[:, 5])
    return k.reshape(old.world_size, new.world_size)


def import_solver() -> None:
    """Import the assignment solver (``scipy.optimize``, about 0.35 s here) ahead of a plan that
    must be made at once (a recovery), e.g. in a background thread."""
    from scipy.optimize import linear_sum_assignment  # noqa: F401


def import_solver_in_background() -> None:
    """:func:`import_solver` in a daemon thread of its own; returns at once."""
    import threading

    threading.Thread(target=import_solver, name="dynatrain-import-solver", daemon=True).start()


def assign_members_best(
    old: ZeroLayout,
    new: ZeroLayout,
    old_members: Sequence[str],
    joiner_ids: Sequence[str],
    must_leave: Sequence[str] = (),
) -> Tuple[str, ...]:
    """The rank assignment that keeps the most elements in place (DynaTrain: an assignment
    problem over the overlaps of old and new regions): :func:`assign_by_overlap` on
    :func:`overlap_matrix`.

    Raises:
        ValueError: the staying processes plus joiners cannot fill the new world exactly.
    """
    leave = set(must_leave)
    candidates = [i for i, m in enumerate(old_members) if m not in leave]
    staying = min(len(candidates), new.world_size)
    if staying + len(joiner_ids) != new.world_size:  # before the overlaps are computed
        raise ValueError(
            f"{staying} staying processes and {len(joiner_ids)} joiners do not make world size {new.world_size}"
        )
    return assign_by_overlap(overlap_matrix(old, new), old_members, joiner_ids, must_leave)


def assign_by_overlap(
    k, old_members: Sequence[str], joiner_ids: Sequence[str], must_leave: Sequence[str] = ()
) -> Tuple[str, ...]:
    """The assignment of processes to new ranks that maximises the elements kept in place.

    Args:
        k: ``K[i, j]``, elements old rank ``i`` holds that new rank ``j`` needs (int64,
            ``(len(old_members), new world size)``).
        old_members, joiner_ids: the member id of each old rank; the joiners' ids.
        must_leave: processes that never stay (preempted).

    Each new rank is taken by one staying process or one joiner. Solved with
    ``scipy.optimize.linear_sum_assignment`` (Hungarian method, deterministic for the same input).

    Raises:
        ValueError: the staying processes plus joiners cannot fill the new world exactly.
    """
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    leave = set(must_leave)
    candidates = [i for i, m in enumerate(old_members) if m not in leave]
    n_new = k.shape[1]
    staying = min(len(candidates), n_new)
    if staying + len(joiner_ids) != n_new:
        raise ValueError(f"{staying} staying processes and {len(joiner_ids)} joiners do not make world size {n_new}")
    k = k[candidates]
    rows, cols = linear_sum_assignment(k, maximize=True)
    if len(rows) > staying:  # more columns than rows cannot happen; keep the best ``staying``
        order = np.argsort(-k[rows, cols], kind="stable")[:staying]
        rows, cols = rows[order], cols[order]
    out: list = [None] * n_new
    for r, c in zip(rows, cols):
        out[int(c)] = old_members[candidates[int(r)]]
    joiners = iter(joiner_ids)
    for j in range(n_new):
        if out[j] is None:
            out[j] = next(joiners)
    return tuple(out)


def recent_members(
    history: Sequence[Tuple[str, ...]],
    members: Sequence[str],
    standby: Sequence[str],
    world_size: int,
    must_leave: Sequence[str] = (),
) -> Optional[Tuple[str, ...]]:
    """The members of the latest earlier generation that can form the next one, or None.

    A generation of ``history`` (members in rank order, oldest first) fits when it has
    ``world_size`` members, is not the current one (``members``), holds no process of
    ``must_leave``, and: at a grow, holds every process that stays plus only standby processes;
    at a shrink (or the same size with leavers), holds only processes that stay.
    """
    leave = set(must_leave)
    pool = [m for m in members if m not in leave]
    current = tuple(members)
    for cand in reversed(history):
        cand = tuple(cand)
        if len(cand) != world_size or cand == current or set(cand) & leave:
            continue
        if world_size > len(pool):
            if set(pool) <= set(cand) and set(cand) - set(pool) <= set(standby):
                return cand
        elif set(cand) <= set(pool):
            return cand
    return None


def next_members(
    layout: ZeroLayout,
    members: Sequence[str],
    standby: Sequence[str],
    history: Sequence[Tuple[str, ...]],
    world_size: int,
    must_leave: Sequence[str],
    joiner_name: Callable[[int], str],
) -> Tuple[str, ...]:
    """The members of the next generation of ``world_size`` ranks, in rank order.

    A recent generation's members when they fit (:func:`recent_members`); otherwise the
    processes that stay take the new ranks that keep the most state of ``layout`` in place
    (:func:`assign_members_best`), standby processes (in their order) and then new joiners the
    others; a new joiner is named ``joiner_name(rank)`` after the rank it takes.
    """
    found = recent_members(history, members, standby, world_size, must_leave)
    if found is not None:
        return found
    staying = min(len(members) - len(set(must_leave) & set(members)), world_size)
    recalled = tuple(standby[: world_size - staying])
    placeholders = recalled + tuple(f"{_NEW}{i}" for i in range(world_size - staying - len(recalled)))
    drafted = assign_members_best(layout, layout.with_world_size(world_size), members, placeholders, must_leave)
    return tuple(joiner_name(r) if m.startswith(_NEW) else m for r, m in enumerate(drafted))
