"""The transition's schedule: which processes exchange in which step, and how one stream of slices
is cut into messages (DynaTrain, "State Transition Engine"; pure: no process group).

* **Pairing.** The processes of the transition (the old members plus the joiners, ranked in
  that order) exchange in steps: in step ``s`` (1 ≤ s < the next power of two above their
  count) process ``i`` exchanges with ``i XOR s`` if that process exists. The relation is
  symmetric, so both sides of a pair are in the same step, and every ordered pair of distinct
  processes meets in exactly one step (:func:`pair_schedule`).
* **Packing.** Everything process ``i`` sends to ``j`` is one *stream* (:class:`Stream`): the
  plan's transfers ``i → j`` in plan order, each with the state kinds in a fixed order. The
  stream is cut into chunks of at most a given number of elements, at slice boundaries where
  possible (:meth:`Stream.chunks`); both sides cut at the same element offsets, so they agree on
  every message without a word.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..planner.plan import Plan, Transfer


def transition_members(previous: Sequence[str], members: Sequence[str]) -> Tuple[str, ...]:
    """Members of the transition from ``previous`` to ``members`` in rank order: the previous
    generation's, then the joiners (members not in ``previous``, in their rank order)."""
    before = set(previous)
    return tuple(previous) + tuple(m for m in members if m not in before)


def transition_ranks(plan: Plan) -> Tuple[str, ...]:
    """Members of the transition of ``plan`` in rank order: the old members, then the joiners."""
    return transition_members(plan.old_members, plan.new_members)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def peer_at(rank: int, step: int, world_size: int) -> Optional[int]:
    """The process ``rank`` exchanges with in ``step`` (``rank XOR step``), or None if that
    process does not exist. ``step`` in ``[1, next_pow2(world_size))``."""
    p = rank ^ step
    return p if p < world_size else None


def pair_schedule(world_size: int) -> List[List[Tuple[int, int]]]:
    """The pairs ``(i, j)``, ``i < j``, that exchange in each step ``1 .. next_pow2(world_size) - 1``.

    Every unordered pair of distinct ranks appears in exactly one step, and no rank appears twice
    in one step (``i XOR s`` is a bijection).
    """
    return [
        [(i, i ^ s) for i in range(world_size) if i < (i ^ s) < world_size] for s in range(1, next_pow2(world_size))
    ]


class Exchange(NamedTuple):
    """One step of one process's schedule: the peer it exchanges with, and what goes each way.

    Attributes:
        step: the XOR step (``peer == rank XOR step``).
        peer: the peer's transition rank.  member: the peer's member id.
        sends: the plan's transfers to the peer, in plan order (may be empty).
        receives: the plan's transfers from the peer, in plan order (may be empty).
    """

    step: int
    peer: int
    member: str
    sends: List[Transfer]
    receives: List[Transfer]


def exchanges(plan: Plan, member: str, ranks: Sequence[str]) -> List[Exchange]:
    """``member``'s exchanges in step order: one per step whose peer exists and has something
    to send to or receive from it (a pair with nothing either way skips its step). Pure; the
    cost is the member's own transfers plus one look-up per step (``next_pow2(len(ranks))``).

    Raises:
        ValueError: ``member`` is not in ``ranks``.
    """
    index = {m: i for i, m in enumerate(ranks)}
    if member not in index:
        raise ValueError(f"member {member} is not one of the transition's {len(index)} ranks")
    me = index[member]
    sends, recvs = plan.sends_of(member), plan.receives_of(member)
    peers: Dict[int, str] = {index[m]: m for m in (*sends, *recvs)}
    out = []
    for step in sorted(p ^ me for p in peers):
        peer = peers[me ^ step]
        out.append(Exchange(step, me ^ step, peer, sends.get(peer, []), recvs.get(peer, [])))
    return out


def stream_sizes(transfers: Sequence[Transfer], n_kinds: int) -> List[int]:
    """The slice sizes of the stream of ``transfers`` with ``n_kinds`` state kinds each (elements)."""
    return [t.numel for t in transfers for _ in range(n_kinds)]


def chunk_ranges(sizes: Sequence[int], limit: int) -> List[Tuple[int, int]]:
    """Cut a stream of slices of ``sizes`` elements into ranges ``[a, b)`` of at most ``limit``
    elements, at slice boundaries where possible: slices smaller than ``limit`` are packed
    together, larger ones are cut in pieces of ``limit`` and sent without a copy. Depends only
    on the slice sizes, which both sides of a pair share, so both cut at the same offsets."""
    out: List[Tuple[int, int]] = []
    a = None
    s0 = 0
    for n in sizes:
        if a is not None and s0 + n - a > limit:
            out.append((a, s0))
            a = None
        if n >= limit:
            full = n // limit * limit
            out.extend((s0 + i, s0 + i + limit) for i in range(0, full, limit))
            if full < n:
                a = s0 + full
        elif a is None:
            a = s0
        s0 += n
    if a is not None and a < s0:
        out.append((a, s0))
    return out


class Stream:
    """The ordered slices one side of a pair sends (or receives): transfers x kinds."""

    def __init__(self, parts, kinds: Sequence[str], transfers: List[Transfer], side: str):
        self.slices: List[torch.Tensor] = []
        self.starts: List[int] = []
        pos = 0
        for t in transfers:
            off, part = (t.src_offset, t.group) if side == "src" else (t.dst_offset, t.dst_group)
            for k in kinds:
                self.starts.append(pos)
                self.slices.append(parts[part][k].narrow(0, off, t.numel))
                pos += t.numel
        self.numel = pos

    def chunks(self, limit: int) -> List[Tuple[int, int]]:
        """The stream cut into ranges of at most ``limit`` elements (:func:`chunk_ranges`)."""
        return chunk_ranges([sl.numel() for sl in self.slices], limit)

    def pieces(self, a: int, b: int):
        """``(slice view, offset in the chunk)`` for the stream range ``[a, b)``."""
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        while i < len(self.slices) and self.starts[i] < b:
            s0 = self.starts[i]
            lo, hi = max(a, s0), min(b, s0 + self.slices[i].numel())
            if lo < hi:
                yield self.slices[i].narrow(0, lo - s0, hi - lo), lo - a
            i += 1

    def view(self, a: int, b: int) -> Optional[torch.Tensor]:
        """The range ``[a, b)`` as one view when it lies inside one host-memory slice, else None
        (slices on an accelerator are staged through host buffers: the data plane is gloo)."""
        pieces = list(self.pieces(a, b))
        if len(pieces) == 1 and pieces[0][0].numel() == b - a and pieces[0][0].device.type == "cpu":
            return pieces[0][0]
        return None
