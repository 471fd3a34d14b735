"""The transition engine: executes a :class:`~ds_dynatrain.planner.Plan` between processes.

It moves bytes and interprets nothing (DynaTrain, "State Transition Engine"):

* **Pairing.** The processes of the transition (the old members plus the joiners, ranked in
  that order) exchange in steps: in step ``s`` (1 ≤ s < the next power of two above their
  count) process ``i`` exchanges with ``i XOR s`` if that process exists. The relation is
  symmetric, so both sides of a pair are in the same step, and every ordered pair of distinct
  processes meets in exactly one step (:func:`pair_schedule`). Within a pair, each side posts
  a chunk's receive, then its send, and waits for a chunk only after posting the next one, so
  no ordering between peers can deadlock and the next chunk is packed and posted while the
  last one moves (:data:`WINDOW` chunks in flight).
* **Packing.** Everything process ``i`` sends to ``j`` is one *stream*: the plan's transfers
  ``i → j`` in plan order, each with the state kinds in a fixed order. The stream is cut into
  chunks of at most ``max_inflight_bytes / (2 * WINDOW)``, at slice boundaries where
  possible (:meth:`~ds_dynatrain.transition.schedule.Stream.chunks`); both sides cut at the
  same element offsets, so they agree on every message without a word. A chunk is one
  contiguous buffer and one send: a view of the partition when it lies inside one slice (no
  copy), else a packed buffer of small slices; the receiver unpacks straight into its new
  partitions.
* **Bounded memory.** Messages in flight, and packing buffers, never exceed
  ``max_inflight_bytes`` per process at any time (:data:`WINDOW` chunks each way);
  :attr:`TransitionStats.peak_staging_bytes` records the largest packing footprint.
* **Exchanges first.** The local copies of the elements a process keeps come after its exchanges:
  a peer waiting for this process's receives would otherwise sit idle while it copies.
* **Timeouts.** Every wait has a timeout; an error names the peer, the step and the chunk.

The data plane is a gloo process-group object (:func:`transition_group` makes a private one that
survives the re-forming of the default group, so a transfer may continue in the background while
the new engine is built: :func:`start_plan`). Partitions on an accelerator are staged through host
buffers.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as tdist

from ..errors import TransitionAbortedError
from ..planner.plan import Plan
from .background import BackgroundCall
from .schedule import Stream, exchanges, transition_members, transition_ranks  # noqa: F401 (re-exported)

DEFAULT_MAX_INFLIGHT_BYTES = 256 << 20
WINDOW = 2  # chunks in flight per pair: the next is posted while the last one moves

# A seam for fault injection in tests: called as ``hook(step, chunk)`` before each chunk is posted.
fault_hook: Optional[Callable[[int, int], None]] = None


@dataclass
class TransitionStats:
    """What one process did in a transition (bytes, seconds)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_kept: int = 0
    seconds: float = 0.0  # the whole call: local copies and exchanges
    keep_seconds: float = 0.0  # local copies of kept elements
    exchange_seconds: float = 0.0  # the exchanges: first message posted to last message done
    messages: int = 0
    peak_staging_bytes: int = 0  # largest packing buffers alive at once


def transition_group(store, prefix: str, members: Sequence[str], member: str, timeout_s: float):
    """A private gloo process group over ``members`` for one transition, on store prefix
    ``prefix`` (:func:`~ds_dynatrain.elastic.keys.group_prefix` with ``kind="xfer"``).

    Not registered as a ``torch.distributed`` group, so switching the default group (a shrink)
    leaves it working; shut it down when the transfer is over. Collective: every process in
    ``members`` calls it (it may run in a background thread).

    Raises:
        TransitionAbortedError: the rendezvous did not complete within ``timeout_s``.
    """
    rank = list(members).index(member)
    try:
        return tdist.ProcessGroupGloo(
            tdist.PrefixStore(prefix, store), rank, len(members), timedelta(seconds=timeout_s)
        )
    except RuntimeError as err:
        raise TransitionAbortedError(
            f"transition group {prefix}: rank {rank} of {len(members)} "
            f"could not form it within {timeout_s:.0f} s: {err}"
        ) from err


def _state_dtype(kinds, *parts_list):
    dtype = None
    for parts in parts_list:
        for g in parts.values() if isinstance(parts, dict) else parts or ():
            for k in kinds:
                if dtype is None:
                    dtype = g[k].dtype
                elif g[k].dtype != dtype:
                    raise TransitionAbortedError(f"state kind {k} has dtype {g[k].dtype}, expected {dtype}")
    return dtype or torch.float32


def execute_plan(
    plan: Plan,
    member: str,
    group,
    kinds: Sequence[str],
    sources: Optional[Dict[int, Dict[str, torch.Tensor]]],
    dests: Optional[Dict[int, Dict[str, torch.Tensor]]],
    timeout_s: float,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    ranks: Optional[Sequence[str]] = None,
    progress: Optional[dict] = None,
) -> TransitionStats:
    """Move this process's share of ``plan``: the XOR-paired exchanges, then the local copies of
    the elements this process keeps.

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
            included) per process at any moment; at least one element per message.
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
    chunk = max(1, max_inflight_bytes // (2 * WINDOW * elsize))  # elements of one message

    for ex in exchanges(plan, member, ranks):
        out = Stream(sources, kinds, ex.sends, "src") if ex.sends else None
        inn = Stream(dests, kinds, ex.receives, "dst") if ex.receives else None
        t = time.perf_counter()
        _exchange(group, _Peer(ex.peer, ex.member, ex.step), out, inn, chunk, dtype, timeout_s, stats, progress)
        stats.exchange_seconds += time.perf_counter() - t
    if sources is not None and dests is not None:
        _copy_keeps(plan, member, kinds, sources, dests, elsize, stats)
    stats.seconds = time.perf_counter() - t0
    return stats


def _copy_keeps(
    plan: Plan, member: str, kinds: Tuple[str, ...], sources, dests, elsize: int, stats: TransitionStats
) -> None:
    """The local copies of the elements ``member`` keeps (its old and new partitions)."""
    t_keep = time.perf_counter()
    for t in plan.keeps_of(member):
        for k in kinds:
            dests[t.dst_group][k].narrow(0, t.dst_offset, t.numel).copy_(
                sources[t.group][k].narrow(0, t.src_offset, t.numel)
            )
        stats.bytes_kept += t.numel * len(kinds) * elsize
    stats.keep_seconds = time.perf_counter() - t_keep


@dataclass(frozen=True)
class _Peer:
    """The other side of one exchange: its transition rank, member id, and the XOR step."""

    rank: int
    member: str
    step: int


@dataclass
class _Posted:
    """One chunk's messages in flight: its index, the ``(what, work)`` pairs to wait for, the
    receive staging buffer to unpack (None: received in place), and the packing bytes it holds."""

    index: int
    works: List[Tuple[str, object]]
    recv: Optional[Tuple[int, int]]
    rbuf: Optional[torch.Tensor]
    staged: int
    sbuf: Optional[torch.Tensor] = None  # what is being sent, alive until the send completes


def _exchange(
    group,
    peer: _Peer,
    out: Optional[Stream],
    inn: Optional[Stream],
    chunk: int,
    dtype: torch.dtype,
    timeout_s: float,
    stats: TransitionStats,
    progress: dict,
) -> None:
    """Both directions of one pair's exchange, chunk by chunk, with up to :data:`WINDOW` chunks
    in flight: post a chunk's receive, then its send, and wait for a chunk only when the window
    is full, so the next chunk is packed and posted while the last one moves. Each side posts
    its receives before its sends and both walk the chunks in the same order, so no ordering
    between peers can deadlock."""
    out_chunks = out.chunks(chunk) if out else []
    in_chunks = inn.chunks(chunk) if inn else []
    nchunks = max(len(out_chunks), len(in_chunks))
    elsize = torch.empty((), dtype=dtype).element_size()
    window: Deque[_Posted] = deque()
    try:
        for c in range(nchunks):
            if fault_hook is not None:
                fault_hook(peer.step, c)
            progress.update(peer=peer.member, where=_where(peer, c, nchunks))
            recv = in_chunks[c] if c < len(in_chunks) else None
            send = out_chunks[c] if c < len(out_chunks) else None
            window.append(_post(group, peer, c, nchunks, inn, recv, out, send, dtype, elsize, stats))
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, sum(w.staged for w in window))
            if len(window) == WINDOW:
                _complete(window.popleft(), peer, nchunks, inn, elsize, timeout_s, stats)
        while window:
            _complete(window.popleft(), peer, nchunks, inn, elsize, timeout_s, stats)
    except BaseException:
        for posted in window:  # let what is still in flight fail or finish before its buffers go
            for _, w in posted.works:
                try:
                    w.wait(timedelta(seconds=min(timeout_s, 5.0)))
                except RuntimeError:
                    pass
        raise


def _where(peer: _Peer, c: int, nchunks: int) -> str:
    return f"step {peer.step}, chunk {c + 1}/{nchunks}"


def _post(group, peer: _Peer, c: int, nchunks: int, inn, recv, out, send, dtype, elsize: int, stats) -> _Posted:
    """Post chunk ``c``'s receive (into place when it is one view, else into a staging buffer)
    and send (from place, else packed). Its tag tells it from the other chunks in flight.

    Raises:
        TransitionAbortedError: naming the peer, the step and the chunk.
    """
    tag = peer.step * WINDOW + c % WINDOW
    posted = _Posted(c, [], recv, None, 0)
    current = "posting a receive from"
    try:
        if recv is not None:
            a, b = recv
            rview = inn.view(a, b)
            if rview is None:
                posted.rbuf = rview = torch.empty(b - a, dtype=dtype)
                posted.staged += rview.numel() * elsize
            posted.works.append(("receive from", group.recv([rview], peer.rank, tag)))
        if send is not None:
            current = "posting a send to"
            a, b = send
            sbuf = out.view(a, b)
            if sbuf is None:
                sbuf = torch.empty(b - a, dtype=dtype)
                posted.staged += sbuf.numel() * elsize
                for piece, pos in out.pieces(a, b):
                    sbuf.narrow(0, pos, piece.numel()).copy_(piece)
            posted.works.append(("send to", group.send([sbuf], peer.rank, tag)))
            posted.sbuf = sbuf
            stats.bytes_sent += sbuf.numel() * elsize
    except RuntimeError as err:
        raise _aborted(current, peer, _where(peer, c, nchunks), None, err) from err
    return posted


def _complete(posted: _Posted, peer: _Peer, nchunks: int, inn, elsize: int, timeout_s: float, stats) -> None:
    """Wait for one posted chunk's messages; unpack a staged receive into the new partitions.

    Raises:
        TransitionAbortedError: naming the peer, the step and the chunk.
    """
    timeout = timedelta(seconds=timeout_s)
    for what, w in posted.works:
        try:
            w.wait(timeout)
        except RuntimeError as err:
            raise _aborted(what, peer, _where(peer, posted.index, nchunks), timeout_s, err) from err
    stats.messages += len(posted.works)
    posted.works, posted.sbuf = [], None
    if posted.recv is not None:
        a, b = posted.recv
        if posted.rbuf is not None:
            for piece, pos in inn.pieces(a, b):
                piece.copy_(posted.rbuf.narrow(0, pos, piece.numel()))
        stats.bytes_received += (b - a) * elsize


def _aborted(what: str, peer: _Peer, where: str, timeout_s: Optional[float], err) -> TransitionAbortedError:
    limit = f" (wait limit {timeout_s:.0f} s)" if timeout_s is not None else ""
    return TransitionAbortedError(
        f"transition: {what} member {peer.member} (transition rank {peer.rank}) failed at {where}{limit}: {err}"
    )


class PendingTransition:
    """A transition running in a background thread (:func:`start_plan`)."""

    def __init__(self, target, *args, **kwargs):
        self.progress: dict = {}
        kwargs["progress"] = self.progress
        self._call = BackgroundCall(lambda: target(*args, **kwargs), "dynatrain-transition")

    def done(self) -> bool:
        return self._call.done()

    def wait(self, timeout_s: Optional[float] = None) -> TransitionStats:
        """Block until the transfer is complete; returns its stats.

        Every wait inside the transfer has its own timeout, so without ``timeout_s`` this
        returns or raises within (number of messages) x the per-message timeout.

        Raises:
            TransitionAbortedError: the transfer failed (the background error, naming the peer,
                step and chunk), or it did not finish within ``timeout_s`` seconds.
        """

        def late() -> str:
            return (
                f"transition: background transfer still running after {timeout_s:.0f} s, exchanging with member "
                f"{self.progress.get('peer')} at {self.progress.get('where')}"
            )

        return self._call.result(timeout_s, late, "transition: background transfer failed")


def start_plan(*args, **kwargs) -> PendingTransition:
    """:func:`execute_plan` in a background thread; same arguments. The caller must not touch
    ``sources`` or ``dests`` until :meth:`PendingTransition.wait` returns."""
    return PendingTransition(execute_plan, *args, **kwargs)
