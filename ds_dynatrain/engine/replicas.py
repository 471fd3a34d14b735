"""The peer replicas of a running engine (``recovery.peer_replicas``): what one step's state is
besides its partitions, the refresh at the step boundary, and putting a copy back into a rebuilt
engine (DESIGN.md "Recovery in place").

At a refresh boundary (every ``recovery.interval_steps`` optimizer steps) a rank waits for its
previous refresh *before* the boundary's all-reduce and starts the next one after it, so that a
completed all-reduce proves every replica of the previous refresh complete
(:mod:`~ds_dynatrain.transition.replicas`).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ..elastic.keys import MEMBER_NODE_KEY, group_prefix
from ..errors import TransitionAbortedError
from ..planner.assignment import import_solver_in_background
from ..planner.recovery import replica_ring
from ..transition.execute import transition_group
from ..transition.replicas import ReplicaSet
from ..zero.state import extract_partitions, install_master, install_optimizer_state, state_kinds, working_from_master
from .state import ElasticState


@dataclass
class StepMeta:
    """The non-tensor training state of one step, as this rank had it (restored with its copy).

    Attributes:
        counters: ``global_steps``, ``global_samples``, ``skipped_steps``.  scalars: per
            partition, the optimizer's non-partition states (Adam's ``step``).  lr_scheduler: its
            state dict (None: none).  param_groups: the optimizer groups' hyper-parameters.
        rng: this rank's ``torch``, ``python`` and ``numpy`` RNG states.  loss_scaler: the ZeRO
            optimizer's loss scaler's attributes (None: none).
    """

    counters: Dict[str, int]
    scalars: List[Dict[str, Any]]
    lr_scheduler: Optional[dict]
    param_groups: List[dict]
    rng: Dict[str, Any]
    loss_scaler: Optional[dict]


def step_meta(engine, scalars) -> StepMeta:
    sched = engine.lr_scheduler
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return StepMeta(
        counters={
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
        },
        scalars=copy.deepcopy(scalars),
        lr_scheduler=copy.deepcopy(sched.state_dict()) if sched is not None and hasattr(sched, "state_dict") else None,
        param_groups=[
            copy.deepcopy({k: v for k, v in g.items() if k != "params"})
            for g in engine.optimizer.optimizer.param_groups
        ],
        rng={"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        loss_scaler=None if scaler is None else copy.deepcopy(dict(vars(scaler))),
    )


def replicas_enabled(engine) -> bool:
    """Replicas are kept: on in the config, a launched job, two ranks or more."""
    dt = engine._dt
    return dt.config.recovery.peer_replicas > 0 and dt.membership is not None and engine.dp_world_size > 1


def refresh_boundary(engine) -> bool:
    return replicas_enabled(engine) and engine.global_steps % engine._dt.config.recovery.interval_steps == 0


def before_vote(engine) -> None:
    """At a refresh boundary: wait for this rank's previous refresh (the stall is counted).

    Raises:
        RuntimeError: it failed (a peer died): the caller's recovery takes over.
    """
    dt = engine._dt
    # an older generation's set (kept through a resize) is closed by after_vote: its refresh is
    # none of this generation's business
    if dt.replicas is not None and dt.replicas.generation == dt.generation and refresh_boundary(engine):
        try:
            dt.replica_stall_s += dt.replicas.wait()
        except TransitionAbortedError as err:  # a peer died: the recovery takes it as a failed collective
            raise RuntimeError(str(err)) from err


def after_vote(engine) -> None:
    """At a refresh boundary: copy this rank's state of the step and start sending it."""
    if not refresh_boundary(engine):
        return
    dt = engine._dt
    rs = dt.replicas
    state = extract_partitions(engine)
    if rs is None or rs.generation != dt.generation:
        close_replicas(dt)
        rs = dt.replicas = _new_set(dt, engine, state)
    rs.capture(engine.global_steps, state.tensors, step_meta(engine, state.scalars))
    rs.start(engine.global_steps)


def _new_set(dt: ElasticState, engine, state) -> ReplicaSet:
    # a recovery plans at once: the assignment solver's import must not be on its path
    import_solver_in_background()
    store = dt.membership.store
    nodes = {}
    for m in dt.members:
        key = MEMBER_NODE_KEY.format(m)
        if store.check([key]):
            nodes[m] = int(store.get(key))
    ring = replica_ring(dt.members, nodes)
    timeout = dt.config.recovery.timeout_s
    prefix = group_prefix(dt.generation, ring, engine.global_steps, kind="replica")
    connect, me = dt.membership.new_client, dt.member
    rs = ReplicaSet(
        me,
        ring,
        [g["fp32"].numel() for g in state.tensors],
        state_kinds(state),
        state.tensors[0]["fp32"].dtype,
        lambda: transition_group(connect(), prefix, ring, me, timeout),
        timeout,
    )
    rs.generation = dt.generation
    return rs


def close_replicas(dt: ElasticState) -> None:
    """Let a running refresh end and shut the replica group down (a resize: the next generation
    makes its own)."""
    if dt.replicas is not None:
        dt.replicas.close()
        dt.replicas = None


def install_copy(engine, parts: Dict[int, Dict[str, torch.Tensor]], meta: StepMeta) -> None:
    """Put a recovered state into a freshly rebuilt engine: the fp32 master and the moments of its
    new partitions (``parts[partition][kind]``), ``meta``'s counters, scheduler, hyper-parameters,
    RNG and loss scaler; then the working parameters from the master
    (:func:`~ds_dynatrain.zero.state.working_from_master`; at ZeRO-1/2 a collective over the new
    world)."""
    order = sorted(parts)
    install_master(engine, [parts[g]["fp32"] for g in order])
    install_optimizer_state(engine, [parts[g] for g in order], meta.scalars)
    c = meta.counters
    engine.global_steps, engine.global_samples, engine.skipped_steps = (
        c["global_steps"],
        c["global_samples"],
        c["skipped_steps"],
    )
    engine.micro_steps = c["global_steps"] * engine.gradient_accumulation_steps()
    if engine.lr_scheduler is not None and meta.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(meta.lr_scheduler)
    for g, h in zip(engine.optimizer.optimizer.param_groups, meta.param_groups):
        g.update(copy.deepcopy(h))
    torch.set_rng_state(meta.rng["torch"])
    random.setstate(meta.rng["python"])
    np.random.set_state(meta.rng["numpy"])
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and meta.loss_scaler is not None:
        scaler.__dict__.update(copy.deepcopy(meta.loss_scaler))
    working_from_master(engine)
