"""Peer replicas in host memory: each rank's partition state copied to its holder on a ring,
refreshed in a background thread over a private gloo group (never the training group).

Every rank keeps two copies of its own state and two of its predecessor's, so that a refresh cut by
a failure never leaves it without a complete one: the refresh of step ``s`` writes the slots that
do not hold the newest complete copy, and a slot is marked complete only when its last byte has
arrived. A rank starts the next refresh only after the step boundary's all-reduce, which every
rank enters after its own refresh has completed; so at any failure every survivor still holds
its own copy of the step whose replicas are complete everywhere, or of the one before
(:func:`~ds_dynatrain.planner.recovery.recovery_step` picks it).

Memory: 4 × (fp32 master + optimizer moments) of one partition per rank, host memory, allocated
once per generation.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import TransitionAbortedError, without_frames
from ..planner.recovery import Offer

TAG_BASE = 1 << 20  # tags of the replica group's messages (header and payload of each refresh)

# A seam for fault injection in tests: called as ``hook(step)`` in the refresh thread of ``step``
# after the header's send is posted, before the payload's.
fault_hook: Optional[Callable[[int], None]] = None


class ReplicaSet:
    """This rank's own copies and its predecessor's replicas.

    Args:
        member: this rank's member id.  ring: the members in ring order
            (:func:`~ds_dynatrain.planner.recovery.replica_ring`).
        sizes: elements of each partition (one per parameter group), in group order.
        kinds: state kinds of each partition, in the order they are packed (``fp32`` first).
        dtype: dtype of the state (fp32).
        group: returns the private gloo group over ``ring`` (ranks in ring order); called once,
            at the first refresh (a collective rendezvous of the ring).
        timeout_s: limit of each wait of a refresh, seconds.

    Raises (from :meth:`wait`): TransitionAbortedError: a refresh failed or timed out (names the
    peer and the step).
    """

    def __init__(
        self,
        member: str,
        ring: Sequence[str],
        sizes: Sequence[int],
        kinds: Sequence[str],
        dtype: torch.dtype,
        group: Callable[[], Any],
        timeout_s: float,
    ):
        self.member = member
        self.ring = tuple(ring)
        me = self.ring.index(member)
        self.next = (me + 1) % len(self.ring)
        self.prev = (me - 1) % len(self.ring)
        self.replica_of = self.ring[self.prev] if len(self.ring) > 1 else None
        self.sizes = tuple(int(n) for n in sizes)
        self.kinds = tuple(kinds)
        self.numel = sum(self.sizes) * len(self.kinds)
        self._group_factory = group
        self._group = None
        self.timeout_s = timeout_s
        self.own = [torch.empty(self.numel, dtype=dtype) for _ in range(2)]
        self.replica = [torch.empty(self.numel, dtype=dtype) for _ in range(2)] if self.replica_of else []
        self.own_step: List[Optional[int]] = [None, None]
        self.own_meta: List[Any] = [None, None]
        self.replica_step: List[Optional[int]] = [None, None]
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.refreshes = 0
        self.last_refresh_s = 0.0
        self.bytes_sent = 0
        self.generation: Optional[int] = None  # set by the owner: the generation whose layout this holds

    @property
    def nbytes(self) -> int:
        """Host memory of the four copies, bytes."""
        return sum(t.numel() * t.element_size() for t in self.own + self.replica)

    # ---------------------------------------------------------------- layout of a copy
    def views(self, flat: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
        """``[{kind: 1-D view}]`` per group of one packed copy (group-major, kinds in order)."""
        out, pos = [], 0
        for n in self.sizes:
            g = {}
            for k in self.kinds:
                g[k] = flat.narrow(0, pos, n)
                pos += n
            out.append(g)
        return out

    def _newest(self, steps: List[Optional[int]]) -> Optional[int]:
        done = [i for i in (0, 1) if steps[i] is not None]
        return max(done, key=lambda i: steps[i]) if done else None

    def _free(self, steps: List[Optional[int]]) -> int:
        newest = self._newest(steps)
        return 0 if newest is None else 1 - newest

    # ---------------------------------------------------------------- refresh
    def capture(self, step: int, parts: Sequence[Dict[str, torch.Tensor]], meta: Any) -> None:
        """Copy this rank's partition state of ``step`` into its older own slot (foreground: the
        next optimizer step changes ``parts`` in place). ``meta``: what else the step's state
        needs (counters, scheduler; kept as given)."""
        slot = self._free(self.own_step)
        self.own_step[slot] = None
        for dst, src in zip(self.views(self.own[slot]), parts):
            for k in self.kinds:
                dst[k].copy_(src[k].detach().reshape(-1))
        self.own_step[slot], self.own_meta[slot] = step, meta

    def start(self, step: int) -> None:
        """Send the own copy of ``step`` to the holder and receive the predecessor's, in a
        background thread (:meth:`capture` first; the previous refresh must be over)."""
        if self._thread is not None:
            raise RuntimeError("a replica refresh is still running")
        own = self.own_step.index(step)
        if not self.replica_of:
            return
        slot = self._free(self.replica_step)
        self.replica_step[slot] = None  # torn until its last byte arrives
        self._error = None

        def run():
            t = time.perf_counter()
            try:
                self._exchange(step, self.own[own], slot)
                self.refreshes += 1
            except BaseException as err:  # noqa: BLE001 - reported by wait()
                # without tracebacks: their frames would keep the group and its unfinished works
                # alive past close(), and a gloo group left with a receive that never completed
                # keeps one of its threads spinning (a whole core) until the group object goes
                self._error = without_frames(err)
            self.last_refresh_s = time.perf_counter() - t

        self._thread = threading.Thread(target=run, name=f"dynatrain-replica-{step}", daemon=True)
        self._thread.start()

    def _exchange(self, step: int, own: torch.Tensor, slot: int) -> None:
        """Both directions posted at once and waited for independently: a failed receive (the
        predecessor died) must not keep this rank's copy from its holder, who would wait for it."""
        if self._group is None:
            self._group = self._group_factory()
        g = self._group
        tag = TAG_BASE + 2 * (step % (1 << 20))
        head_in, head_out = torch.empty(2, dtype=torch.int64), torch.tensor([step, self.numel], dtype=torch.int64)
        works = [("receive from", g.recv([head_in], self.prev, tag))]
        works.append(("receive from", g.recv([self.replica[slot]], self.prev, tag + 1)))
        works.append(("send to", g.send([head_out], self.next, tag)))
        if fault_hook is not None:
            fault_hook(step)
        works.append(("send to", g.send([own], self.next, tag + 1)))
        errors = []
        for what, w in works:
            peer = self.ring[self.prev] if what == "receive from" else self.ring[self.next]
            try:
                w.wait(timedelta(seconds=self.timeout_s))
            except RuntimeError as err:
                errors.append(f"{what} {peer} failed: {err}")
        if errors:
            raise TransitionAbortedError(f"replica refresh of step {step}: " + "; ".join(errors))
        if int(head_in[1]) != self.numel or int(head_in[0]) != step:
            raise TransitionAbortedError(
                f"replica refresh of step {step}: {self.ring[self.prev]} sent step {int(head_in[0])} of "
                f"{int(head_in[1])} elements, this rank expects step {step} of {self.numel}"
            )
        self.bytes_sent += own.numel() * own.element_size()
        self.replica_step[slot] = step

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: Optional[float] = None) -> float:
        """Wait for the running refresh; returns the seconds waited.

        Raises:
            TransitionAbortedError: it failed, or is still running after ``timeout_s``.
        """
        t = time.perf_counter()
        th = self._thread
        if th is not None:
            th.join(self.timeout_s * 3 if timeout_s is None else timeout_s)
            if th.is_alive():
                raise TransitionAbortedError(
                    f"the replica refresh did not end within {timeout_s or self.timeout_s * 3:.0f} s"
                )
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            try:
                raise err if isinstance(err, TransitionAbortedError) else TransitionAbortedError(str(err))
            finally:
                err = None  # no cycle through this frame: the caller's frames go when it is handled
        return time.perf_counter() - t

    def settle(self, timeout_s: float) -> Optional[str]:
        """After a failure: let the running refresh end (it fails fast when its peer died).
        Returns its error, if any (its slot then stays marked torn)."""
        try:
            self.wait(timeout_s)
        except TransitionAbortedError as err:
            return str(err)
        return None

    # ---------------------------------------------------------------- recovery
    def offer(self) -> Offer:
        """What this rank holds, complete (for :func:`~ds_dynatrain.planner.recovery.recovery_step`)."""
        own = tuple(s for s in self.own_step if s is not None)
        rep = tuple(s for s in self.replica_step if s is not None)
        return Offer(self.member, own, self.replica_of, rep)

    def own_at(self, step: int) -> Tuple[List[Dict[str, torch.Tensor]], Any]:
        """``(parts, meta)`` of the own copy of ``step``."""
        slot = self.own_step.index(step)
        return self.views(self.own[slot]), self.own_meta[slot]

    def replica_at(self, step: int) -> List[Dict[str, torch.Tensor]]:
        """Parts of the predecessor's replica of ``step``."""
        return self.views(self.replica[self.replica_step.index(step)])

    def close(self) -> None:
        """Shut the replica group down (the next generation makes its own); the copies stay
        readable until this object goes."""
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            self._thread = None
        if self._group is not None:
            try:
                self._group.shutdown()
            except Exception:  # noqa: BLE001 - a group with a dead peer may refuse; it goes with us
                pass
            self._group = None
