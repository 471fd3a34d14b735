"""The transition engine: executes a :class:`~ds_dynatrain.planner.Plan` between processes.

It moves bytes and interprets nothing: for every peer, everything this process sends to it is
packed into one contiguous buffer (transfers in plan order, state kinds in a fixed order) and
sent with one message; the peer receives into one buffer and unpacks straight into its new
partitions. Keeps are local copies. All receives are posted before any send (gloo's
``irecv``/``isend``), so no ordering between peers can deadlock; every wait has a timeout and an
error names the peer.

Runs on the current default ``torch.distributed`` process group, which must contain every process
that sends or receives (the *transition group*: the old group for a shrink, the new one for a
grow).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as tdist

from .errors import TransitionAbortedError
from .planner import Plan, Transfer


@dataclass
class TransitionStats:
    """What one process did in a transition (bytes, seconds)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_kept: int = 0
    seconds: float = 0.0


def _slices(parts, kinds: Sequence[str], transfers: List[Transfer], side: str):
    for t in transfers:
        off = t.src_offset if side == "src" else t.dst_offset
        for k in kinds:
            yield parts[t.group][k].narrow(0, off, t.numel)


def execute_plan(plan: Plan, member: str, pg_rank_of: Dict[str, int], kinds: Sequence[str],
                 sources: Optional[Dict[int, Dict[str, torch.Tensor]]],
                 dests: Optional[Dict[int, Dict[str, torch.Tensor]]], timeout_s: float) -> TransitionStats:
    """Move this process's share of ``plan``.

    Args:
        plan: the plan, identical on every process.
        member: this process's member id.
        pg_rank_of: member id -> rank in the current default process group.
        kinds: state kinds to move, same order on every process (e.g. ``fp32, exp_avg, exp_avg_sq``).
        sources: this process's old partitions, ``parts[group][kind]`` is a 1-D tensor (a dict or a
            list indexed by group); None for a joiner.
        dests: this process's new partitions, same form; None for a leaver. Written in place.
        timeout_s: limit of each wait, seconds.

    Raises:
        TransitionAbortedError: a send or receive failed or timed out (names the peer and phase).
    """
    t0 = time.perf_counter()
    stats = TransitionStats()
    dtype = None
    for parts in (sources, dests):
        for g in (parts.values() if isinstance(parts, dict) else parts or ()):
            for k in kinds:
                if dtype is None:
                    dtype = g[k].dtype
                elif g[k].dtype != dtype:
                    raise TransitionAbortedError(f"state kind {k} has dtype {g[k].dtype}, expected {dtype}")
    elsize = torch.empty((), dtype=dtype or torch.float32).element_size()

    # keeps: local copies
    if sources is not None and dests is not None:
        for t in plan.keeps_of(member):
            for k in kinds:
                dests[t.group][k].narrow(0, t.dst_offset, t.numel).copy_(sources[t.group][k].narrow(0, t.src_offset, t.numel))
            stats.bytes_kept += t.numel * len(kinds) * elsize

    recvs = []  # (peer, buffer, transfers, work)
    sends = []
    try:
        for peer, transfers in sorted(plan.receives_of(member).items()):
            n = sum(t.numel for t in transfers) * len(kinds)
            buf = torch.empty(n, dtype=dtype)
            recvs.append((peer, buf, transfers, tdist.irecv(buf, src=pg_rank_of[peer])))
        for peer, transfers in sorted(plan.sends_of(member).items()):
            buf = torch.cat([s.reshape(-1) for s in _slices(sources, kinds, transfers, "src")])
            sends.append((peer, buf, tdist.isend(buf, dst=pg_rank_of[peer])))
    except RuntimeError as err:
        raise TransitionAbortedError(f"transition: posting messages failed on member {member}: {err}") from err

    timeout = timedelta(seconds=timeout_s)
    for peer, buf, transfers, work in recvs:
        try:
            work.wait(timeout)
        except RuntimeError as err:
            raise TransitionAbortedError(
                f"transition: receive from member {peer} (process-group rank {pg_rank_of[peer]}) failed or timed out "
                f"after {timeout_s:.0f} s: {err}") from err
        pos = 0
        for dst in _slices(dests, kinds, transfers, "dst"):
            dst.copy_(buf.narrow(0, pos, dst.numel()))
            pos += dst.numel()
        stats.bytes_received += buf.numel() * elsize
    for peer, buf, work in sends:
        try:
            work.wait(timeout)
        except RuntimeError as err:
            raise TransitionAbortedError(
                f"transition: send to member {peer} (process-group rank {pg_rank_of[peer]}) failed or timed out "
                f"after {timeout_s:.0f} s: {err}") from err
        stats.bytes_sent += buf.numel() * elsize
    stats.seconds = time.perf_counter() - t0
    return stats
