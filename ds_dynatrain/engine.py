"""The elastic engine: a real ``DeepSpeedEngine`` that can change its data-parallel world size.

``ds_dynatrain.initialize`` returns an :class:`ElasticEngine`. Hugging Face Accelerate, Lightning
and Trainer keep the engine object they were handed, so a resize never hands back a new engine:
it renews the insides of the same object (DeepSpeed's ``__init__`` runs again on it, on the new
process group) and the optimizer object returned at start shares the state of the rebuilt ZeRO
optimizer. The LR scheduler object is passed through unchanged.

A resize at a step boundary (DESIGN.md "Hot switch"):

1. the new world size is checked (:func:`~ds_dynatrain.batch.split_global_batch`) before
   anything changes; a refusal leaves training going on in the old world;
2. ranks are assigned (old rank ``r`` stays ``r``; the highest leave; joiners come last) and the
   planner intersects the old and new :class:`~ds_dynatrain.layout.ZeroLayout`;
3. grow: the joiners (started by the launcher agent, ahead of time) and the survivors form the
   new generation's process group;
4. rank 0 broadcasts a header (plan inputs, chunk size, non-tensor state) and every process
   checks it agrees (plan digest, model layout) before any byte moves; a disagreement is the same
   error everywhere;
5. the transition engine moves, over a private gloo group of the old members and the joiners,
   the fp32 master partitions (bf16/fp16 training only: in fp32 the rebuild copies them from the
   working parameters) and then, in a background thread, the optimizer moments;
6. leavers detach and stop iterating; survivors re-form the process group (shrink), rebuild the
   engine in place (:func:`~ds_dynatrain.bridge.light_rebuild`) and install the received
   partitions, counters, scheduler and RNG state (``transfer_overlap``).
"""
from __future__ import annotations

import copy
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine

from .batch import BatchSplit, largest_world_size, split_global_batch
from .bridge import (MASTER, PartitionState, client_attrs, detach_engine, extract_partitions, fp32_partitions, gather_whole_params,
                     install_master, install_optimizer_state, is_zero3, layout_of, light_rebuild,
                     relink_optimizer_state, release_zero3_params, working_partitions,
                     zero_optimizer_of)
from .config import DynatrainConfig
from .errors import DynatrainError, LayoutMismatchError, NotAMemberError, ResizeRefusedError, TransitionAbortedError
from .launch_env import member_id
from .layout import ZeroLayout
from .groups import BackgroundGroup
from .membership import ENDED_KEY, GenerationRecord, Membership, group_prefix, transition_members
from .metrics import MetricsWriter, format_resize, format_step, logger
from .planner import Plan, assign_members_best, plan_transition
from .snapshot import SnapshotCheckpointEngine
from .transition import PendingTransition, execute_plan, start_plan, transition_group, transition_ranks


@dataclass
class ElasticState:
    """What the plugin keeps across rebuilds of the engine (the engine's ``_dt`` attribute)."""

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
    spawned_for: Dict[int, Tuple[str, ...]] = field(default_factory=dict)  # generation -> joiners started
    snapshot_stall_s: float = 0.0
    published: Dict[int, Tuple[str, ...]] = field(default_factory=dict)  # generation -> members published
    resizes: List[dict] = field(default_factory=list)
    pending: Optional["PendingResize"] = None  # a resize whose optimizer-state transfer still runs
    rebuild_broadcast: Any = None  # how the next construct broadcasts parameters (see ElasticEngine._broadcast_model)
    failed: Optional[str] = None  # why the last resize's transfer failed (the engine then refuses to train)
    param_attrs: Dict[str, frozenset] = field(default_factory=dict)  # the client's own attributes (ZeRO-3)
    assigned: Dict[tuple, Tuple[str, ...]] = field(default_factory=dict)  # (generation, size, must leave) -> members
    hp_linked: bool = False  # DeepSpeed's fragment links repaired after the engine's first step
    requests_seen: int = 0  # resize requests of the store served so far (rank 0 reads them)
    preempted: bool = False  # SIGTERM received: leave at the next step boundary
    preparing: Optional["Preparation"] = None  # a resize request whose next world is being built
    published_step: Dict[int, int] = field(default_factory=dict)  # generation -> step it was published at
    join_node: Optional[Tuple[int, int]] = None  # (request index, node) of the last `dynatrain join` (rank 0)
    standby: Tuple[str, ...] = ()  # processes standing by (left at a shrink, may be taken back), in order
    history: List[Tuple[str, ...]] = field(default_factory=list)  # members of recent generations (group reuse)

    @property
    def schedule(self) -> Dict[int, int]:
        return {e.step: e.world_size for e in self.config.resize_schedule}

    def split(self, world_size: int) -> BatchSplit:
        return split_global_batch(self.global_batch, self.micro_batch, world_size, self.config.max_world_size)


def ds_config_for(dt: ElasticState, split: BatchSplit, client_objects: bool) -> dict:
    """DeepSpeed's config at one world size: the global batch kept, the per-rank split recomputed.

    ``client_objects``: the optimizer and scheduler are passed as live objects (a rebuild), so
    their config sections are dropped.
    """
    cfg = copy.deepcopy(dt.ds_config)
    cfg["train_batch_size"] = split.train_batch_size
    cfg["train_micro_batch_size_per_gpu"] = split.micro_batch
    cfg["gradient_accumulation_steps"] = split.gradient_accumulation_steps
    if client_objects:
        cfg.pop("optimizer", None)
        cfg.pop("scheduler", None)
    return cfg


def construct(engine: "ElasticEngine", dt: ElasticState, model, optimizer, model_parameters, lr_scheduler,
              ds_config: dict, light: bool = False, reuse_flat=()) -> None:
    """Run ``DeepSpeedEngine.__init__`` on ``engine`` (a new object or one being rebuilt).

    ``light``: the optimizer state is installed right after (a resize), so DeepSpeed's
    throw-away state initialisation is skipped (:func:`~ds_dynatrain.bridge.light_rebuild`);
    ``reuse_flat``: the old engine's flat parameter buffers, which the new one may keep.
    """
    import contextlib
    import deepspeed
    config_class = DeepSpeedConfig(ds_config)
    deepspeed.set_optimizer_flags(config_class, model)
    engine._dt = dt  # before DeepSpeed's set-up: _broadcast_model reads it
    if not dt.param_attrs:  # what is the client's own, before ZeRO-3 attaches its attributes
        dt.param_attrs = client_attrs(model)
    with light_rebuild(reuse_flat) if light else contextlib.nullcontext():
        DeepSpeedEngine.__init__(engine, args=None, model=model, optimizer=optimizer,
                                 model_parameters=model_parameters, training_data=None, lr_scheduler=lr_scheduler,
                                 mpu=None, dist_init_required=False, collate_fn=dt.collate_fn, config=ds_config,
                                 config_class=config_class)
    engine._configure_python_gc()
    dt.rebuild_broadcast = None
    snap = dt.config.snapshot
    engine.checkpoint_engine = SnapshotCheckpointEngine(
        store_address=store_address(dt), rank=tdist.get_rank(), world_size=tdist.get_world_size(), generation=dt.generation,
        keep_last=snap.keep_last, timeout_s=dt.config.collective_timeout_s, cache_bytes=snap.host_cache_mib << 20,
        asynchronous=snap.asynchronous)
    engine.checkpoint_engine.tensor_attrs = VPSAttributes(layout_of(engine), tdist.get_rank())


class VPSAttributes:
    """Footer attributes of the ZeRO partition tensors of a DeepSpeed checkpoint dict: which VPS
    fragments (parameter key, start and length in the parameter, offset in the partition; elements)
    each byte range holds, so a snapshot can be read by another layout.

    Paths (``DeepSpeedZeroOptimizer.state_dict``, deepspeed/runtime/zero/stage_1_and_2.py):
    ``optimizer_state_dict/single_partition_of_fp32_groups/<g>`` (fp32 master) and
    ``optimizer_state_dict/base_optimizer_state[/state]/<g>/<state>`` (Adam moments; the torch
    optimizer's ``step`` is a scalar and gets none). Stage 3 (``DeepSpeedZeroOptimizer_Stage3``
    ``_rigid_state_dict``, deepspeed/runtime/zero/stage3.py), per sub-group ``<g>``:
    ``optimizer_state_dict/fp32_flat_groups/<g>`` and
    ``optimizer_state_dict/optimizer_state_dict/state/<g>/<state>``.
    """

    PATTERN = re.compile(r"optimizer_state_dict/(?:(?:single_partition_of_fp32_groups|fp32_flat_groups)/(\d+)|"
                         r"(?:base_optimizer_state|optimizer_state_dict)/(?:state/)?(\d+)/(\w+))")

    def __init__(self, layout: ZeroLayout, rank: int):
        self.layout, self.rank = layout, rank
        self._by_group = {}
        for f in layout.fragments(rank):
            self._by_group.setdefault(f.group, []).append([f.key, f.start, f.numel, f.local])

    def __call__(self, path: str) -> dict:
        m = self.PATTERN.fullmatch(path)
        if m is None or m.group(3) == "step":
            return {}
        g = int(m.group(1) if m.group(1) is not None else m.group(2))
        return {"vps": {"kind": "fp32" if m.group(1) is not None else m.group(3), "group": g, "rank": self.rank,
                        "world_size": self.layout.world_size, "stage": self.layout.stage,
                        "fragments": self._by_group.get(g, [])}}


def store_address(dt: ElasticState) -> Tuple[str, int]:
    """``(host, port)`` of the job's store: the launcher's, or torch.distributed's default one."""
    if dt.membership is not None:
        return dt.membership.ctx.store_host, dt.membership.ctx.store_port
    st = tdist.distributed_c10d._get_default_store()
    while isinstance(st, tdist.PrefixStore):
        st = st.underlying_store
    return st.host, st.port


class ElasticEngine(DeepSpeedEngine):
    """A ``DeepSpeedEngine`` whose data-parallel world size can change while it trains.

    Built by :func:`ds_dynatrain.initialize`, never directly. Everything of ``DeepSpeedEngine``
    works as usual; in addition:

    * :meth:`step` runs, after each optimizer step, the plugin's step record, the periodic
      snapshot and any resize scheduled for that step;
    * :meth:`resize` changes the world size now (collective: every member calls it at the same
      step boundary);
    * :attr:`is_member` turns False in a process that left the job at a resize.
    """

    _dt: ElasticState

    # ------------------------------------------------------------------ public
    @property
    def is_member(self) -> bool:
        """False once this process has left the job at a resize."""
        return not self._dt.retired

    @property
    def generation(self) -> int:
        """The membership generation this process trains in (0 at launch, +1 per resize)."""
        return self._dt.generation

    @property
    def resize_records(self) -> List[dict]:
        """One record per resize this process took part in (see :mod:`ds_dynatrain.metrics`)."""
        return list(self._dt.resizes)

    def forward(self, *inputs, **kwargs):
        self._require_member()
        return super().forward(*inputs, **kwargs)

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        self._require_member()
        out = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        self._dt.loss_sum += float(loss.detach().float())
        self._dt.loss_count += 1
        return out

    def step(self, lr_kwargs=None):
        self._require_member()
        before = self.global_steps
        if self.is_gradient_accumulation_boundary():
            self.wait_transition()  # the optimizer moments of the last resize must have arrived
            if isinstance(self.checkpoint_engine, SnapshotCheckpointEngine):
                # the optimizer step is the first thing that changes the state a snapshot captures
                self._dt.snapshot_stall_s += self.checkpoint_engine.wait_captured()
        super().step(lr_kwargs=lr_kwargs)
        if self.global_steps != before:
            self._after_optimizer_step()

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's ``save_checkpoint`` through the snapshot engine; ``latest`` is replaced
        atomically by the engine's commit (DeepSpeed's own write of it is skipped)."""
        self._require_member()
        self.wait_transition()
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        ce = self.checkpoint_engine
        if isinstance(ce, SnapshotCheckpointEngine):
            ce.publish_latest = save_latest  # the engine's commit replaces ``latest`` atomically
            save_latest = False
        return super().save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, **kwargs):
        """Load a snapshot or a DeepSpeed ZeRO checkpoint, saved at this or any other world size
        and ZeRO stage (1, 2, 3).

        Same world size and stage: DeepSpeed's ``load_checkpoint`` through the snapshot engine
        (``weights_only=True``); afterwards the optimizer-state fragments are linked again so
        ``deepspeed.utils.safe_get_full_optimizer_state`` works at once. Otherwise
        :func:`ds_dynatrain.migrate.load_resharded`: every file of the saving world is checked
        first, then each rank reads only the fragments of its new partitions. Collective.

        Returns:
            ``(load path, client state)`` as DeepSpeed's; ``(None, None)`` when nothing is found.

        Raises:
            CheckpointIncompleteError: missing or damaged files of the saving world.
            LayoutMismatchError: the checkpoint holds another model (names the first parameter).
        """
        self._require_member()
        self.wait_transition()
        from .migrate import SavedCheckpoint, load_resharded
        saved = None
        if self.zero_optimization_stage() in (1, 2, 3) and (tag is not None or os.path.isfile(
                os.path.join(load_dir, "latest"))):
            saved = SavedCheckpoint(load_dir, tag)  # refuses an incomplete checkpoint before anything loads
        if saved is not None and (saved.world_size, saved.stage) != (self.dp_world_size,
                                                                    self.zero_optimization_stage()):
            path, client, stats = load_resharded(self, load_dir, saved.tag, load_optimizer_states,
                                                 load_lr_scheduler_states, saved=saved)
            if self.global_rank == 0:
                rec = {"event": "load", "step": self.global_steps, "from": stats.saved_world_size,
                       "to": stats.world_size, "saved_stage": stats.saved_stage, "stage": stats.stage,
                       "bytes_read": stats.bytes_read, "seconds": stats.seconds, "plan_s": stats.plan_s,
                       "read_s": stats.read_s, "dir": path}
                self._dt.metrics.write(rec)
                logger.info(f"loaded {path} (ZeRO-{stats.saved_stage}, {stats.saved_world_size} ranks) onto "
                            f"{stats.world_size} ranks (ZeRO-{stats.stage}): {stats.bytes_read / 2**20:.2f} MiB read "
                            f"on rank 0 in {stats.seconds:.2f} s")
            return path, client
        if saved is not None:
            saved.close()  # the same layout: DeepSpeed's own load reads the files
        problem = None
        try:
            out = super().load_checkpoint(load_dir, tag=tag, load_module_strict=load_module_strict,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states, **kwargs)
        except Exception as err:  # noqa: BLE001 - reported on every rank below, then raised
            problem = f"{type(err).__name__}: {err}"
        # one rank's damaged file fails every rank (else the others train on and hang on it)
        problems: List[Optional[str]] = [None] * tdist.get_world_size()
        tdist.all_gather_object(problems, problem)
        bad = [(r, p) for r, p in enumerate(problems) if p]
        if bad:
            from .migrate import CheckpointIncompleteError
            raise CheckpointIncompleteError(f"loading {load_dir} failed: "
                                            + "; ".join(f"rank {r}: {p}" for r, p in bad))
        if out[0] is not None:
            relink_optimizer_state(self)
        return out

    def resize(self, world_size: int, must_leave: Tuple[str, ...] = ()) -> Optional[dict]:
        """Change the data-parallel world size now, in memory.

        Collective: every member of the current generation calls it at the same step boundary
        (the resize schedule of the config does this from :meth:`step`).

        Args:
            world_size: the new data-parallel world size.
            must_leave: member ids that leave whatever the rank assignment prefers (preemption).

        Returns:
            The resize record (``from``, ``to``, ``bytes_moved``, ``seconds``, ...) on members of
            the new generation; None in a process that left, or when the size does not change.

        Raises:
            ResizeRefusedError: ``world_size`` < 1, above ``max_world_size``, breaks the global
                batch, or the job was not started by ``dynatrain launch``; nothing has changed.
            LayoutMismatchError, TransitionAbortedError: the ranks disagreed or a peer failed.
        """
        self._require_member()
        self.wait_transition()
        dt = self._dt
        split = dt.split(world_size)
        if dt.membership is None:
            raise ResizeRefusedError("online resizing needs the job to be started by `dynatrain launch` "
                                     "(it hosts the membership store and starts joiners)")
        if world_size == self.dp_world_size and not must_leave:
            return None
        zero_optimizer_of(self)  # refuse engines we cannot resize before anything changes
        return self._resize(world_size, split, tuple(must_leave))

    # ------------------------------------------------------------------ step boundary
    def _require_member(self):
        dt = getattr(self, "_dt", None)
        if dt is not None and dt.retired:
            raise NotAMemberError(f"member {dt.member} left the job at a resize; this engine cannot train")
        if dt is not None and dt.failed:
            raise TransitionAbortedError(f"this engine's last resize failed, its optimizer state is incomplete: "
                                         f"{dt.failed}")

    def _after_optimizer_step(self):
        dt = self._dt
        step = self.global_steps
        if not dt.hp_linked:
            # DeepSpeed 0.19.8 (stage_1_and_2.py ``_optimizer_step``) links every parameter's
            # optimizer-state fragment right after group 0's first step, when the later groups
            # have no state yet, and never again: ``safe_get_full_optimizer_state`` then fails
            # for every parameter outside group 0. Link once more now that all groups have state.
            relink_optimizer_state(self)
            dt.hp_linked = True
        # one all-reduce carries the loss, rank 0's pending resize request (world size, or 0),
        # which ranks were preempted (bit r for rank r), which standby processes are gone (bit i
        # for standby i), and how many ranks have the groups of a request being prepared built
        # (or failed to build them): every rank decides the same at this step
        request = gone = None
        prep = dt.preparing
        if dt.membership is not None and self.global_rank == 0 and step not in dt.schedule and prep is None:
            request = dt.membership.pending_request(dt.requests_seen)
            if request is not None and "join" in request[1]:  # `dynatrain join`: grow by its slots there
                dt.join_node = (request[0], int(request[1]["join"]))
                request = (request[0], {"world_size": self.dp_world_size + int(request[1]["slots"])})
        if dt.membership is not None and self.global_rank == 0 and dt.standby:
            gone = dt.membership.gone_standby(dt.standby)
        preempt_bit = float(2 ** self.global_rank) if dt.preempted else 0.0
        ready, error = prep.state(dt, self.global_rank == 0) if prep is not None else (False, None)
        # on the accelerator: NCCL reduces device tensors only
        totals = torch.tensor([dt.loss_sum, float(dt.loss_count), float(request[1]["world_size"]) if request else 0.0,
                               float(request[0] + 1) if request else 0.0, preempt_bit,
                               float(sum(2 ** i for i, m in enumerate(dt.standby) if gone and m in gone)),
                               float(ready), float(error is not None)], dtype=torch.float64,
                              device=get_accelerator().current_device_name())
        tdist.all_reduce(totals)
        totals = totals.cpu()
        requested, request_index, preempted_mask = int(totals[2]), int(totals[3]) - 1, int(totals[4])
        gone_mask, n_ready, n_failed = int(totals[5]), int(totals[6]), int(totals[7])
        if gone_mask:
            dt.standby = tuple(m for i, m in enumerate(dt.standby) if not gone_mask >> i & 1)
        dt.loss_sum, dt.loss_count = 0.0, 0
        loss = float(totals[0] / max(totals[1], 1.0))
        lr = float(self.get_lr()[0]) if self.get_lr() else float("nan")
        if self.global_rank == 0:
            dt.metrics.write({"event": "step", "step": step, "world_size": self.dp_world_size, "loss": loss, "lr": lr})
            if dt.membership is not None:
                dt.membership.set_last_step(step)  # a restore from a snapshot counts the steps it loses
            if step % dt.config.log_interval_steps == 0:
                logger.info(format_step(step, self.dp_world_size, loss, lr))
        snap = dt.config.snapshot
        if snap.interval_steps and step % snap.interval_steps == 0:
            t0 = time.perf_counter()
            self.save_checkpoint(snap.dir, tag=f"global_step{step}")
            if self.global_rank == 0:
                dt.metrics.write({"event": "snapshot", "step": step, "save_s": time.perf_counter() - t0,
                                  "dir": snap.dir})
        target = dt.schedule.get(step)
        if prep is not None and (preempted_mask or target is not None or n_failed):
            why = (f"the new world could not be formed: {error or f'{n_failed} rank(s) could not build its groups'}"
                   if n_failed and not preempted_mask and target is None
                   else "a preemption or a scheduled resize came first")
            self._abandon(prep, why)
            prep = None
        if preempted_mask:
            self._leave_preempted(preempted_mask)
        elif target is not None:
            self.resize(target)
        elif prep is not None:
            if n_ready == self.dp_world_size:
                self._finish_request(prep)
        elif requested:
            self._serve_request(request_index, requested)
        if self.is_member:
            self._spawn_ahead()

    def _serve_request(self, index: int, world_size: int) -> None:
        """``dynatrain resize`` request ``index``, at this step boundary on every rank (each
        learned it from the step's all-reduce); rank 0 of the world that results answers it.

        With ``background_groups`` (the default) a grow or shrink is only *prepared* here
        (:meth:`_prepare`): training goes on while the next world is built, and the switch
        happens at the first step boundary where every rank has it ready."""
        dt = self._dt
        dt.requests_seen = index + 1  # before the resize: its header hands the count to joiners
        try:
            if dt.config.background_groups and world_size != self.dp_world_size:
                dt.split(world_size)
                zero_optimizer_of(self)  # refuse engines we cannot resize before anything changes
                self._prepare(index, world_size)
                return
            rec = self.resize(world_size)
        except ResizeRefusedError as err:
            if self.global_rank == 0:
                dt.membership.answer(index, False, str(err))
                logger.info(f"resize request {index}: {err}")
            return
        if rec is not None and rec["event"] != "resize":
            return  # this process stood by and was taken back by a later resize
        if self.is_member and self.global_rank == 0:
            msg = (f"resized {rec['from']} -> {rec['to']} after step {rec['step']} in {rec['seconds']:.2f} s"
                   if rec else f"the job already runs on {world_size} ranks")
            dt.membership.answer(index, True, msg, rec)

    def _prepare(self, index: int, world_size: int) -> None:
        """Publish the next generation, start its joiners (or take back standby processes) and
        build its default group and transition group in background threads; return at once."""
        dt = self._dt
        members = self._request_joiners(world_size)
        g = dt.generation + 1
        step = dt.published_step[g]
        if self.global_rank == 0:
            dt.membership.go(g)  # joiners and standby processes form it as soon as they are up
        timeout = dt.config.join_timeout_s
        dt.membership.prepare(g, members, step, timeout)
        ranks = transition_members(dt.members, members)
        connect, me = dt.membership.new_client, dt.member
        xfer = BackgroundGroup(lambda: transition_group(connect(), xfer_prefix(ranks, g, step), ranks, me, timeout),
                               name=f"dynatrain-xfer-{g}")
        dt.preparing = Preparation(index, world_size, g, members, step, xfer, time.perf_counter())
        if self.global_rank == 0:
            logger.info(f"resize request {index}: preparing generation {g} ({self.dp_world_size} -> {world_size} "
                        f"ranks) while training goes on")

    def _finish_request(self, prep: Preparation) -> None:
        """Every rank has the prepared groups: switch to the new world now."""
        dt = self._dt
        dt.preparing = None
        rec = self._resize(prep.world_size, dt.split(prep.world_size), prepared=prep)
        if rec is None or rec["event"] != "resize":
            return  # this process left (or stood by and was taken back later: a join record)
        if self.is_member and self.global_rank == 0:
            dt.membership.answer(prep.index, True, f"resized {rec['from']} -> {rec['to']} after step {rec['step']} "
                                 f"in {rec['seconds']:.2f} s ({rec['prepare_s']:.2f} s prepared in the background)",
                                 rec)

    def _abandon(self, prep: Preparation, why: str) -> None:
        """Give up a prepared request: its joiners are stopped, the requester told why."""
        dt = self._dt
        dt.preparing = None
        if self.global_rank == 0:
            dt.membership.abandon(prep.generation)
            stale = dt.spawned_for.pop(prep.generation, ())
            if stale:
                dt.membership.cancel_spawn(prep.generation, stale)
            dt.membership.answer(prep.index, False, f"resize to {prep.world_size} ranks abandoned: {why}", aborted=True)
            logger.info(f"resize request {prep.index} abandoned: {why}")
        dt.published.pop(prep.generation, None)
        dt.assigned = {k: v for k, v in dt.assigned.items() if k[0] != prep.generation}
        prep.xfer.close()
        # a joiner's id comes back when the generation is published again: a group built with the
        # cancelled joiner must not pass for the new one's
        gone = set(prep.members) - set(dt.members) - set(dt.standby)
        dt.membership.groups.evict(lambda members: not set(members) & gone)

    def _leave_preempted(self, mask: int) -> None:
        """Members that received SIGTERM leave now, after handing over their partitions: the job
        shrinks to the largest world size the others can serve (the rest of the global batch
        rule decides; surplus processes leave too)."""
        dt = self._dt
        ws = self.dp_world_size
        leavers = tuple(dt.members[r] for r in range(ws) if mask >> r & 1)
        size = largest_world_size(dt.global_batch, dt.micro_batch, ws - len(leavers), dt.config.max_world_size)
        if self.global_rank == 0:
            logger.info(f"preemption of {list(leavers)} after step {self.global_steps}: "
                        + (f"the job goes on with {size} ranks" if size else "no member is left; the job ends"))
        if size == 0:
            if self.global_rank == 0:
                dt.membership.store.set(ENDED_KEY, str(self.global_steps))  # the launcher exits non-zero
            dt.retired = True
            if tdist.is_initialized():
                tdist.destroy_process_group()
            return
        self.resize(size, must_leave=leavers)

    def _spawn_ahead(self):
        """Ask the agent to start the joiners of the next scheduled grow a few steps early, so
        that their start-up (imports, model construction) overlaps training."""
        dt = self._dt
        if dt.membership is None or not self.is_member or dt.preparing is not None:
            return  # a request being prepared owns the next generation
        upcoming = [(s, w) for s, w in sorted(dt.schedule.items()) if s >= self.global_steps]
        if not upcoming:
            return
        step, world_size = upcoming[0]
        if step == self.global_steps or world_size <= self.dp_world_size:
            return
        if step - self.global_steps > dt.config.spawn_lookahead_steps:
            return
        self._request_joiners(world_size)

    def _request_joiners(self, world_size: int, must_leave: Tuple[str, ...] = ()) -> Tuple[str, ...]:
        """Publish the next generation for ``world_size`` and have its joiners started (once).

        The members of a recent generation are taken again, in their rank order, when they fit
        (every staying process is among them, the others stand by): its process groups are cached
        (4 -> 2 -> 4 reuses the groups of the first 4). Otherwise ranks are assigned by the
        planner (:func:`~ds_dynatrain.planner.assign_members_best`): the staying processes take the
        new ranks that keep the most optimizer state in place, standby processes and then new
        joiners the others (a new joiner is named after the rank it takes). If joiners were already
        started for the next generation with another membership (a scheduled grow, then a manual
        resize to another size), they are cancelled first.
        """
        dt = self._dt
        g = dt.generation + 1
        new_members = dt.assigned.get((g, world_size, must_leave))
        if new_members is None:
            new_members = self._recent_members(world_size, must_leave)
        if new_members is None:
            old = layout_of(self)
            staying = min(self.dp_world_size - len(set(must_leave) & set(dt.members)), world_size)
            recalled = tuple(dt.standby[:world_size - staying])
            placeholders = recalled + tuple(f"joiner-{i}" for i in range(world_size - staying - len(recalled)))
            drafted = assign_members_best(old, old.with_world_size(world_size), dt.members, placeholders, must_leave)
            new_members = tuple(member_id(g, r) if m.startswith("joiner-") else m for r, m in enumerate(drafted))
        dt.assigned[(g, world_size, must_leave)] = new_members
        old = set(dt.members)
        joiners = tuple(m for m in new_members if m not in old and m not in dt.standby)
        if dt.published.get(g) == new_members:
            return new_members
        if self.global_rank == 0:
            stale = dt.spawned_for.get(g, ())
            if stale:
                dt.membership.cancel_spawn(g, stale)
            header_rank = new_members.index(dt.members[0]) if dt.members[0] in new_members else 0
            dt.membership.publish(GenerationRecord(g, world_size, new_members, self.global_steps, header_rank,
                                                   tuple(dt.members)))
            if joiners:
                from .launcher import place_joiners
                join = dt.join_node
                nodes = ({j: join[1] for j in joiners} if join is not None and join[0] == dt.requests_seen - 1
                         else place_joiners(dt.membership.store, tuple(new_members) + tuple(dt.standby), joiners))
                dt.membership.request_spawn(g, world_size, [new_members.index(j) for j in joiners], joiners, nodes)
        dt.spawned_for[g] = joiners
        dt.published[g] = new_members
        dt.published_step[g] = self.global_steps
        return new_members

    def _recent_members(self, world_size: int, must_leave: Tuple[str, ...]) -> Optional[Tuple[str, ...]]:
        """The members of the latest earlier generation that can form the next one: of size
        ``world_size``, holding every process that stays (all of them at a grow), the rest standing
        by, none that must leave. None when there is none."""
        dt = self._dt
        pool = [m for m in dt.members if m not in must_leave]
        for members in reversed(dt.history):
            if len(members) != world_size or members == dt.members or set(members) & set(must_leave):
                continue
            if world_size > len(pool):
                if set(pool) <= set(members) and set(members) - set(pool) <= set(dt.standby):
                    return tuple(members)
            elif set(members) <= set(pool):
                return tuple(members)
        return None

    def cancel_pending_joiners(self) -> None:
        """Stop joiners started for a generation that will not be formed (the job is ending)."""
        dt = self._dt
        if dt.membership is None or self.global_rank != 0:
            return
        if dt.preparing is not None:
            self._abandon(dt.preparing, "the job ended first")
        for g, joiners in sorted(dt.spawned_for.items()):
            if g > dt.generation and joiners:
                dt.membership.cancel_spawn(g, joiners)
        dt.spawned_for = {g: j for g, j in dt.spawned_for.items() if g <= dt.generation}

    # ------------------------------------------------------------------ the resize
    def wait_transition(self) -> Optional[dict]:
        """Finish the optimizer-state transfer of the last resize, if one is still running.

        The optimizer moments of a resize move in a background thread while the DeepSpeed engine
        is rebuilt, and are installed here. By default (``transfer_overlap: "rebuild"``) the
        resize itself calls this before it returns. With ``transfer_overlap: "step"`` the resize
        returns as soon as the new engine can run forward and backward; :meth:`step`,
        :meth:`save_checkpoint`, :meth:`load_checkpoint` and :meth:`resize` call it, and code
        that reads optimizer state (``safe_get_full_optimizer_state``) between the resize and the
        next optimizer step must call it first (until then the optimizer has no state).

        Returns:
            The completed resize record, or None if nothing was pending.

        Raises:
            TransitionAbortedError: a peer failed during the transfer (names the peer and step).
        """
        rec = self._complete_pending()
        if rec is not None:
            self._publish(rec)
        return rec

    def _complete_pending(self) -> Optional[dict]:
        """Wait for the background transfer, install the moments, complete the record."""
        dt = getattr(self, "_dt", None)
        pending = dt.pending if dt is not None else None
        if pending is None:
            return None
        t = time.perf_counter()
        try:
            stats = pending.transfer.wait()  # every wait inside is bounded by collective_timeout_s
        except TransitionAbortedError as err:
            dt.failed = str(err)  # the new partitions are incomplete: this engine must not train
            dt.pending = None
            raise
        dt.pending = None
        if pending.group is not None:
            pending.group.shutdown()  # its sockets and threads go now, not when collected
        waited = time.perf_counter() - t
        if pending.dests is not None:
            install_optimizer_state(self, [pending.dests[g] for g in sorted(pending.dests)], pending.scalars)
        rec = pending.record
        rec.update(transfer_s=rec["transfer_s"] + stats.seconds - stats.keep_seconds,
                   keep_s=rec.get("keep_s", 0.0) + stats.keep_seconds, transfer_wait_s=waited,
                   peak_extra_bytes=max(rec.get("peak_extra_bytes", 0), _peak_extra_bytes(pending.rss_base)),
                   peak_staging_bytes=max(rec.get("peak_staging_bytes", 0), stats.peak_staging_bytes),
                   messages=rec.get("messages", 0) + stats.messages,
                   bytes_sent=rec.get("bytes_sent", 0) + stats.bytes_sent,
                   bytes_received=rec.get("bytes_received", 0) + stats.bytes_received)
        return rec

    def _publish(self, rec: dict) -> None:
        """Keep a completed resize record; rank 0 writes and prints it."""
        dt = self._dt
        if dt.retired:
            return
        dt.resizes.append(rec)
        if self.global_rank == 0 and rec["event"] == "resize":
            dt.metrics.write(rec)
            logger.info(format_resize(rec))

    def _broadcast_model(self):
        """DeepSpeed's set-up broadcast of the working parameters, shaped by the resize: none
        after a shrink (every survivor holds them already), spread over the survivors as sources
        after a grow (parameter ``k`` from survivor ``k mod S``), DeepSpeed's own otherwise."""
        dt = self.__dict__.get("_dt")
        mode = dt.rebuild_broadcast if dt is not None else None
        if mode is None:
            return super()._broadcast_model()
        if mode == "none":
            return None
        holders = list(mode)
        for k, (_, p) in enumerate(self.module.named_parameters()):
            tdist.broadcast(p.data.view(torch.uint8), src=holders[k % len(holders)])
        return None

    def _resize(self, world_size: int, split: BatchSplit, must_leave: Tuple[str, ...] = (),
                prepared: Optional[Preparation] = None) -> Optional[dict]:
        dt = self._dt
        clock = time.perf_counter
        t0 = clock()
        rss_base = _start_peak_rss()
        old_ws = self.dp_world_size
        grow = world_size > old_ws
        new_members = self._request_joiners(world_size, must_leave)
        old_layout = layout_of(self)
        plan = plan_transition(old_layout, old_layout.with_world_size(world_size), dt.members, new_members)
        state = extract_partitions(self)
        zero3 = is_zero3(zero_optimizer_of(self))
        # ZeRO-3: the working parameters are partitioned too; every old rank takes part in gathering
        # them whole on the old group (before a grow re-forms it), and the rebuild partitions them
        # for the new world
        whole = gather_whole_params(self.module) if zero3 else None
        header = self._header(plan, state, must_leave) if self.global_rank == 0 else None
        stays = dt.member in plan.new_members
        plan_s = clock() - t0

        group_s = 0.0
        g_new = dt.generation + 1
        reused = False
        if self.global_rank == 0:
            dt.membership.go(g_new)  # every formed generation has it: standby processes follow them
        if grow:
            # the new generation's group carries the header; the old engine stays as it is (its
            # groups detached) until the plan is agreed
            t = clock()
            if self.global_rank == 0:
                dt.membership.switching(g_new, dt.published_step[g_new])  # joiners may wait for the header now
            reused = dt.membership.form(g_new, plan.new_members, dt.member, dt.backend, self._group_timeout(),
                                        step=dt.published_step[g_new])
            group_s += clock() - t
        t = clock()
        # a grow agrees on the new group, where old rank 0 (a survivor) may hold another rank
        src = plan.new_members.index(plan.old_members[0]) if grow else 0
        header = agree_on_header(header, lambda h: "plan digest differs" if h["digest"] != plan.digest() else None,
                                 src=src)
        plan_s += clock() - t
        t = clock()
        xfer = prepared.xfer.get(self._group_timeout()) if prepared is not None else None
        xfer_wait = clock() - t
        dests, stats, transfer, overlap, xfer = begin_transition(plan, dt, g_new, header, state.tensors, stays, xfer)

        elsize = state.tensors[0]["fp32"].element_size()
        moved_kinds = len(header["kinds"]) if header["master_moves"] else len(moment_kinds(header["kinds"]))
        record = {
            "event": "resize", "step": self.global_steps, "from": old_ws, "to": world_size,
            "bytes_moved": plan.numel_moved * elsize * moved_kinds, "bytes_kept": plan.numel_kept * elsize * moved_kinds,
            "plan_s": plan_s, "group_s": group_s, "transfer_s": stats.seconds - stats.keep_seconds,
            "keep_s": stats.keep_seconds, "rebuild_s": 0.0, "xfer_group_s": xfer_wait,
            "transfer_overlap": overlap, "generation": g_new,
            "peak_staging_bytes": stats.peak_staging_bytes, "messages": stats.messages,
            "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
        }
        basic, scheduler, model = self.optimizer.optimizer, self.lr_scheduler, self.module
        old_flat = () if zero3 else tuple(zero_optimizer_of(self).bit16_groups_flat)
        if not stays and dt.config.leaver_nice:
            # the rest of a leaver's life (teardown, then an interpreter exit with torch loaded:
            # about 0.5 s of CPU) must not slow the survivors' rebuild and first steps where they
            # share the host. Linux sets the nice value per thread: this one only, not the threads
            # still sending the leaver's partitions.
            os.nice(dt.config.leaver_nice)
        t = clock()
        teardown(self)
        if not stays:
            standby = dt.config.standby and dt.member not in must_leave and not dt.preempted
            dt.retired = True
            dt.pending = PendingResize(transfer, None, [], record, rss_base, xfer)
            self._complete_pending()  # a leaver hands everything over before it goes
            logger.info(f"member {dt.member} left the job after step {self.global_steps} "
                        f"({record['bytes_sent'] / 2**20:.2f} MiB handed over)"
                        + ("; it stands by" if standby else ""))
            if not standby:
                if tdist.is_initialized():
                    tdist.destroy_process_group()
                return None
            if whole is not None:
                release_zero3_params(model, whole, dt.param_attrs)
            return self._stand_by(g_new, model, basic, scheduler)
        if whole is not None:
            release_zero3_params(model, whole, dt.param_attrs)
            whole = None
        rebuild_s = clock() - t
        if not grow:
            t = clock()
            reused = dt.membership.form(g_new, plan.new_members, dt.member, dt.backend, self._group_timeout(),
                                        step=dt.published_step[g_new])
            group_s += clock() - t
        t = clock()
        dt.members = plan.new_members
        dt.generation += 1  # before construct: the new snapshot engine keys the store by generation
        dt.rebuild_broadcast = plan.survivor_ranks if grow else "none"
        construct(self, dt, model, basic, None, scheduler, ds_config_for(dt, split, client_objects=True), light=True,
                  reuse_flat=old_flat)
        old_flat = None
        self._keep_returned_optimizer()
        install_state(self, header, dests, joiner=False)
        rebuild_s += clock() - t
        dt.pending = PendingResize(transfer, dests, scalars_for(plan, header["scalars"]), record, rss_base, xfer)
        record.update(group_s=group_s, rebuild_s=rebuild_s, group_reused=reused)
        if prepared is not None:
            # the new world's construction (joiners' start-up, group rendezvous) ran behind training
            # from the request to ``ready_at``; what is left at the switch is group_s + xfer_group_s
            built = (prepared.ready_at or t0) - prepared.started
            record.update(request=prepared.index, prepare_s=t0 - prepared.started, background_build_s=built,
                          hidden_fraction=built / max(built + group_s + xfer_wait, 1e-9))
        self._evict_groups()
        state = None  # the old partitions go as soon as the transfer is done with them
        if overlap != "step" or transfer.done():
            self._complete_pending()
        record["seconds"] = clock() - t0
        if dt.pending is None:
            self._publish(record)  # else wait_transition publishes it
        return record

    def _keep_returned_optimizer(self) -> None:
        """After a rebuild: the optimizer object handed out at start shares the rebuilt one's state."""
        returned = self._dt.returned_optimizer
        if returned is not None and returned is not self.optimizer:
            returned.__dict__ = self.optimizer.__dict__
            self.optimizer = returned

    def _group_timeout(self) -> float:
        """Limit of a group rendezvous that may wait for joiners to start, seconds."""
        return self._dt.config.join_timeout_s

    def _evict_groups(self) -> None:
        """Shut down cached groups with a member that is neither in the job nor standing by."""
        dt = self._dt
        alive = set(dt.members) | set(dt.standby)
        dt.membership.groups.evict(lambda members: set(members) <= alive)

    def _stand_by(self, formed: int, model, basic, scheduler) -> Optional[dict]:
        """This process left at a shrink and stands by: it keeps its process groups (detached)
        and waits until a later generation takes it back (then it joins as a joiner would,
        reusing its model and optimizer objects, and this returns the join record) or the job
        ends (then it returns None and :attr:`is_member` stays False)."""
        dt = self._dt
        dt.membership.groups.detach()
        membership = dt.membership
        membership.stop_waiting = lambda: dt.preempted
        while True:
            rec = membership.wait_recall(formed, dt.member)
            if rec is None:
                if dt.preempted:
                    membership.leave_standby(dt.member)
                logger.info(f"member {dt.member} stops standing by: "
                            + ("preemption notice" if dt.preempted else "the job ended"))
                membership.groups.close()
                return None
            try:
                return self._rejoin(rec, model, basic, scheduler)
            except TransitionAbortedError:
                if membership.is_abandoned(rec.generation, rec.step):
                    formed = rec.generation - 1
                    continue
                if membership.job_over():
                    membership.groups.close()
                    return None
                raise

    def _wait_unless_given_up(self, rec: GenerationRecord, done, poll_s: float = 0.02) -> None:
        """A standby process being taken back waits for ``done()``.

        Raises:
            TransitionAbortedError: generation ``rec`` was given up, or the job ended, first.
        """
        membership = self._dt.membership
        while not done():
            if membership.is_abandoned(rec.generation, rec.step) or membership.job_over():
                raise TransitionAbortedError(f"generation {rec.generation} was given up before it formed")
            time.sleep(poll_s)

    def _rejoin(self, rec: GenerationRecord, model, basic, scheduler) -> dict:
        """A standby process joins generation ``rec`` (its membership names this process)."""
        dt = self._dt
        t0 = time.perf_counter()
        logger.info(f"member {dt.member} taken back as rank {rec.members.index(dt.member)} of {rec.world_size} "
                    f"(generation {rec.generation})")
        dt.published_step[rec.generation] = rec.step
        membership = dt.membership
        # built in the background, so that a request given up (or the job's end) does not leave
        # this process stuck in a rendezvous its peers never reach
        membership.prepare(rec.generation, rec.members, rec.step, self._group_timeout())
        self._wait_unless_given_up(rec, lambda: membership.groups.ready(rec.members))
        reused = membership.form(rec.generation, rec.members, dt.member, dt.backend, self._group_timeout(),
                                 step=rec.step)
        xfer = build_joiner_xfer(dt, rec, self._group_timeout())
        own = own_layout(dt, model, [list(g["params"]) for g in basic.param_groups], rec.world_size)
        # the survivors may still give the request up (a preemption at the boundary where all
        # were ready): wait for them to switch before entering the header's broadcast
        try:
            self._wait_unless_given_up(rec, lambda: membership.is_switching(rec.generation, rec.step))
        except TransitionAbortedError:
            membership.groups.detach()
            raise
        try:
            header, plan = join_header(dt, rec, own)
        except RuntimeError as err:
            raise TransitionAbortedError(f"generation {rec.generation}: the header did not arrive: {err}") from err
        dests, _, transfer, overlap, xfer = begin_transition(plan, dt, rec.generation, header, None, receives=True,
                                                             group=xfer.get(self._group_timeout()))
        dt.members = plan.new_members
        dt.generation = rec.generation
        dt.retired = False
        dt.rebuild_broadcast = plan.survivor_ranks
        construct(self, dt, model, basic, None, scheduler,
                  ds_config_for(dt, dt.split(rec.world_size), client_objects=True), light=True)
        self._keep_returned_optimizer()
        install_state(self, header, dests, joiner=True)
        record = {"event": "join", "step": self.global_steps, "generation": rec.generation, "transfer_s": 0.0,
                  "group_reused": reused, "seconds": time.perf_counter() - t0}
        dt.pending = PendingResize(transfer, dests, scalars_for(plan, header["scalars"]), record, None, xfer)
        if overlap != "step":
            self.wait_transition()
        self._evict_groups()
        return record

    def _header(self, plan: Plan, state: PartitionState, must_leave: Tuple[str, ...] = ()) -> dict:
        """Rank 0's account of the transition and of the non-tensor training state.

        ``loss_scaler``: the attributes of the ZeRO optimizer's loss scaler (DeepSpeed's
        ``DynamicLossScaler`` in fp16: ``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
        ``cur_hysteresis``, ...; a static ``LossScaler`` of 1 in bf16/fp32). Every rebuilt engine
        starts with a fresh scaler, so every process of the new world installs rank 0's.
        """
        sched = self.lr_scheduler
        scaler = getattr(self.optimizer, "loss_scaler", None)
        return {
            "digest": plan.digest(),
            "old_layout": plan.old_layout.to_dict(),
            "old_members": list(plan.old_members),
            "new_members": list(plan.new_members),
            "kinds": list(state_kinds(state)),
            "master_moves": not master_from_working(self),
            "max_inflight_bytes": self._dt.config.max_inflight_bytes,
            "dtype": str(state.tensors[0]["fp32"].dtype).replace("torch.", ""),
            "scalars": state.scalars,
            "counters": {"global_steps": self.global_steps, "global_samples": self.global_samples,
                         "skipped_steps": self.skipped_steps, "requests_seen": self._dt.requests_seen},
            "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in self.optimizer.optimizer.param_groups],
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "loss_scaler": None if scaler is None else {"class": type(scaler).__name__, "state": dict(vars(scaler))},
            # who stands by after this transition, and the recent memberships (group reuse)
            "standby": [m for m in self._dt.standby if m not in plan.new_members] + (
                [m for m in plan.old_members if m not in plan.new_members and m not in must_leave]
                if self._dt.config.standby else []),
            "history": [list(m) for m in (self._dt.history + [tuple(plan.new_members)])[-8:]],
        }


def state_kinds(state: PartitionState) -> Tuple[str, ...]:
    """The state kinds every group holds (the same for every group).

    Raises:
        DynatrainError: groups hold different kinds (an optimizer we cannot move).
    """
    kinds = state.kinds(0)
    for g in range(1, len(state.tensors)):
        if state.kinds(g) != kinds:
            raise DynatrainError(f"parameter groups 0 and {g} hold different optimizer states "
                                 f"({list(kinds)} vs {list(state.kinds(g))})")
    return kinds


def scalars_for(plan: Plan, scalars: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The non-partition optimizer states (Adam's ``step``) of each new partition, from those of
    the old partitions (``scalars[b]`` for old partition ``b``): a new partition takes those of
    the first old partition of its parameter group. At stages 1/2 partitions are the parameter
    groups; at stage 3 the sub-groups change with the world size."""
    old, new = plan.old_layout, plan.new_layout
    first = {}
    for b in range(old.num_partitions):
        first.setdefault(old.partition_group(b), scalars[b])
    return [first[new.partition_group(b)] for b in range(new.num_partitions)]


def allocate_partitions(plan: Plan, member: str, kinds, dtype) -> Dict[int, Dict[str, torch.Tensor]]:
    """New partitions of ``member`` in ``plan.new_layout``, ``{group: {kind: 1-D tensor}}``.

    Uninitialised except for the elements no transfer of the plan writes (DeepSpeed's alignment
    padding), which are zeroed: the transfers fill the rest, so the memory is touched once.
    """
    device = get_accelerator().current_device_name()
    rank = plan.new_members.index(member)
    layout = plan.new_layout
    covered: Dict[int, List[Tuple[int, int]]] = {}
    for t in plan.transfers:
        if t.dst == rank:
            covered.setdefault(t.dst_group, []).append((t.dst_offset, t.dst_offset + t.numel))
    out = {}
    for g in range(layout.num_partitions):
        n = layout.partition_numel(g)
        out[g] = {k: torch.empty(n, dtype=dtype, device=device) for k in kinds}
        pos = 0
        for lo, hi in sorted(covered.get(g, [])) + [(n, n)]:
            if lo > pos:
                for k in kinds:
                    out[g][k][pos:lo].zero_()
            pos = max(pos, hi)
    return out


def xfer_prefix(plan_or_ranks, generation: int, step: int) -> str:
    """Store prefix of the transition group into ``generation`` published at ``step``."""
    ranks = plan_or_ranks if isinstance(plan_or_ranks, tuple) else transition_ranks(plan_or_ranks)
    return group_prefix(generation, ranks, step, kind="xfer")


def data_plane(plan: Plan, dt: ElasticState, generation: int, group=None):
    """``(ranks, group, overlap)`` of the transition into ``generation``: the member of each rank,
    the private gloo group the bytes go through (:func:`transition_group`, or ``group`` when it
    was built ahead), and the ``transfer_overlap`` mode that applies. State on an accelerator is
    staged through host buffers and completes before the rebuild (overlap ``"none"``): a
    background thread would copy device memory on another stream than training's."""
    ranks = transition_ranks(plan)
    if group is None:
        group = transition_group(dt.membership.new_client(),
                                 xfer_prefix(ranks, generation, dt.published_step.get(generation, 0)),
                                 ranks, dt.member, dt.config.collective_timeout_s)
    on_host = get_accelerator().device_name() == "cpu"
    return ranks, group, dt.config.transfer_overlap if on_host else "none"


def begin_transition(plan: Plan, dt: ElasticState, generation: int, header: dict, sources, receives: bool,
                     group=None):
    """Start moving this process's share of ``plan`` into ``generation`` (survivors, leavers and
    joiners alike, after the header is agreed).

    The master partitions move first when the header says they must (bf16/fp16 training); the
    optimizer moments then move in a background thread, waited for here when the
    ``transfer_overlap`` that applies is ``"none"``.

    Args:
        sources: this process's old partitions (``PartitionState.tensors``), None for a joiner.
        receives: whether this process is in the new world (its new partitions are allocated).
        group: the transition group when it was built ahead (None: built here).

    Returns:
        ``(dests, stats of the master phase, PendingTransition of the moments, overlap mode,
        the transition group)``; shut the group down once the moments have arrived.
    """
    kinds, master_moves = tuple(header["kinds"]), bool(header["master_moves"])
    moments = moment_kinds(kinds)
    dests = allocate_partitions(plan, dt.member, kinds if master_moves else moments,
                                getattr(torch, header["dtype"])) if receives else None
    ranks, group, overlap = data_plane(plan, dt, generation, group)
    run = dict(dests=dests, timeout_s=dt.config.collective_timeout_s,
               max_inflight_bytes=header["max_inflight_bytes"], ranks=ranks)
    stats = execute_plan(plan, dt.member, group, (MASTER,) if master_moves else (),
                         sources=_only(sources, (MASTER,)), **run)
    # the background thread holds only the moments: the old master goes with the old engine
    transfer = start_plan(plan, dt.member, group, moments, sources=_only(sources, moments), **run)
    if overlap == "none":
        transfer.wait()  # every wait inside is bounded by collective_timeout_s
    return dests, stats, transfer, overlap, group


def _only(parts: Optional[List[Dict[str, torch.Tensor]]], kinds) -> Optional[List[Dict[str, torch.Tensor]]]:
    """``parts`` restricted to ``kinds`` (references, no copies); None stays None."""
    return None if parts is None else [{k: g[k] for k in kinds if k in g} for g in parts]


def moment_kinds(kinds) -> Tuple[str, ...]:
    """The state kinds other than the fp32 master (the optimizer's own state, e.g. Adam moments)."""
    return tuple(k for k in kinds if k != MASTER)


def master_from_working(engine) -> bool:
    """True when the engine trains in fp32: DeepSpeed's set-up clones the master partition from
    the working parameters, which every optimizer step makes an exact copy of the master, so a
    resize need not move the master (deepspeed/runtime/zero/stage_1_and_2.py ``step``)."""
    zopt = zero_optimizer_of(engine)
    return all(p.dtype == f.dtype for grp, f in zip(working_partitions(zopt), fp32_partitions(zopt))
               for p in grp[:1])


@dataclass
class PendingResize:
    """A resize whose optimizer-state transfer still runs in the background."""

    transfer: PendingTransition
    dests: Optional[Dict[int, Dict[str, torch.Tensor]]]
    scalars: List[Dict[str, Any]]
    record: dict
    rss_base: Optional[int]
    group: Any = None  # the transition group, shut down once the transfer is over


@dataclass
class Preparation:
    """A ``dynatrain resize`` request being prepared in the background: the next generation is
    published, its joiners started, and its process groups built while the current one trains.

    Attributes:
        index: the request's index in the store.  world_size: the requested size.
        generation, members, step: the generation being formed (members in rank order), published
            at optimizer step ``step``.
        xfer: the transition group being built (:class:`~ds_dynatrain.groups.BackgroundGroup`).
        started: ``time.perf_counter()`` when it was decided.  ready_at: when this process saw its
            groups built (None before).
    """

    index: int
    world_size: int
    generation: int
    members: Tuple[str, ...]
    step: int
    xfer: Any
    started: float
    ready_at: Optional[float] = None

    def state(self, dt: "ElasticState", check_joiners: bool = False) -> Tuple[bool, Optional[str]]:
        """``(ready, error)`` of this process's builds, without waiting. ``check_joiners`` (rank 0):
        also whether a joiner of this generation died before it joined (its agent says so)."""
        groups = dt.membership.groups
        mine = dt.member in self.members
        err = self.xfer.error or (groups.error(self.members) if mine else None)
        if err is None and check_joiners:
            dead = dt.membership.failed_joiners([m for m in self.members if m not in dt.members])
            if dead:
                err = f"joiner(s) {list(dead)} died before they joined"
        ready = self.xfer.ready() and (not mine or groups.ready(self.members))
        if ready and self.ready_at is None:
            self.ready_at = time.perf_counter()
        return ready, err


def _proc_status_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _start_peak_rss() -> Optional[int]:
    """Reset the process's peak resident set (Linux ``clear_refs`` 5) and return the current
    resident set, bytes; None where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status_bytes("VmRSS")


def _peak_extra_bytes(base: Optional[int]) -> int:
    """Peak resident set since :func:`_start_peak_rss` above both the start and the current
    resident set, bytes (0 if unmeasurable): the transient memory of the transition."""
    hwm, rss = _proc_status_bytes("VmHWM"), _proc_status_bytes("VmRSS")
    if base is None or hwm is None or rss is None:
        return 0
    return max(0, hwm - max(base, rss))


def own_layout(dt: ElasticState, model, groups, world_size: int) -> ZeroLayout:
    """The layout this process's model (parameter ``groups`` as the optimizer holds them) has at
    ``world_size`` (what a joiner checks rank 0's layout against)."""
    from .bridge import layout_for_model
    ds = dt.ds_config
    dtype = (torch.bfloat16 if ds.get("bf16", {}).get("enabled") else torch.float16
             if ds.get("fp16", {}).get("enabled") else next(model.parameters()).dtype)
    return layout_for_model(list(model.named_parameters()), groups, world_size, ds, dtype)


def build_joiner_xfer(dt: ElasticState, rec: GenerationRecord, timeout_s: float) -> BackgroundGroup:
    """A joiner starts building the transition group of ``rec`` before it waits for the header:
    the old members may have built theirs ahead (a prepared request) and wait for it."""
    ranks, connect, me = rec.transition_members, dt.membership.new_client, dt.member
    return BackgroundGroup(lambda: transition_group(connect(), xfer_prefix(ranks, rec.generation, rec.step), ranks, me,
                                                    timeout_s), name=f"dynatrain-xfer-{rec.generation}")


def join_header(dt: ElasticState, rec: GenerationRecord, own: ZeroLayout) -> Tuple[dict, Plan]:
    """A joiner's side of :func:`agree_on_header` for generation ``rec``: receive the header from
    ``rec.header_rank``, check the layout against ``own`` and the plan's digest. Returns
    ``(header, plan)``.

    Raises:
        LayoutMismatchError, TransitionAbortedError: as :func:`agree_on_header`.
    """
    box = {}

    def check(header):
        old = ZeroLayout.from_dict(header["old_layout"])
        old.check_same_model(own.with_world_size(old.world_size))
        plan = plan_transition(old, old.with_world_size(rec.world_size), header["old_members"], header["new_members"])
        box["plan"] = plan
        if plan.digest() != header["digest"]:
            return "plan digest differs"
        if transition_ranks(plan) != rec.transition_members:
            return f"transition members {list(transition_ranks(plan))} differ from the published generation's"
        return None

    header = agree_on_header(None, check, src=rec.header_rank)
    return header, box["plan"]


def agree_on_header(header: Optional[dict], check, src: int = 0) -> dict:
    """Broadcast rank ``src``'s header; every rank checks it; any problem is the same error
    everywhere.

    ``check(header)`` returns None or a problem string. Raises :class:`LayoutMismatchError` on
    the rank whose check failed with a layout problem, :class:`TransitionAbortedError` elsewhere;
    both name the rank and the problem. Nothing has moved when this raises.
    """
    box = [header]
    tdist.broadcast_object_list(box, src=src)
    header = box[0]
    try:
        problem = check(header)
    except LayoutMismatchError as err:
        problem = f"layout mismatch: {err}"
    problems: List[Optional[str]] = [None] * tdist.get_world_size()
    tdist.all_gather_object(problems, problem)
    bad = [(r, p) for r, p in enumerate(problems) if p]
    if bad:
        text = "; ".join(f"rank {r}: {p}" for r, p in bad)
        if problem and problem.startswith("layout mismatch"):
            raise LayoutMismatchError(f"transition refused before any byte moved: {text}")
        raise TransitionAbortedError(f"transition refused before any byte moved: {text}")
    return header


def teardown(engine: ElasticEngine) -> None:
    """Finish the pending snapshot, detach the engine from the model and give the torch optimizer
    back its parameters."""
    if isinstance(engine.checkpoint_engine, SnapshotCheckpointEngine):
        engine.checkpoint_engine.close()
    zopt = zero_optimizer_of(engine)
    basic = zopt.optimizer
    if is_zero3(zopt):
        by_group: Dict[int, list] = {}
        for i, sub in enumerate(zopt.fp16_groups):
            by_group.setdefault(zopt.sub_group_to_group_id[i], []).extend(sub)
        for i, g in enumerate(basic.param_groups):
            g["params"] = by_group.get(i, [])
    else:
        for i, g in enumerate(basic.param_groups):
            g["params"] = list(zopt.bit16_groups[i])
    basic.state.clear()
    detach_engine(engine)


def install_state(engine: ElasticEngine, header: dict, dests, joiner: bool) -> None:
    """Put the received master partitions (when they were moved) and rank 0's non-tensor state
    into a freshly built engine. The optimizer moments follow in :meth:`ElasticEngine.wait_transition`.

    Raises:
        DynatrainError: the rebuilt engine's loss scaler is of another kind than rank 0's.
    """
    if dests is not None and all(MASTER in dests[g] for g in dests):
        install_master(engine, [dests[g][MASTER] for g in sorted(dests)])
    sent = header.get("loss_scaler")
    if sent is not None:  # survivors and joiners alike: the rebuild made a fresh scaler
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if type(scaler).__name__ != sent["class"]:
            raise DynatrainError(f"rank 0's loss scaler is a {sent['class']}, this rebuilt engine's a "
                                 f"{type(scaler).__name__}: the processes run different configs")
        scaler.__dict__.update(sent["state"])
    c = header["counters"]
    engine.global_steps = c["global_steps"]
    engine.global_samples = c["global_samples"]
    engine.skipped_steps = c["skipped_steps"]
    engine._dt.requests_seen = c.get("requests_seen", engine._dt.requests_seen)
    engine._dt.standby = tuple(header.get("standby", ()))
    engine._dt.history = [tuple(m) for m in header.get("history", ())]
    engine.micro_steps = c["global_steps"] * engine.gradient_accumulation_steps()
    if joiner:
        if engine.lr_scheduler is not None and header["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(header["lr_scheduler"])
        for g, h in zip(engine.optimizer.optimizer.param_groups, header["param_groups"]):
            g.update(h)
        torch.set_rng_state(header["rng"]["torch"])
        random.setstate(header["rng"]["python"])
        np.random.set_state(header["rng"]["numpy"])
