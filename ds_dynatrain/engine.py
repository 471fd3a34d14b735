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
   new generation's process group; shrink: the old group is the transition group;
4. rank 0 broadcasts a header (plan inputs, non-tensor state) and every process checks it agrees
   (plan digest, model layout) before any byte moves; a disagreement is the same error everywhere;
5. the transition engine moves fp32 master partitions and optimizer moments by the plan;
6. leavers detach and stop iterating; survivors re-form the process group (shrink), rebuild the
   engine in place and inject the received partitions, counters, scheduler and RNG state.
"""
from __future__ import annotations

import copy
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

from .batch import BatchSplit, split_global_batch
from .bridge import (PartitionState, detach_engine, extract_partitions, inject_partitions, layout_of,
                     relink_optimizer_state, zero_optimizer_of)
from .config import DynatrainConfig
from .errors import DynatrainError, LayoutMismatchError, NotAMemberError, ResizeRefusedError, TransitionAbortedError
from .launch_env import member_id
from .layout import ZeroLayout
from .membership import GenerationRecord, Membership
from .metrics import MetricsWriter, format_resize, format_step, logger
from .planner import Plan, assign_members, plan_transition
from .snapshot import SnapshotCheckpointEngine
from .transition import execute_plan


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
              ds_config: dict) -> None:
    """Run ``DeepSpeedEngine.__init__`` on ``engine`` (a new object or one being rebuilt)."""
    import deepspeed
    config_class = DeepSpeedConfig(ds_config)
    deepspeed.set_optimizer_flags(config_class, model)
    DeepSpeedEngine.__init__(engine, args=None, model=model, optimizer=optimizer, model_parameters=model_parameters,
                             training_data=None, lr_scheduler=lr_scheduler, mpu=None, dist_init_required=False,
                             collate_fn=dt.collate_fn, config=ds_config, config_class=config_class)
    engine._configure_python_gc()
    engine._dt = dt
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
    optimizer's ``step`` is a scalar and gets none).
    """

    PATTERN = re.compile(r"optimizer_state_dict/(?:single_partition_of_fp32_groups/(\d+)|"
                         r"base_optimizer_state/(?:state/)?(\d+)/(\w+))")

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
        if self.is_gradient_accumulation_boundary() and isinstance(self.checkpoint_engine, SnapshotCheckpointEngine):
            # the optimizer step is the first thing that changes the state a snapshot captures
            self._dt.snapshot_stall_s += self.checkpoint_engine.wait_captured()
        super().step(lr_kwargs=lr_kwargs)
        if self.global_steps != before:
            self._after_optimizer_step()

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's ``save_checkpoint`` through the snapshot engine; ``latest`` is replaced
        atomically by the engine's commit (DeepSpeed's own write of it is skipped)."""
        self._require_member()
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        ce = self.checkpoint_engine
        if isinstance(ce, SnapshotCheckpointEngine):
            ce.publish_latest = save_latest  # the engine's commit replaces ``latest`` atomically
            save_latest = False
        return super().save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """DeepSpeed's ``load_checkpoint`` (same world size) through the snapshot engine, which
        loads with ``weights_only=True``; afterwards the optimizer-state fragments are linked
        again so ``deepspeed.utils.safe_get_full_optimizer_state`` works at once."""
        self._require_member()
        out = super().load_checkpoint(load_dir, tag=tag, **kwargs)
        if out[0] is not None:
            relink_optimizer_state(self)
        return out

    def resize(self, world_size: int) -> Optional[dict]:
        """Change the data-parallel world size now, in memory.

        Collective: every member of the current generation calls it at the same step boundary
        (the resize schedule of the config does this from :meth:`step`).

        Args:
            world_size: the new data-parallel world size.

        Returns:
            The resize record (``from``, ``to``, ``bytes_moved``, ``seconds``, ...) on members of
            the new generation; None in a process that left, or when the size does not change.

        Raises:
            ResizeRefusedError: ``world_size`` < 1, above ``max_world_size``, breaks the global
                batch, or the job was not started by ``dynatrain launch``; nothing has changed.
            LayoutMismatchError, TransitionAbortedError: the ranks disagreed or a peer failed.
        """
        self._require_member()
        dt = self._dt
        split = dt.split(world_size)
        if dt.membership is None:
            raise ResizeRefusedError("online resizing needs the job to be started by `dynatrain launch` "
                                     "(it hosts the membership store and starts joiners)")
        if world_size == self.dp_world_size:
            return None
        zero_optimizer_of(self)  # refuse engines we cannot resize before anything changes
        return self._resize(world_size, split)

    # ------------------------------------------------------------------ step boundary
    def _require_member(self):
        if getattr(self, "_dt", None) is not None and self._dt.retired:
            raise NotAMemberError(f"member {self._dt.member} left the job at a resize; this engine cannot train")

    def _after_optimizer_step(self):
        dt = self._dt
        step = self.global_steps
        # on the accelerator: NCCL reduces device tensors only
        totals = torch.tensor([dt.loss_sum, float(dt.loss_count)], dtype=torch.float64,
                              device=get_accelerator().current_device_name())
        tdist.all_reduce(totals)
        totals = totals.cpu()
        dt.loss_sum, dt.loss_count = 0.0, 0
        loss = float(totals[0] / max(totals[1], 1.0))
        lr = float(self.get_lr()[0]) if self.get_lr() else float("nan")
        if self.global_rank == 0:
            dt.metrics.write({"event": "step", "step": step, "world_size": self.dp_world_size, "loss": loss, "lr": lr})
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
        if target is not None:
            self.resize(target)
        self._spawn_ahead()

    def _spawn_ahead(self):
        """Ask the agent to start the joiners of the next scheduled grow a few steps early, so
        that their start-up (imports, model construction) overlaps training."""
        dt = self._dt
        if dt.membership is None or not self.is_member:
            return
        upcoming = [(s, w) for s, w in sorted(dt.schedule.items()) if s >= self.global_steps]
        if not upcoming:
            return
        step, world_size = upcoming[0]
        if step == self.global_steps or world_size <= self.dp_world_size:
            return
        if step - self.global_steps > dt.config.spawn_lookahead_steps:
            return
        self._request_joiners(world_size)

    def _request_joiners(self, world_size: int) -> Tuple[str, ...]:
        """Publish the next generation for ``world_size`` and have its joiners started (once).

        If joiners were already started for the next generation with another membership (a
        scheduled grow, then a manual resize to another size), they are cancelled first."""
        dt = self._dt
        g = dt.generation + 1
        old_ws = self.dp_world_size
        joiners = tuple(member_id(g, r) for r in range(old_ws, world_size))
        new_members = assign_members(dt.members, world_size, joiners)
        if dt.published.get(g) == new_members:
            return new_members
        if self.global_rank == 0:
            stale = dt.spawned_for.get(g, ())
            if stale:
                dt.membership.cancel_spawn(g, stale)
            dt.membership.publish(GenerationRecord(g, world_size, new_members, self.global_steps))
            if joiners:
                dt.membership.request_spawn(g, world_size, list(range(old_ws, world_size)), joiners)
        dt.spawned_for[g] = joiners
        dt.published[g] = new_members
        return new_members

    def cancel_pending_joiners(self) -> None:
        """Stop joiners started for a generation that will not be formed (the job is ending)."""
        dt = self._dt
        if dt.membership is None or self.global_rank != 0:
            return
        for g, joiners in sorted(dt.spawned_for.items()):
            if g > dt.generation and joiners:
                dt.membership.cancel_spawn(g, joiners)
        dt.spawned_for = {g: j for g, j in dt.spawned_for.items() if g <= dt.generation}

    # ------------------------------------------------------------------ the resize
    def _resize(self, world_size: int, split: BatchSplit) -> Optional[dict]:
        dt = self._dt
        clock = time.perf_counter
        t0 = clock()
        old_ws = self.dp_world_size
        grow = world_size > old_ws
        new_members = self._request_joiners(world_size)
        old_layout = layout_of(self)
        plan = plan_transition(old_layout, old_layout.with_world_size(world_size), dt.members, new_members)
        state = extract_partitions(self)
        header = self._header(plan, state) if self.global_rank == 0 else None
        stays = dt.member in plan.new_members
        new_rank = plan.new_members.index(dt.member) if stays else None
        dests = allocate_partitions(plan.new_layout, new_rank, state_kinds(state),
                                    state.tensors[0]["fp32"].dtype) if stays else None
        plan_s = clock() - t0

        group_s = 0.0
        if grow:
            # the new generation's group is the transition group; the old engine stays as it is
            # (its groups dead) until the plan is agreed and executed
            t = clock()
            if self.global_rank == 0:
                dt.membership.go(dt.generation + 1)
            dt.membership.form(dt.generation + 1, new_rank, world_size, dt.backend, dt.config.join_timeout_s)
            group_s += clock() - t
            pg_rank_of = {m: r for r, m in enumerate(plan.new_members)}
        else:
            pg_rank_of = {m: r for r, m in enumerate(plan.old_members)}
        t = clock()
        header = agree_on_header(header, lambda h: "plan digest differs" if h["digest"] != plan.digest() else None)
        kinds = tuple(header["kinds"])
        stats = execute_plan(plan, dt.member, pg_rank_of, kinds, sources=state.tensors, dests=dests,
                             timeout_s=dt.config.collective_timeout_s)
        transfer_s = clock() - t

        t = clock()
        basic, scheduler, model = self.optimizer.optimizer, self.lr_scheduler, self.module
        teardown(self)
        if not stays:
            if tdist.is_initialized():
                tdist.destroy_process_group()
            dt.retired = True
            logger.info(f"member {dt.member} left the job after step {self.global_steps} "
                        f"({stats.bytes_sent / 2**20:.2f} MiB handed over)")
            return None
        rebuild_s = clock() - t
        if not grow:
            t = clock()
            dt.membership.form(dt.generation + 1, new_rank, world_size, dt.backend, dt.config.collective_timeout_s)
            group_s += clock() - t
        t = clock()
        dt.members = plan.new_members
        dt.generation += 1  # before construct: the new snapshot engine keys the store by generation
        construct(self, dt, model, basic, None, scheduler, ds_config_for(dt, split, client_objects=True))
        returned = dt.returned_optimizer
        if returned is not None and returned is not self.optimizer:
            # the optimizer object handed out at start shares the rebuilt optimizer's state
            returned.__dict__ = self.optimizer.__dict__
            self.optimizer = returned
        install_state(self, header, dests, joiner=False)
        rebuild_s += clock() - t

        elsize = sum(state.tensors[0][k].element_size() for k in kinds)
        record = {
            "event": "resize", "step": self.global_steps, "from": old_ws, "to": world_size,
            "bytes_moved": plan.numel_moved * elsize, "bytes_kept": plan.numel_kept * elsize,
            "seconds": clock() - t0, "plan_s": plan_s, "group_s": group_s, "transfer_s": transfer_s,
            "rebuild_s": rebuild_s,
        }
        dt.resizes.append(record)
        if self.global_rank == 0:
            dt.metrics.write(record)
            logger.info(format_resize(record))
        return record

    def _header(self, plan: Plan, state: PartitionState) -> dict:
        """Rank 0's account of the transition and of the non-tensor training state."""
        sched = self.lr_scheduler
        return {
            "digest": plan.digest(),
            "old_layout": plan.old_layout.to_dict(),
            "old_members": list(plan.old_members),
            "new_members": list(plan.new_members),
            "kinds": list(state_kinds(state)),
            "dtype": str(state.tensors[0]["fp32"].dtype).replace("torch.", ""),
            "scalars": state.scalars,
            "counters": {"global_steps": self.global_steps, "global_samples": self.global_samples,
                         "skipped_steps": self.skipped_steps},
            "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"}
                             for g in self.optimizer.optimizer.param_groups],
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
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


def allocate_partitions(layout: ZeroLayout, rank: int, kinds, dtype) -> Dict[int, Dict[str, torch.Tensor]]:
    """Zeroed new partitions of ``rank`` (padding stays zero), ``{group: {kind: 1-D tensor}}``."""
    device = get_accelerator().current_device_name()
    return {g: {k: torch.zeros(layout.partition_numel(g), dtype=dtype, device=device) for k in kinds}
            for g in range(layout.num_groups)}


def agree_on_header(header: Optional[dict], check) -> dict:
    """Broadcast rank 0's header; every rank checks it; any problem is the same error everywhere.

    ``check(header)`` returns None or a problem string. Raises :class:`LayoutMismatchError` on
    the rank whose check failed with a layout problem, :class:`TransitionAbortedError` elsewhere;
    both name the rank and the problem. Nothing has moved when this raises.
    """
    box = [header]
    tdist.broadcast_object_list(box, src=0)
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
    for i, g in enumerate(basic.param_groups):
        g["params"] = list(zopt.bit16_groups[i])
    basic.state.clear()
    detach_engine(engine)


def install_state(engine: ElasticEngine, header: dict, dests, joiner: bool) -> None:
    """Put received partitions and rank 0's non-tensor state into a freshly built engine."""
    inject_partitions(engine, PartitionState(tensors=[dests[g] for g in sorted(dests)], scalars=header["scalars"]))
    c = header["counters"]
    engine.global_steps = c["global_steps"]
    engine.global_samples = c["global_samples"]
    engine.skipped_steps = c["skipped_steps"]
    engine.micro_steps = c["global_steps"] * engine.gradient_accumulation_steps()
    if joiner:
        if engine.lr_scheduler is not None and header["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(header["lr_scheduler"])
        for g, h in zip(engine.optimizer.optimizer.param_groups, header["param_groups"]):
            g.update(h)
        torch.set_rng_state(header["rng"]["torch"])
        random.setstate(header["rng"]["python"])
        np.random.set_state(header["rng"]["numpy"])
