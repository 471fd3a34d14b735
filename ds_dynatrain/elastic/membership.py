"""Membership generations in the job's ``TCPStore`` and the process group of each.

A *generation* is one membership of the job: its world size and, by rank, the member ids of its
processes. Rank 0 of the old generation publishes generation ``g + 1`` before a resize; joiners
started by the launcher agent read it. Each generation forms its own default process group on its
own store prefix (:func:`~ds_dynatrain.elastic.keys.group_prefix`), so barrier keys of an old
generation never collide with a new one. Groups are built by
:class:`~ds_dynatrain.elastic.groups.GroupCache`: in the background, and reused when a later
generation has the same members. The store keys are those of :mod:`~ds_dynatrain.elastic.keys`.

This module knows process groups and the store, not the engine: the caller keeps the launch
environment and DeepSpeed's comm state true for a new generation.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence, Tuple

import torch.distributed as tdist

from ..errors import TransitionAbortedError
from ..log import native_stderr_hidden
from ..transition.execute import transition_members
from .groups import GroupCache
from .keys import (
    ABANDONED_KEY,
    ANSWER_KEY,
    CANCEL_COUNT,
    CANCEL_KEY,
    DEAD_KEY,
    DONE_KEY,
    ENDED_KEY,
    GEN_KEY,
    GO_KEY,
    JOB_KEY,
    JOINER_FAILED_KEY,
    LAST_STEP_KEY,
    REQUEST_COUNT,
    REQUEST_KEY,
    SERVED_KEY,
    SPAWN_COUNT,
    SPAWN_KEY,
    STANDBY_GONE_KEY,
    STOP_KEY,
    STOPPED_KEY,
    SWITCH_KEY,
    group_prefix,
)
from .launch_env import LaunchContext


@dataclass(frozen=True)
class GenerationRecord:
    """One generation's membership as published in the store.

    Attributes:
        generation: generation number.  world_size: its data-parallel world size.
        members: member id of each rank.  step: the optimizer step it was published at.
        header_rank: the rank of this generation that broadcasts the transition header into it
            (a survivor; joiners wait for it there).
        previous: the members of the generation before it, in rank order (with the joiners,
            the ranks of the transition group; empty for a generation formed from scratch).
    """

    generation: int
    world_size: int
    members: Tuple[str, ...]
    step: int
    header_rank: int = 0
    previous: Tuple[str, ...] = ()

    @property
    def transition_members(self) -> Tuple[str, ...]:
        """The transition group's members: the previous generation's, then the joiners."""
        return transition_members(self.previous, self.members)


def connect_store(host: str, port: int, timeout_s: float, quiet: bool = False) -> tdist.TCPStore:
    """A client connection to the job's store. ``quiet``: torch's native log of failed attempts
    (C++ stack traces) is discarded, for a command line that reports the failure in one line
    (:func:`~ds_dynatrain.log.native_stderr_hidden`).

    Raises:
        RuntimeError: (torch's ``DistNetworkError``, ``DistStoreError``) no store answered within
            ``timeout_s``.
    """
    with native_stderr_hidden() if quiet else contextlib.nullcontext():
        return tdist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Membership:
    """This process's view of the job's membership.

    Args:
        ctx: the launch context of this worker.
        timeout_s: limit of every store wait and process-group rendezvous, seconds.
        backend: ``torch.distributed`` backend of the job's groups (background builds: gloo only).
        on_new_default: called after every switch of the default group (the caller's reset of
            what caches the old group, e.g. DeepSpeed's comm state).
    """

    def __init__(
        self,
        ctx: LaunchContext,
        timeout_s: float,
        backend: str = "gloo",
        on_new_default: Optional[Callable[[], None]] = None,
    ):
        self.ctx = ctx
        self.timeout_s = timeout_s
        self.store = connect_store(ctx.store_host, ctx.store_port, timeout_s)
        self.groups = GroupCache(self.new_client, ctx.member, backend, on_new_default=on_new_default)
        self.stop_waiting: Optional[Callable[[], bool]] = None  # a standby's reason to stop waiting

    def publish(self, rec: GenerationRecord) -> None:
        self.store.set(
            GEN_KEY.format(rec.generation),
            json.dumps(
                {
                    "generation": rec.generation,
                    "world_size": rec.world_size,
                    "members": list(rec.members),
                    "step": rec.step,
                    "header_rank": rec.header_rank,
                    "previous": list(rec.previous),
                }
            ),
        )

    def read(self, generation: int, timeout_s: float) -> GenerationRecord:
        """Wait for and read generation ``generation``.

        Raises:
            TransitionAbortedError: not published within ``timeout_s``.
        """
        key = GEN_KEY.format(generation)
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as err:
            raise TransitionAbortedError(f"generation {generation} was not published within {timeout_s:.0f} s") from err
        d = json.loads(self.store.get(key))
        return GenerationRecord(
            int(d["generation"]),
            int(d["world_size"]),
            tuple(d["members"]),
            int(d["step"]),
            int(d.get("header_rank", 0)),
            tuple(d.get("previous", ())),
        )

    def publish_job(
        self, global_batch: int, micro_batch: int, max_world_size, world_size: int, pipeline: bool = False
    ) -> None:
        """What a resize requester checks a world size against (rank 0, at start); ``pipeline``: a
        ``PipelineModule`` job (it picks the PP degree of a request that names none)."""
        job = {
            "global_batch": global_batch,
            "micro_batch": micro_batch,
            "max_world_size": max_world_size,
            "world_size": world_size,
        }
        self.store.set(JOB_KEY, json.dumps({**job, "pipeline": True} if pipeline else job))

    def job(self) -> dict:
        """What :meth:`publish_job` published: the job's global batch, largest micro-batch,
        ``max_world_size`` and launch world size."""
        return json.loads(self.store.get(JOB_KEY))

    def pending_request(self, seen: int):
        """The next resize request after the first ``seen``, as ``(index, request dict)``, or None."""
        if int(self.store.add(REQUEST_COUNT, 0)) <= seen:
            return None
        return seen, json.loads(self.store.get(REQUEST_KEY.format(seen)))

    def answer(self, index: int, ok: bool, message: str, record=None, aborted: bool = False) -> None:
        """Rank 0's answer to request ``index`` (the requester waits for it). ``aborted``: the
        request was valid but given up (not a refusal of the size)."""
        self.store.set(
            ANSWER_KEY.format(index), json.dumps({"ok": ok, "message": message, "record": record, "aborted": aborted})
        )
        self.store.set(SERVED_KEY, str(index + 1))

    def answered(self, index: int) -> bool:
        """Whether request ``index`` has its answer."""
        return self.store.check([ANSWER_KEY.format(index)])

    def served(self) -> int:
        """Requests answered so far in this job (0 if none)."""
        return int(self.store.get(SERVED_KEY)) if self.store.check([SERVED_KEY]) else 0

    def set_last_step(self, step: int) -> None:
        self.store.set(LAST_STEP_KEY, str(step))

    def last_step(self) -> int:
        return int(self.store.get(LAST_STEP_KEY)) if self.store.check([LAST_STEP_KEY]) else 0

    def request_spawn(
        self, generation: int, world_size: int, ranks: Sequence[int], members: Sequence[str], nodes=None
    ) -> None:
        """Ask the launcher agents to start processes for ``ranks`` of ``generation``, member
        ``members[i]`` on the agent of node ``nodes[members[i]]`` (node 0 when not given)."""
        i = self.store.add(SPAWN_COUNT, 1) - 1
        self.store.set(
            SPAWN_KEY.format(i),
            json.dumps(
                {
                    "generation": generation,
                    "world_size": world_size,
                    "ranks": list(ranks),
                    "members": list(members),
                    "nodes": dict(nodes or {}),
                }
            ),
        )

    def cancel_spawn(self, generation: int, members: Sequence[str]) -> None:
        """Ask the agent to stop the joiners ``members`` started for ``generation``."""
        i = self.store.add(CANCEL_COUNT, 1) - 1
        self.store.set(CANCEL_KEY.format(i), json.dumps({"generation": generation, "members": list(members)}))

    def go(self, generation: int) -> None:
        """Tell joiners waiting for ``generation`` that its members are forming it now."""
        self.store.set(GO_KEY.format(generation), "1")

    def wait_go(self, generation: int, timeout_s: float) -> None:
        """Block until :meth:`go` for ``generation``.

        Raises:
            TransitionAbortedError: not within ``timeout_s``.
        """
        try:
            self.store.wait([GO_KEY.format(generation)], timedelta(seconds=timeout_s))
        except RuntimeError as err:
            raise TransitionAbortedError(f"generation {generation} was not formed within {timeout_s:.0f} s") from err

    def new_client(self) -> tdist.TCPStore:
        """Another connection to the job's store, for a thread that may block in a wait."""
        return connect_store(self.ctx.store_host, self.ctx.store_port, self.timeout_s)

    def prepare(self, generation: int, members: Sequence[str], step: int, timeout_s: float) -> None:
        """Start building, in a background thread, the process group of ``generation`` over
        ``members`` (rank order), published at ``step``. A group over the same members built for
        an earlier generation is reused instead. Collective over ``members``."""
        if self.ctx.member in members:
            self.groups.prepare(members, group_prefix(generation, members, step), timeout_s)

    def form(self, generation: int, members: Sequence[str], timeout_s: float, step: int = 0) -> bool:
        """Make the group of ``generation`` (``members`` in rank order, published at ``step``) this
        process's default process group: the cached one, the one being built in the background
        (waited for) or one built now. The current default group is detached, not destroyed.
        Returns True when a cached group was reused.

        Raises:
            TransitionAbortedError: the rendezvous did not complete within ``timeout_s``, or a
                member's agent reported it dead (:data:`~ds_dynatrain.elastic.keys.DEAD_KEY`,
                written when the job keeps peer replicas).
        """

        def cannot_form() -> Optional[str]:
            dead = [m for m in members if self.store.check([DEAD_KEY.format(m)])]
            return f"{', '.join(dead)} died" if dead else None

        return self.groups.activate(members, group_prefix(generation, members, step), timeout_s, cannot_form)

    def wait_recall(self, after: int, member: str, poll_s: float = 0.02):
        """A standby process waits to be taken back: the first generation after ``after`` whose
        membership is final (:meth:`go`) and names ``member``. Returns its record, or None when
        the job ended first (:meth:`done`, every member preempted) or this process was told to stop.
        """
        g = after + 1
        while True:
            if self.store.check([GO_KEY.format(g)]):
                rec = self.read(g, self.timeout_s)
                if member in rec.members:
                    return rec
                g += 1
                continue
            if self.job_over():
                return None
            if self.stop_waiting is not None and self.stop_waiting():
                return None
            time.sleep(poll_s)

    def switching(self, generation: int, step: int) -> None:
        """The members of the old generation are about to send the header into ``generation``
        (published at ``step``): it will form now (standby processes wait for this)."""
        self.store.set(SWITCH_KEY.format(generation, step), "1")

    def is_switching(self, generation: int, step: int) -> bool:
        return self.store.check([SWITCH_KEY.format(generation, step)])

    def failed_joiners(self, members: Sequence[str]) -> Tuple[str, ...]:
        """Which of ``members`` died before they joined (their agent says so)."""
        return tuple(m for m in members if self.store.check([JOINER_FAILED_KEY.format(m)]))

    def job_over(self) -> bool:
        """The job finished, was stopped, or every member was preempted."""
        return any(self.store.check([k]) for k in (DONE_KEY, ENDED_KEY, STOPPED_KEY))

    def stop_requested(self) -> int:
        """The signal a launcher agent was sent to stop the job (SIGTERM, SIGINT), 0 if none (rank 0
        reads it at every step boundary; the step's vote carries it to every rank)."""
        if not self.store.check([STOP_KEY]):
            return 0
        return int(json.loads(self.store.get(STOP_KEY))["signal"])

    def stopped(self, step: int, signum: int) -> None:
        """Rank 0: the job stopped after ``step`` because of signal ``signum`` (the agents exit
        with 128 + ``signum``; standby processes leave)."""
        self.store.set(STOPPED_KEY, json.dumps({"step": step, "signal": signum}))

    def done(self) -> None:
        """The job finished: standby processes leave."""
        self.store.set(DONE_KEY, "1")

    def leave_standby(self, member: str) -> None:
        """A standby process is gone (preempted): the job must not take it back."""
        self.store.set(STANDBY_GONE_KEY.format(member), "1")

    def gone_standby(self, standby: Sequence[str]) -> Tuple[str, ...]:
        """Which of the ``standby`` processes are gone."""
        return tuple(m for m in standby if self.store.check([STANDBY_GONE_KEY.format(m)]))

    def abandon(self, generation: int) -> None:
        """Generation ``generation`` as published will not be formed (its request was given up):
        waiting joiners and standby processes stop waiting for it."""
        rec = self.read(generation, self.timeout_s)
        self.store.set(ABANDONED_KEY.format(generation, rec.step), "1")
        self.store.delete_key(GO_KEY.format(generation))

    def is_abandoned(self, generation: int, step: int) -> bool:
        return self.store.check([ABANDONED_KEY.format(generation, step)])


def next_generation(store) -> int:
    """One past the highest generation published in ``store`` (0 for a new job)."""
    g = 0
    while store.check([GEN_KEY.format(g)]):
        g += 1
    return g
