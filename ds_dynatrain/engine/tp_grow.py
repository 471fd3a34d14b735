"""A grow of an AutoTP job under ``dynatrain launch``: new processes join, and the TP and DP degrees
of the larger world are chosen anew; the survivors' side (:func:`grow_tensor_parallel`) and the
joiners' (:func:`join_tensor_parallel`).

1. **plan** (survivors): the new :class:`~ds_dynatrain.vps.tensor_parallel.TensorParallelLayout`,
   the ranks the survivors take (the assignment that keeps the most state in place, over the
   boxes' overlaps) and the joiners the others; rank 0 publishes the generation, the launcher's
   agents start the joiners;
2. **form**: survivors and joiners form the new generation's group (the survivors wait there for
   the joiners' start-up); old rank 0 broadcasts the header (the plan's digest, the old and new
   TP degrees, the optimizer's scalars and the non-tensor training state); a joiner computes both
   layouts from its own uncut model and checks the plan's digest;
3. **transfer**: the fp32 master and Adam moments move by the plan over the new group
   (:func:`~ds_dynatrain.transition.boxes.execute_box_plan`), survivors sending, joiners receiving;
4. **rebuild**: a survivor rebuilds its engine at the new degree
   (:func:`~ds_dynatrain.engine.tp_switch.rebuild_at`); a joiner builds its engine on its own model,
   which DeepSpeed's AutoTP cuts at the new degree, as at a job's start; both install the moved
   state.

A ``dynatrain resize`` grow is prepared behind training
(:func:`~ds_dynatrain.engine.requests.prepare_tensor_parallel_grow`: joiners started, the new group
built); by ``engine.resize`` or the schedule the survivors wait at the rendezvous for the joiners'
start-up.
"""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

from ..batch import BatchSplit
from ..elastic.membership import GenerationRecord
from ..errors import ResizeRefusedError
from ..planner.box_plan import BoxPlan
from ..planner.tp_plan import plan_tp_transition
from ..vps.tensor_parallel import TensorParallelLayout
from ..zero.tp_module import reset_tp_groups
from .band_grow import grow_in_place, grow_members, joiner_receives, publish_join
from .box_state import (
    install_moved_state,
)
from .construct import construct, ds_config_for, keep_returned_optimizer
from .header import agree_on_header, header_failures, install_header_state
from .join import enter_generation, wait_for_switch
from .members import evict_groups, request_joiners
from .records import JoinRecord, ResizeRecord
from .state import Preparation
from .tp_switch import check_layout, new_layout, rebuild_at, tp_layout_for_model, tp_record


def assign_grow(engine, world_size: int, tp: int) -> Tuple[BatchSplit, TensorParallelLayout, Tuple[str, ...]]:
    """Decide a grow of ``engine``'s AutoTP job to ``world_size`` processes at TP degree ``tp``: the
    batch split over the new DP size, the new layout and its processes (:func:`grow_members`,
    recorded as the next generation's members for
    :func:`~ds_dynatrain.engine.members.request_joiners`).

    Raises:
        ResizeRefusedError: ``tp`` does not divide ``world_size``, the DP size cannot keep the
            global batch, or AutoTP cannot cut the model at ``tp``; nothing has changed.
    """
    dt = engine._dt
    if tp < 1 or world_size % tp:
        raise ResizeRefusedError(f"TP degree {tp} refused: it does not divide the world size {world_size}")
    split = dt.split(world_size // tp, "DP size")
    new = new_layout(engine, tp, world_size)
    g = dt.generation + 1
    members = grow_members(dt.tp_layout, new, dt.members, g)
    dt.assigned[(g, world_size, ())] = members
    return split, new, members


def grow_tensor_parallel(engine, world_size: int, tp: int, prepared: Optional[Preparation] = None) -> ResizeRecord:
    """Grow ``engine``'s AutoTP job to ``world_size`` processes at TP degree ``tp`` now.

    Collective over the current generation; the joiners it asks the launcher for take part from
    the rendezvous on (:func:`join_tensor_parallel`). ``prepared``: a request whose generation was
    published and whose joiners and group were started behind training
    (:func:`~ds_dynatrain.engine.requests.prepare`). Returns the resize record.

    Raises:
        ResizeRefusedError: ``tp`` does not divide ``world_size``, the DP size cannot keep the
            global batch, or AutoTP cannot cut the model at ``tp``; nothing has changed.
        TransitionAbortedError: the joiners did not come within ``collective_timeout_s``, the
            processes planned differently, or a peer failed during the transfer.
    """
    dt = engine._dt
    t0 = time.perf_counter()
    members, old, g = tuple(dt.members), dt.tp_layout, dt.generation + 1
    split, new, new_members = assign_grow(engine, world_size, tp)
    request_joiners(engine, world_size)  # publishes generation g; the agents start its joiners
    plan = plan_tp_transition(old, new, members, new_members)
    rec = tp_record(engine, len(members), world_size, g, old.tp, tp, t0)

    def rebuild():
        rebuild_at(engine, tp, split, same_world=False)
        dt.tp_layout = new

    return grow_in_place(engine, plan, g, rec, t0, rebuild, prepared)


def join_tensor_parallel(
    engine, rec: GenerationRecord, model, optimizer, model_parameters, lr_scheduler, groups: List[list]
) -> JoinRecord:
    """Join an AutoTP job's generation ``rec`` (its membership names this process): form its
    group, receive and check the header, receive this process's fp32 master and moments, build
    the engine on ``model`` (uncut: DeepSpeed's AutoTP cuts it at the new degree) and install the
    state. Returns the join record.

    Args:
        model, optimizer, model_parameters, lr_scheduler: what ``deepspeed.initialize`` took.
        groups: the parameter groups the optimizer will hold, as lists of parameters.

    Raises:
        TransitionAbortedError: the generation was given up, a rendezvous or the header failed,
            or the plan this process computed differs from the survivors' (another model).
        LayoutMismatchError: this process's model is not the one the survivors train.
    """
    dt = engine._dt
    t0 = time.perf_counter()
    timeout = dt.group_timeout_s
    reused = enter_generation(dt, rec, timeout)
    wait_for_switch(dt, rec, timeout)
    box: dict = {}

    def check(h) -> Optional[str]:
        was = h.old_layout
        tp_old, tp_new = int(was["tensor_parallel"]), int(h.tensor_parallel_to)
        old = tp_layout_for_model(model, groups, tp_old, tp_old * int(was["data_parallel"]), dt)
        new = tp_layout_for_model(model, groups, tp_new, rec.world_size, dt)
        box["plan"] = plan = plan_tp_transition(old, new, h.old_members, h.new_members)
        return "plan digest differs" if plan.digest() != h.digest else None

    with header_failures(rec.generation):
        header = agree_on_header(None, check, src=rec.header_rank)
    plan: BoxPlan = box["plan"]
    new = plan.new_layout
    dests, scalars, stats = joiner_receives(dt, plan, header)
    dt.members, dt.generation, dt.retired = plan.new_members, rec.generation, False
    dt.ds_config.setdefault("tensor_parallel", {})["autotp_size"] = new.tp
    dt.tp_layout = new
    reset_tp_groups(new.tp)  # as a survivor's rebuild makes them, in the same order
    dt.rebuild_broadcast = "none"  # the working parameters are made from the installed master
    config = ds_config_for(dt, dt.split(new.dp, "DP size"), client_objects=False)
    construct(engine, dt, model, optimizer, model_parameters, lr_scheduler, config, light=True, values_follow=True)
    keep_returned_optimizer(engine)
    check_layout(engine)
    install_moved_state(engine, dests, scalars)
    install_header_state(engine, header, None, joiner=True)
    evict_groups(dt)
    return publish_join(engine, rec.generation, reused, t0, stats)
