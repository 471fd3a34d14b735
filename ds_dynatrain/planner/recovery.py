"""Planning an in-place recovery (pure): who holds whose replica, which step the survivors can all
go back to, and the plan of a shrink whose dead ranks' partitions are served by their replica
holders.

A recovery is a shrink whose sources are the survivors plus the replicas (DESIGN.md "Recovery in
place"). Each rank's partition state is copied to one other rank, its *holder*, the next member
on a ring ordered so that consecutive members sit on different hosts where the job spans several
(Gemini, SOSP'23, §4 places checkpoint replicas on other machines for the same reason: a lost host
takes its own replicas with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import RecoveryNotPossibleError
from .plan import Plan

STAND_IN = "~stand-in~"  # prefix of a holder's own slot in the phase that sends a dead rank's replica


def replica_ring(members: Sequence[str], node_of: Mapping[str, int]) -> Tuple[str, ...]:
    """The members in ring order: each one's replica goes to the next (the last's to the first).

    Members are taken round-robin over hosts (in the order of their first member), each host's
    in rank order, so that with two or more hosts a member and its holder never share one.
    ``node_of`` lacks a member: it counts as a host of its own.
    """
    by_node: Dict[object, list] = {}
    for m in members:
        by_node.setdefault(node_of.get(m, ("alone", m)), []).append(m)
    queues = list(by_node.values())
    ring = []
    while any(queues):
        for q in queues:
            if q:
                ring.append(q.pop(0))
    return tuple(ring)


def holders(ring: Sequence[str]) -> Dict[str, str]:
    """``{member: the member that holds its replica}`` for a ring of at least two members."""
    return {m: ring[(i + 1) % len(ring)] for i, m in enumerate(ring)} if len(ring) > 1 else {}


@dataclass(frozen=True)
class Offer:
    """What one survivor holds when a recovery starts.

    Attributes:
        member: the survivor.  own: steps of which it holds a complete copy of its own state.
        replica_of: the member whose replica it holds (None: none).  replica: steps of which that
            replica is complete (a refresh cut by the failure is not among them).
    """

    member: str
    own: Tuple[int, ...]
    replica_of: Optional[str] = None
    replica: Tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return {
            "member": self.member,
            "own": list(self.own),
            "replica_of": self.replica_of,
            "replica": list(self.replica),
        }

    @staticmethod
    def from_dict(d: dict) -> "Offer":
        return Offer(d["member"], tuple(d["own"]), d.get("replica_of"), tuple(d.get("replica", ())))


def recovery_step(offers: Sequence[Offer], dead: Sequence[str]) -> Tuple[int, Dict[str, str]]:
    """The latest step every survivor can go back to, and who serves each dead member.

    The step is in every survivor's own copies and, for each dead member, in the complete
    replicas of the survivor that holds it.

    Returns:
        ``(step, {dead member: holder})``.

    Raises:
        RecoveryNotPossibleError: a dead member's replica is held by nobody alive (it died too, or replicas
            were not refreshed yet), or no step is common to all.
    """
    if not offers:
        raise RecoveryNotPossibleError("no survivor is left")
    common = set(offers[0].own)
    for o in offers[1:]:
        common &= set(o.own)
    served = {}
    for d in dead:
        holder = next((o for o in offers if o.replica_of == d and o.replica), None)
        if holder is None:
            raise RecoveryNotPossibleError(
                f"no survivor holds a complete replica of {d} (its holder died too, or none was made yet)"
            )
        common &= set(holder.replica)
        served[d] = holder.member
    if not common:
        raise RecoveryNotPossibleError(
            "no step is common to the survivors' copies and the replicas of " + ", ".join(sorted(dead))
        )
    return max(common), served


def split_recovery_plan(plan: Plan, served: Mapping[str, str]) -> Tuple[Plan, Plan]:
    """The two phases of a recovery's transfers, both plans over the same layouts.

    ``plan`` is the shrink from the old layout (dead members included as old ranks) to the
    survivors'. Phase 1 holds the transfers from live old ranks. Phase 2 holds those from dead
    ranks, with each dead rank's slot taken by its holder (``served``: dead member -> holder), the
    holder's own slot by a stand-in that has no transfers; the holder sends them from the replica.
    """
    dead_ranks = [plan.old_members.index(d) for d in served]
    from_dead = np.isin(plan.table[:, 0], dead_ranks)
    live = Plan(plan.old_layout, plan.new_layout, plan.old_members, plan.new_members, plan.table[~from_dead])
    members = list(plan.old_members)
    for d, h in served.items():
        members[members.index(h)] = STAND_IN + h
        members[plan.old_members.index(d)] = h
    replicas = Plan(plan.old_layout, plan.new_layout, tuple(members), plan.new_members, plan.table[from_dead])
    return live, replicas
