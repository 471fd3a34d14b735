"""Executing a box plan (a change of TP and DP degree) on one process: strided copies in and out
of flat partitions, over point-to-point messages of a process group (no DeepSpeed).

Every row of a :class:`~ds_dynatrain.planner.tp_plan.TpPlan` is a box: ``rows`` runs of ``cols``
elements, run ``k`` at ``offset + k * stride`` of a flat partition on each side. A process packs
the boxes it sends to one peer, for every state kind, into one contiguous message (``as_strided``
views copied with one ``torch.cat``), in the plan's row order, which the receiver walks in the
same order to scatter the message into its new partitions. Boxes it keeps are copied locally.
All messages of a process are posted at once (``isend``/``irecv``), so no pair waits for another.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as tdist

from ..errors import TransitionAbortedError


@dataclass
class BoxTransferStats:
    """What one process moved: bytes sent and received, messages, wall seconds of the exchange
    and of the local keeps."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    exchange_seconds: float = 0.0
    keep_seconds: float = 0.0


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
) -> BoxTransferStats:
    """Move this process's rows of a box plan.

    Args:
        table: the plan's rows (int64 ``(n, 11)``, columns ``TP_COLUMNS``), the same on every
            process; its old ranks are ranks of ``group``.
        rank: this process's old rank (its rank in ``group``).
        old: per old partition, ``{kind: 1-D tensor}`` (read); new: the same for the new
            partitions (written where the plan says; the rest is left as it is), None in a
            process that takes no new rank.
        kinds: the state kinds to move, in the same order on every process.
        group: the process group of the messages (default: the world).
        new_rank: this process's new rank (-1: the same as ``rank``; None: it takes none).
        peer_of_new: the rank in ``group`` of each new rank's process (default: the same number).

    Raises:
        TransitionAbortedError: a message failed (a peer died), naming the peer.
    """
    stats = BoxTransferStats()
    new_rank = rank if new_rank == -1 else new_rank
    n_new = int(table[:, 1].max()) + 1 if len(table) else 0
    peer = np.arange(n_new) if peer_of_new is None else np.asarray(peer_of_new, dtype=np.int64)
    src, dst = table[:, 0], table[:, 1]
    dst_peer = peer[dst] if len(table) else dst
    mine_out = table[(src == rank) & (dst_peer != rank)]
    mine_in = table[(dst == (-2 if new_rank is None else new_rank)) & (src != rank)]
    keeps = table[(src == rank) & (dst_peer == rank)]
    t0 = time.perf_counter()
    recvs: List[tuple] = []
    works = []
    for peer_rank in np.unique(mine_in[:, 0]):
        rows = mine_in[mine_in[:, 0] == peer_rank]
        n = int((rows[:, 9] * rows[:, 10]).sum()) * len(kinds)
        buf = torch.empty(n, dtype=old[0][kinds[0]].dtype)
        recvs.append((int(peer_rank), rows, buf))
        works.append((int(peer_rank), tdist.irecv(buf, src=int(peer_rank), group=group)))
        stats.bytes_received += buf.numel() * buf.element_size()
    out_peer = peer[mine_out[:, 1]] if len(mine_out) else mine_out[:, 1]
    for peer_rank in np.unique(out_peer):
        rows = mine_out[out_peer == peer_rank]
        parts = [
            _view(old[g][k], so, ss, r, c).reshape(-1) for k in kinds for _, _, _, g, so, ss, _, _, _, r, c in rows
        ]
        buf = torch.cat(parts) if parts else torch.empty(0)
        works.append((int(peer_rank), tdist.isend(buf, dst=int(peer_rank), group=group)))
        stats.bytes_sent += buf.numel() * buf.element_size()
    stats.messages = len(works)
    t1 = time.perf_counter()
    with torch.no_grad():
        for _, _, _, g, so, ss, dg, do, ds, r, c in keeps:
            for k in kinds:
                _view(new[dg][k], do, ds, r, c).copy_(_view(old[g][k], so, ss, r, c))
    stats.keep_seconds = time.perf_counter() - t1
    for peer, w in works:
        try:
            w.wait()
        except RuntimeError as err:
            raise TransitionAbortedError(f"box transfer with rank {peer} failed: {err}") from err
    with torch.no_grad():
        for _, rows, buf in recvs:
            pos = 0
            for k in kinds:
                for _, _, _, _, _, _, dg, do, ds, r, c in rows:
                    n = r * c
                    _view(new[dg][k], do, ds, r, c).copy_(buf[pos : pos + n].view(r, c))
                    pos += n
    stats.exchange_seconds = time.perf_counter() - t0 - stats.keep_seconds
    return stats
