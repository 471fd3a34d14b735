"""What the plugin keeps across rebuilds of the engine: the elastic state (the engine's ``_dt``), a
resize whose optimizer-state transfer still runs, and a request being prepared in the background."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from ..batch import BatchSplit, split_global_batch
from ..config import DynatrainConfig
from ..elastic.membership import Membership
from ..errors import NotAMemberError, ResizeRefusedError, TransitionAbortedError
from ..transition.execute import PendingTransition
from .records import MetricsWriter


def require_integers(world_size, **degrees) -> None:
    """Refuse a layout argument of ``resize`` or ``prepare_resize`` that is no integer (a degree
    may be None: unchanged or picked).

    Raises:
        ResizeRefusedError: naming the argument and the value given; nothing has changed.
    """
    for name, v in (("world_size", world_size), *degrees.items()):
        if v is None and name != "world_size":
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ResizeRefusedError(f"{name} {v!r} refused: it must be an integer")


@dataclass
class ElasticState:
    """What the plugin keeps across rebuilds of the engine (the engine's ``_dt`` attribute).

    Attributes (the less obvious ones):
        global_batch, micro_batch: the global batch kept across resizes and the largest
            micro-batch (samples).
        membership: this process's view of the job's store (None outside ``dynatrain launch``).
        member, members, generation: this process's member id, the current generation's members
            in rank order, and its number.
        spawned_for, published, published_step, assigned: per generation (and request), the
            joiners started, the members published, the step published at, the members drafted.
        pending: a resize whose optimizer-state transfer still runs.  preparing: a request whose
            next world is being built.  standby, history: processes standing by, and the members
            of recent generations (group reuse).  failed: why the last resize's transfer failed
            (the engine then refuses to train).
    """

    config: DynatrainConfig
    ds_config: dict
    global_batch: int
    micro_batch: int
    membership: Optional[Membership]
    member: str
    members: Tuple[str, ...]
    generation: int
    backend: str
    metrics: MetricsWriter
    collate_fn: Any = None
    returned_optimizer: Any = None
    loss_sum: float = 0.0
    loss_count: int = 0
    retired: bool = False
    frontend: Optional[str] = None  # the front-end (accelerate, lightning) whose loop restarts after a resize
    # a front-end loop that runs on through resizes (a plain Accelerate loop): called with the engine
    # on every process after each change of the world; such a loop can take no joiners
    in_place_loop: Any = None
    # (step, the job's mean loss of the step) of recent steps, on every rank (what a front-end logs
    # for a step its loop did not finish)
    step_losses: Deque[Tuple[int, float]] = field(default_factory=lambda: deque(maxlen=4096))
    spawned_for: Dict[int, Tuple[str, ...]] = field(default_factory=dict)  # generation -> joiners started
    snapshot_stall_s: float = 0.0
    published: Dict[int, Tuple[str, ...]] = field(default_factory=dict)  # generation -> members published
    resizes: List[dict] = field(default_factory=list)
    pending: Optional["PendingResize"] = None
    rebuild_broadcast: Any = None  # how the next construct broadcasts parameters (ElasticEngine._broadcast_model)
    params_posted: Any = None  # that broadcast's messages, posted ahead of it (transition.spread.PostedSpread)
    params_spread: Optional[Tuple[int, float]] = None  # that broadcast after a grow: (bytes, perf_counter at its end)
    failed: Optional[str] = None
    param_attrs: Dict[str, frozenset] = field(default_factory=dict)  # the client's own attributes (ZeRO-3)
    assigned: Dict[tuple, Tuple[str, ...]] = field(default_factory=dict)  # (generation, size, must leave) -> members
    hp_linked: bool = False  # DeepSpeed's fragment links repaired after the engine's first step
    requests_seen: int = 0  # resize requests of the store served so far (rank 0 reads them)
    preempted: bool = False  # SIGTERM received: leave at the next step boundary
    preparing: Optional["Preparation"] = None
    band_request: Optional["BandRequest"] = None  # a request's TP/PP switch at the job's world size, due later
    published_step: Dict[int, int] = field(default_factory=dict)  # generation -> step it was published at
    join_node: Optional[Tuple[int, int]] = None  # (request index, node) of the last `dynatrain join` (rank 0)
    standby: Tuple[str, ...] = ()  # processes standing by (left at a shrink, may be taken back), in order
    history: List[Tuple[str, ...]] = field(default_factory=list)  # members of recent generations (group reuse)
    step_t0: Optional[float] = None  # perf_counter at the first forward of the running step
    tokens_per_sample: Optional[int] = None  # what the returned loader saw in its batches (None: unknown)
    window: Tuple[int, float, int] = (0, 0.0, 0)  # steps, seconds and samples since the last step line
    inputs_published: bool = False  # rank 0 described its forward inputs for joiners' warm-up
    modules_published: bool = False  # rank 0 listed its imported modules after its first step
    replicas: Any = None  # this rank's peer replicas (transition.replicas.ReplicaSet), None: none yet
    replica_stall_s: float = 0.0  # waits for replica refreshes at step boundaries, seconds
    abandoned: bool = False  # a recovery abandoned the running step: the caller's next step() is skipped
    output_template: Any = None  # the last forward's output structure (recover.output_template)
    warmup_s: Optional[float] = None  # a joiner's warm-up before it joined, seconds (None: joined cold)
    held: list = field(default_factory=list)  # memory a joiner holds touched until the survivors switch
    switch_hold: Any = None  # memory held for a prepared TP/PP switch (switch_memory.HeldMemory)
    tp_layout: Any = None  # an AutoTP job's layout (vps.tensor_parallel.TensorParallelLayout); None: DP only
    pp_layout: Any = None  # a PipelineModule job's layout (vps.pipeline.PipelineLayout); None: no pipeline
    pipeline_data: Any = None  # a PipelineModule job's iterator over the training data it was handed

    @property
    def tp(self) -> int:
        """The job's AutoTP degree (1 without AutoTP)."""
        return 1 if self.tp_layout is None else self.tp_layout.tp

    @property
    def schedule(self) -> Dict[int, int]:
        """``{step: world size}`` of the config's resize schedule."""
        return {e.step: e.world_size for e in self.config.resize_schedule}

    @property
    def tp_schedule(self) -> Dict[int, int]:
        """``{step: TP degree}`` of the schedule's entries that give one (an AutoTP job)."""
        return {e.step: e.tensor_parallel for e in self.config.resize_schedule if e.tensor_parallel is not None}

    @property
    def pp_schedule(self) -> Dict[int, int]:
        """``{step: PP degree}`` of the schedule's entries that give one (a PipelineModule job)."""
        return {e.step: e.pipeline_parallel for e in self.config.resize_schedule if e.pipeline_parallel is not None}

    def require_member(self) -> None:
        """Raise where this process's engine cannot train or change layout any more.

        Raises:
            NotAMemberError: the process left the job at a resize.
            TransitionAbortedError: the last resize failed; the optimizer state is incomplete.
        """
        if self.retired:
            raise NotAMemberError(f"member {self.member} left the job at a resize; this engine cannot train")
        if self.failed:
            raise TransitionAbortedError(
                f"this engine's last resize failed, its optimizer state is incomplete: {self.failed}"
            )

    def split(self, world_size: int, what: str = "world size") -> BatchSplit:
        """The global batch split over ``world_size`` data-parallel ranks (``what``: how a refusal
        names them, ``"DP size"`` in a TP or pipeline job).

        Raises:
            ResizeRefusedError: ``world_size`` cannot keep the global batch or exceeds
                ``max_world_size``.
        """
        return split_global_batch(self.global_batch, self.micro_batch, world_size, self.config.max_world_size, what)

    @property
    def group_timeout_s(self) -> float:
        """Limit of a group rendezvous that may wait for joiners to start, seconds."""
        return self.config.join_timeout_s


@dataclass
class PendingResize:
    """A resize (or join) whose optimizer-state transfer still runs in the background.

    Attributes:
        transfer: the background transfer of the moments.  dests: this process's new partitions
            (``{partition: {kind: 1-D tensor}}``; None in a leaver).  scalars: the non-partition
            states of each new partition.  record: the resize or join record it completes.
        rss_base: resident set at the start, bytes (None: not measured).  group: the transition
            group, shut down once the transfer is over.
    """

    transfer: PendingTransition
    dests: Optional[Dict[int, Dict[str, torch.Tensor]]]
    scalars: List[Dict[str, Any]]
    record: Any
    rss_base: Optional[int]
    group: Any = None


@dataclass(frozen=True)
class BandRequest:
    """A ``dynatrain resize`` request for another TP or PP degree at the job's world size,
    accepted and prepared (its memory touched in the background,
    :mod:`~ds_dynatrain.engine.switch_memory`): request ``index`` of the store switches
    ``key`` (``"tensor_parallel"`` or ``"pipeline_parallel"``) to ``degree`` at the boundary of
    optimizer step ``step`` (``dynatrain.warm_switch_steps`` after the one that read it), on
    every process."""

    index: int
    key: str
    degree: int
    step: int


@dataclass
class Preparation:
    """A ``dynatrain resize`` request being prepared in the background: the next generation is
    published, its joiners started, and its process groups built while the current one trains.

    Attributes:
        index: the request's index in the store.  world_size: the requested size.
        generation, members, step: the generation being formed (members in rank order), published
            at optimizer step ``step``.
        xfer: the transition group being built (:class:`~ds_dynatrain.elastic.groups.BackgroundGroup`;
            None for an AutoTP or pipeline job's grow, whose transfer runs over the new default group).
        started: ``time.perf_counter()`` when it was decided.  ready_at: when this process saw its
            groups built (None before).  tensor_parallel: an AutoTP job's TP degree after the grow
            (None: a data-parallel resize).  pipeline_parallel: a pipeline job's PP degree after
            the grow.
    """

    index: int
    world_size: int
    generation: int
    members: Tuple[str, ...]
    step: int
    xfer: Any
    started: float
    ready_at: Optional[float] = None
    tensor_parallel: Optional[int] = None
    pipeline_parallel: Optional[int] = None

    def state(self, dt: ElasticState, check_joiners: bool = False) -> Tuple[bool, Optional[str]]:
        """``(ready, error)`` of this process's builds, without waiting. ``check_joiners`` (rank 0):
        also whether a joiner of this generation died before it joined (its agent says so)."""
        groups = dt.membership.groups
        mine = dt.member in self.members
        err = (self.xfer.error if self.xfer is not None else None) or (groups.error(self.members) if mine else None)
        if err is None and check_joiners:
            dead = dt.membership.failed_joiners([m for m in self.members if m not in dt.members])
            if dead:
                one = len(dead) == 1
                err = f"{'joiner' if one else 'joiners'} {list(dead)} died before {'it' if one else 'they'} joined"
        ready = (self.xfer is None or self.xfer.ready()) and (not mine or groups.ready(self.members))
        if ready and self.ready_at is None:
            self.ready_at = time.perf_counter()
        return ready, err
