"""The transition engine: executes a :class:`~ds_dynatrain.planner.Plan` between processes.

It moves bytes and interprets nothing (DynaTrain, "State Transition Engine"):

* **Pairing.** The processes of the transition (the old members plus the joiners, ranked in
  that order) exchange in steps: in step ``s`` (1 ≤ s < the next power of two above their
  count) process ``i`` exchanges with ``i XOR s`` if that process exists. The relation is
  symmetric, so both sides of a pair are in the same step, and every ordered pair of distinct
  processes meets in exactly one step (:func:`pair_schedule`). Within a pair, each side posts
  its receive, then its send, then waits for both, so no ordering between peers can deadlock.
* **Packing.** Everything process ``i`` sends to ``j`` is one *stream*: the plan's transfers
  ``i → j`` in plan order, each with the state kinds in a fixed order. The stream is cut into
  chunks of at most ``max_inflight_bytes / 2`` per direction, at slice boundaries where
  possible (:meth:`_Stream.chunks`); both sides cut at the same element offsets, so they agree
  on every message without a word. A chunk is one contiguous buffer and one send: a view of
  the partition when it lies inside one slice (no copy), else a packed buffer of small slices;
  the receiver unpacks straight into its new partitions.
* **Bounded memory.** Messages in flight, and packing buffers, never exceed
  ``max_inflight_bytes`` per process at any time (one chunk each way);
  :attr:`TransitionStats.peak_staging_bytes` records the largest packing footprint.
* **Timeouts.** Every wait has a timeout; an error names the peer, the step and the chunk.

The data plane is a gloo process-group object (:func:`transition_group` makes a private one that
survives the re-forming of the default group, so a transfer may continue in the background while
the new engine is built: :func:`start_plan`). Partitions on an accelerator are staged through host
buffers.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as tdist

from .errors import TransitionAbortedError
from .planner import Plan, Transfer

DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20

# A seam for fault injection in tests: called as ``hook(step, chunk)`` before each chunk is posted.
fault_hook: Optional[Callable[[int, int], None]] = None


@dataclass
class TransitionStats:
    """What one process did in a transition (bytes, seconds)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_kept: int = 0
    seconds: float = 0.0       # the whole call: local copies and exchanges
    keep_seconds: float = 0.0  # local copies of kept elements
    messages: int = 0
    peak_staging_bytes: int = 0  # largest packing buffers alive at once


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
    return [[(i, i ^ s) for i in range(world_size) if i < (i ^ s) < world_size]
            for s in range(1, next_pow2(world_size))]


def transition_ranks(plan: Plan) -> Tuple[str, ...]:
    """Members of the transition in rank order: the old members, then the joiners."""
    return tuple(plan.old_members) + plan.joiners


def transition_group(store, prefix: str, members: Sequence[str], member: str, timeout_s: float):
    """A private gloo process group over ``members`` for one transition, on store prefix
    ``prefix`` (:func:`~ds_dynatrain.membership.group_prefix` with ``kind="xfer"``).

    Not registered as a ``torch.distributed`` group, so switching the default group (a shrink)
    leaves it working; shut it down when the transfer is over. Collective: every process in
    ``members`` calls it (it may run in a background thread).

    Raises:
        TransitionAbortedError: the rendezvous did not complete within ``timeout_s``.
    """
    rank = list(members).index(member)
    try:
        return tdist.ProcessGroupGloo(tdist.PrefixStore(prefix, store), rank, len(members),
                                      timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise TransitionAbortedError(f"transition group {prefix}: rank {rank} of {len(members)} "
                                     f"could not form it within {timeout_s:.0f} s: {err}") from err


class _Stream:
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
        """Cut the stream into ranges ``[a, b)`` of at most ``limit`` elements, at slice
        boundaries where possible: slices smaller than ``limit`` are packed together, larger
        ones are cut in pieces of ``limit`` and sent without a copy. Depends only on the slice
        sizes, which both sides of a pair share, so both cut at the same offsets."""
        out: List[Tuple[int, int]] = []
        a = None
        for s0, sl in zip(self.starts, self.slices):
            n = sl.numel()
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
        if a is not None and a < self.numel:
            out.append((a, self.numel))
        return out

    def pieces(self, a: int, b: int):
        """``(slice view, offset in the chunk)`` for the stream range ``[a, b)``."""
        import bisect
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


def _state_dtype(kinds, *parts_list):
    dtype = None
    for parts in parts_list:
        for g in (parts.values() if isinstance(parts, dict) else parts or ()):
            for k in kinds:
                if dtype is None:
                    dtype = g[k].dtype
                elif g[k].dtype != dtype:
                    raise TransitionAbortedError(f"state kind {k} has dtype {g[k].dtype}, expected {dtype}")
    return dtype or torch.float32


def execute_plan(plan: Plan, member: str, group, kinds: Sequence[str],
                 sources: Optional[Dict[int, Dict[str, torch.Tensor]]],
                 dests: Optional[Dict[int, Dict[str, torch.Tensor]]], timeout_s: float,
                 max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                 ranks: Optional[Sequence[str]] = None, progress: Optional[dict] = None) -> TransitionStats:
    """Move this process's share of ``plan``: keeps, then the XOR-paired exchanges.

    Args:
        plan: the plan, identical on every process.
        member: this process's member id.
        group: process-group object over ``ranks`` (``send``/``recv`` of lists of CPU tensors),
            e.g. :func:`transition_group`, or the default group when its ranks are ``ranks``.
        kinds: state kinds to move, same order on every process (e.g. ``exp_avg, exp_avg_sq``).
        sources: this process's old partitions, ``parts[group][kind]`` a 1-D tensor (a dict or a
            list indexed by group); None for a joiner.
        dests: this process's new partitions, same form; None for a leaver. Written in place
            (elements no transfer covers are left untouched).
        timeout_s: limit of each wait, seconds.
        max_inflight_bytes: bound of the bytes in flight (sent plus received, packing buffers
            included) per process at any moment; at least one element each way.
        ranks: member of each rank of ``group`` (default :func:`transition_ranks`).
        progress: if given, updated with the peer and stage being exchanged (for reports).

    Returns:
        :class:`TransitionStats` of this process.

    Raises:
        TransitionAbortedError: a send or receive failed or timed out (names the peer, the step
            and the chunk), or the state kinds have different dtypes.
    """
    t0 = time.perf_counter()
    stats = TransitionStats()
    progress = progress if progress is not None else {}
    kinds = tuple(kinds)
    if not kinds:
        return stats
    dtype = _state_dtype(kinds, sources, dests)
    elsize = torch.empty((), dtype=dtype).element_size()
    ranks = tuple(ranks) if ranks is not None else transition_ranks(plan)
    me = ranks.index(member)
    n = len(ranks)
    chunk = max(1, max_inflight_bytes // (2 * elsize))  # elements per direction per message

    if sources is not None and dests is not None:
        t_keep = time.perf_counter()
        for t in plan.keeps_of(member):
            for k in kinds:
                dests[t.dst_group][k].narrow(0, t.dst_offset, t.numel).copy_(
                    sources[t.group][k].narrow(0, t.src_offset, t.numel))
            stats.bytes_kept += t.numel * len(kinds) * elsize
        stats.keep_seconds = time.perf_counter() - t_keep

    sends, recvs = plan.sends_of(member), plan.receives_of(member)
    timeout = timedelta(seconds=timeout_s)
    for step in range(1, next_pow2(n)):
        p = peer_at(me, step, n)
        if p is None:
            continue
        peer = ranks[p]
        out = _Stream(sources, kinds, sends[peer], "src") if peer in sends else None
        inn = _Stream(dests, kinds, recvs[peer], "dst") if peer in recvs else None
        out_chunks = out.chunks(chunk) if out else []
        in_chunks = inn.chunks(chunk) if inn else []
        nchunks = max(len(out_chunks), len(in_chunks))
        for c in range(nchunks):
            if fault_hook is not None:
                fault_hook(step, c)
            where = f"step {step}, chunk {c + 1}/{nchunks}"
            progress.update(peer=peer, where=where)
            staging = 0
            rbuf = rview = None
            works = []
            current = "posting messages to"
            try:
                if c < len(in_chunks):
                    a, b = in_chunks[c]
                    rview = inn.view(a, b)
                    if rview is None:
                        rbuf = torch.empty(b - a, dtype=dtype)
                        staging += rbuf.numel() * elsize
                    works.append(("receive from", group.recv([rview if rview is not None else rbuf], p, step)))
                if c < len(out_chunks):
                    a, b = out_chunks[c]
                    sbuf = out.view(a, b)
                    if sbuf is None:
                        sbuf = torch.empty(b - a, dtype=dtype)
                        staging += sbuf.numel() * elsize
                        for piece, pos in out.pieces(a, b):
                            sbuf.narrow(0, pos, piece.numel()).copy_(piece)
                    works.append(("send to", group.send([sbuf], p, step)))
                    stats.bytes_sent += sbuf.numel() * elsize
                stats.peak_staging_bytes = max(stats.peak_staging_bytes, staging)
                for what, w in works:
                    current = what
                    w.wait(timeout)
            except RuntimeError as err:
                raise TransitionAbortedError(
                    f"transition: {current} member {peer} (transition rank {p}) failed at {where} "
                    f"(wait limit {timeout_s:.0f} s): {err}") from err
            stats.messages += len(works)
            if c < len(in_chunks):
                a, b = in_chunks[c]
                if rbuf is not None:
                    for piece, pos in inn.pieces(a, b):
                        piece.copy_(rbuf.narrow(0, pos, piece.numel()))
                stats.bytes_received += (b - a) * elsize
    stats.seconds = time.perf_counter() - t0
    return stats


class PendingTransition:
    """A transition running in a background thread (:func:`start_plan`)."""

    def __init__(self, target, *args, **kwargs):
        self._stats: Optional[TransitionStats] = None
        self._error: Optional[BaseException] = None
        self.started = time.perf_counter()
        self.finished: Optional[float] = None
        self.progress: dict = {}
        kwargs["progress"] = self.progress

        def run():
            try:
                self._stats = target(*args, **kwargs)
            except BaseException as err:  # handed to the waiting thread
                self._error = err
            finally:
                self.finished = time.perf_counter()

        self._thread = threading.Thread(target=run, name="dynatrain-transition", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout_s: Optional[float] = None) -> TransitionStats:
        """Block until the transfer is complete; returns its stats.

        Every wait inside the transfer has its own timeout, so without ``timeout_s`` this
        returns or raises within (number of messages) x the per-message timeout.

        Raises:
            TransitionAbortedError: the transfer failed (the background error, naming the peer,
                step and chunk), or it did not finish within ``timeout_s`` seconds.
        """
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TransitionAbortedError(
                f"transition: background transfer still running after {timeout_s:.0f} s, exchanging with member "
                f"{self.progress.get('peer')} at {self.progress.get('where')}")
        if self._error is not None:
            if isinstance(self._error, TransitionAbortedError):
                raise TransitionAbortedError(str(self._error)) from self._error
            raise TransitionAbortedError(f"transition: background transfer failed: {self._error}") from self._error
        return self._stats


def start_plan(*args, **kwargs) -> PendingTransition:
    """:func:`execute_plan` in a background thread; same arguments. The caller must not touch
    ``sources`` or ``dests`` until :meth:`PendingTransition.wait` returns."""
    return PendingTransition(execute_plan, *args, **kwargs)
