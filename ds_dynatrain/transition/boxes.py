"""Executing a box plan (a change of TP and DP degree) on one process: strided copies in and out
of flat partitions, over point-to-point messages of a process group (no DeepSpeed).

Every row of a :class:`~ds_dynatrain.planner.tp_plan.BoxPlan` is a box: ``rows`` runs of ``cols``
elements, run ``k`` at ``offset + k * stride`` of a flat partition on each side. A process packs
the boxes it sends to one peer, for every state kind, into contiguous messages of a bounded size
(``as_strided`` views copied into it once; a box larger than a message is cut by its
rows), in the plan's row order, which the receiver walks in the same order to scatter each message
into its new partitions. Messages go in rounds: in each, a process posts its next message to and
from every peer at once (``isend``/``irecv``), so no pair waits for another; round ``i + 1`` is
posted (its messages packed) before round ``i`` is waited for and scattered, so packing and
scattering overlap the wire, with two half-size messages per peer and direction in staging. Boxes
it keeps are copied while the first round travels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as tdist

from ..errors import TransitionAbortedError

MESSAGE_BYTES = 64 << 20  # a quarter of the default dynatrain.max_inflight_bytes, as a DP resize's messages


@dataclass
class BoxTransferStats:
    """What one process moved: bytes sent and received, messages, wall seconds of the exchange
    and of the local keeps, the largest message buffers alive at once (bytes)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    exchange_seconds: float = 0.0
    keep_seconds: float = 0.0
    peak_staging_bytes: int = 0


def _view(flat: torch.Tensor, offset: int, stride: int, rows: int, cols: int) -> torch.Tensor:
    return flat.as_strided((rows, cols), (stride, 1), flat.storage_offset() + offset)


def execute_box_plan(
    table: np.ndarray,
    rank: int,
    old: Sequence[Dict[str, torch.Tensor]],
    new: Optional[Sequence[Dict[str, torch.Tensor]]],
    kinds: Sequence[str],
    group=None,
    new_rank: Optional[int] = -1,
    peer_of_new: Optional[Sequence[int]] = None,
    message_bytes: int = MESSAGE_BYTES,
) -> BoxTransferStats:
    """Move this process's rows of a box plan.

    Args:
        table: the plan's rows (int64 ``(n, 11)``, columns ``TP_COLUMNS``), the same on every
            process; its old ranks are ranks of ``group``.
        rank: this process's old rank (its rank in ``group``).
        old: per old partition, ``{kind: 1-D tensor}`` (read; empty in a process that held no
            old rank, a joiner); new: the same for the new
            partitions (written where the plan says; the rest is left as it is), None in a
            process that takes no new rank.
        kinds: the state kinds to move, in the same order on every process.
        group: the process group of the messages (default: the world).
        new_rank: this process's new rank (-1: the same as ``rank``; None: it takes none).
        peer_of_new: the rank in ``group`` of each new rank's process (default: the same number).
        message_bytes: the staging per peer and direction (bytes, every state kind together):
            two messages of at most half of it are in flight, so a process's staging stays
            within ``message_bytes`` times its peers, both ways.

    Raises:
        TransitionAbortedError: a message failed (a peer died), naming the peer.
    """
    stats = BoxTransferStats()
    new_rank = rank if new_rank == -1 else new_rank
    n_new = int(table[:, 1].max()) + 1 if len(table) else 0
    peer = np.arange(n_new) if peer_of_new is None else np.asarray(peer_of_new, dtype=np.int64)
    src, dst = table[:, 0], table[:, 1]
    dst_peer = peer[dst] if len(table) else dst
    out_rows = table[(src == rank) & (dst_peer != rank)]
    in_rows = table[(dst == (-2 if new_rank is None else new_rank)) & (src != rank)]
    keeps = table[(src == rank) & (dst_peer == rank)]
    t0 = time.perf_counter()
    dtype = (old[0] if old else new[0])[kinds[0]].dtype  # a joiner holds no old partition
    per_element = len(kinds) * torch.empty((), dtype=dtype).element_size()
    # two messages per peer and direction in flight, each half the budget: one travels while the
    # next is packed or the last scattered
    limit = max(1, message_bytes // 2 // per_element)  # elements of one box of every kind per message
    out_peer = peer[out_rows[:, 1]] if len(out_rows) else out_rows[:, 1]
    sends = {int(q): _messages(out_rows[out_peer == q], limit) for q in np.unique(out_peer)}
    recvs = {int(q): _messages(in_rows[in_rows[:, 0] == q], limit) for q in np.unique(in_rows[:, 0])}
    rounds = max([len(m) for m in sends.values()] + [len(m) for m in recvs.values()] + [0])
    staging = _staging(sends, recvs, len(kinds), dtype)
    stats.peak_staging_bytes = sum(b.numel() * b.element_size() for b in staging.values())
    pending = _post(0, sends, recvs, old, kinds, staging, group, stats) if rounds else None
    t = time.perf_counter()
    with torch.no_grad():  # the boxes kept in place, while the first messages travel
        for _, _, _, g, so, ss, dg, do, ds, r, c in keeps:
            for k in kinds:
                _view(new[dg][k], do, ds, r, c).copy_(_view(old[g][k], so, ss, r, c))
    stats.keep_seconds = time.perf_counter() - t
    for i in range(rounds):
        following = _post(i + 1, sends, recvs, old, kinds, staging, group, stats) if i + 1 < rounds else None
        _land(pending, new, kinds)
        pending = following
    stats.exchange_seconds = time.perf_counter() - t0 - stats.keep_seconds
    return stats


def _numel(msg: np.ndarray, kinds: int) -> int:
    return int((msg[:, 9] * msg[:, 10]).sum()) * kinds


def _staging(sends, recvs, kinds: int, dtype) -> Dict[tuple, torch.Tensor]:
    """Two buffers per peer and direction (messages ``i`` and ``i + 1`` in flight), each the size of
    the peer's largest message, reused by every round (a fresh buffer per message costs its page
    faults again each round)."""
    out = {}
    for way, table in (("send", sends), ("recv", recvs)):
        for q, msgs in table.items():
            size = max(_numel(m, kinds) for m in msgs)
            for slot in (0, 1):
                out[way, q, slot] = torch.empty(size if slot < len(msgs) else 0, dtype=dtype)
    return out


def _post(i: int, sends, recvs, old, kinds, staging, group, stats: BoxTransferStats):
    """Message ``i`` of every peer, both directions, posted: receives into slot ``i % 2``, sends
    packed into theirs (free: message ``i - 2`` has landed). Returns what :func:`_land` waits
    for."""
    works, landed = [], []
    for q, msgs in recvs.items():
        if i < len(msgs):
            buf = staging["recv", q, i % 2][: _numel(msgs[i], len(kinds))]
            works.append((q, tdist.irecv(buf, src=q, group=group)))
            landed.append((msgs[i], buf))
            stats.bytes_received += buf.numel() * buf.element_size()
    for q, msgs in sends.items():
        if i < len(msgs):
            buf = staging["send", q, i % 2][: _numel(msgs[i], len(kinds))]
            pos = 0
            with torch.no_grad():
                for k in kinds:  # one copy from the strided source into the message
                    for _, _, _, g, so, ss, *_, r, c in msgs[i]:
                        buf[pos : pos + r * c].view(r, c).copy_(_view(old[g][k], so, ss, r, c))
                        pos += r * c
            works.append((q, tdist.isend(buf, dst=q, group=group)))
            stats.bytes_sent += buf.numel() * buf.element_size()
    stats.messages += len(works)
    return works, landed


def _land(pending, new, kinds) -> None:
    """Wait for one round's messages and scatter the received ones into the new partitions."""
    works, landed = pending
    for q, w in works:
        try:
            w.wait()
        except RuntimeError as err:
            raise TransitionAbortedError(f"box transfer with rank {q} failed: {err}") from err
    with torch.no_grad():
        for rows, buf in landed:
            pos = 0
            for k in kinds:
                for *_, dg, do, ds, r, c in rows:
                    _view(new[dg][k], do, ds, r, c).copy_(buf[pos : pos + r * c].view(r, c))
                    pos += r * c


def _messages(rows: np.ndarray, limit: int) -> List[np.ndarray]:
    """``rows`` (in plan order) cut into messages of at most ``limit`` elements per state kind; a
    box larger than that is cut by its rows, and a row longer than ``limit`` by its columns.
    Sender and receiver cut the same rows the same way."""
    out, cur, size = [], [], 0
    for row in rows:
        for piece in _pieces(row, limit):
            n = int(piece[9] * piece[10])
            if cur and size + n > limit:
                out.append(np.stack(cur))
                cur, size = [], 0
            cur.append(piece)
            size += n
    if cur:
        out.append(np.stack(cur))
    return out


def _pieces(row: np.ndarray, limit: int):
    """One box row cut into boxes of at most ``limit`` elements: whole runs while a run fits,
    else single runs cut into column ranges."""
    r, c = int(row[9]), int(row[10])
    if c <= limit:
        step = max(1, limit // max(c, 1))
        for k0 in range(0, r, step):
            piece = row.copy()
            piece[4] += k0 * row[5]
            piece[7] += k0 * row[8]
            piece[9] = min(step, r - k0)
            yield piece
        return
    for k in range(r):
        for c0 in range(0, c, limit):
            piece = row.copy()
            piece[4] += k * row[5] + c0
            piece[7] += k * row[8] + c0
            piece[9], piece[10] = 1, min(limit, c - c0)
            yield piece
