"""The transition header: old rank 0's account of a transition and of the non-tensor training state,
broadcast to every process of the new world and checked by all before any byte moves.

Every process checks the header against its own view (plan digest; a joiner also its model's
layout); a problem on one is the same error on all (:func:`agree_on_header`). The header then
carries what a rebuilt engine does not have: step counters, LR scheduler, the optimizer's group
hyper-parameters, the loss scaler, the RNG state, who stands by (:func:`install_header_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as tdist

from ..elastic.collective import raise_on_every_rank
from ..elastic.membership import GenerationRecord
from ..errors import DynatrainError, LayoutMismatchError, TransitionAbortedError
from ..planner.plan import Plan, plan_transition
from ..transition.execute import transition_ranks
from ..vps.layout import ZeroLayout
from ..zero.state import MASTER, PartitionState, install_master, master_from_working, state_kinds

HISTORY_KEPT = 8  # recent memberships carried by the header (group reuse)


@dataclass
class TransitionHeader:
    """What old rank 0 broadcasts into the new world (sent as :meth:`to_dict`).

    Attributes:
        digest: the plan's digest.  old_layout: the old :class:`ZeroLayout` as a dict.
        old_members, new_members: member ids in rank order.  kinds: the state kinds of every
        partition.  master_moves: the fp32 master moves by the plan (bf16/fp16 training).
        max_inflight_bytes: the transfer's memory bound.  dtype: the state's dtype name.
        scalars: per old partition, the non-partition optimizer states (Adam's ``step``).
        counters: ``global_steps``, ``global_samples``, ``skipped_steps``, ``requests_seen``.
        lr_scheduler: its state dict (None: no scheduler).  param_groups: per optimizer group,
        its hyper-parameters.  rng: ``torch``, ``python`` and ``numpy`` RNG states.
        loss_scaler: ``{"class", "state"}`` of the ZeRO optimizer's loss scaler (None: none).
        standby: who stands by after this transition.  history: recent memberships.
        tensor_parallel_to: an AutoTP job's new TP degree (its ``old_layout`` is then
        ``{"tensor_parallel", "data_parallel"}``, the old degrees; None: a ZeRO layout).
        pipeline_parallel_to: a pipeline job's new PP degree (its ``old_layout`` is then
        ``{"pipeline_parallel", "data_parallel"}``, the old degrees; None: no pipeline).
    """

    digest: str
    old_layout: dict
    old_members: List[str]
    new_members: List[str]
    kinds: List[str]
    master_moves: bool
    max_inflight_bytes: int
    dtype: str
    scalars: List[Dict[str, Any]]
    counters: Dict[str, int]
    lr_scheduler: Optional[dict] = None
    param_groups: List[dict] = field(default_factory=list)
    rng: Dict[str, Any] = field(default_factory=dict)
    loss_scaler: Optional[dict] = None
    standby: List[str] = field(default_factory=list)
    history: List[List[str]] = field(default_factory=list)
    tensor_parallel_to: Optional[int] = None
    pipeline_parallel_to: Optional[int] = None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @staticmethod
    def from_dict(d: dict) -> "TransitionHeader":
        """Raises: TransitionAbortedError: a field is missing (the sender runs another version)."""
        names = {f.name for f in dataclasses.fields(TransitionHeader)}
        try:
            return TransitionHeader(**{k: v for k, v in d.items() if k in names})
        except TypeError as err:
            raise TransitionAbortedError(f"transition header incomplete: {err}") from None


def make_header(engine, plan, state: PartitionState, must_leave: Tuple[str, ...] = ()) -> TransitionHeader:
    """Old rank 0's header for ``plan`` (a :class:`Plan`, or an AutoTP or pipeline job's
    :class:`~ds_dynatrain.planner.box_plan.BoxPlan`) from its live ``engine`` and partitions ``state``.

    ``loss_scaler``: the attributes of the ZeRO optimizer's loss scaler (DeepSpeed's
    ``DynamicLossScaler`` in fp16: ``cur_scale``, ``cur_iter``, ``last_overflow_iter``,
    ``cur_hysteresis``, ...; a static ``LossScaler`` of 1 in bf16/fp32). Every rebuilt engine
    starts with a fresh scaler, so every process of the new world installs rank 0's.
    """
    dt = engine._dt
    sched = engine.lr_scheduler
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    leaving = [m for m in plan.old_members if m not in plan.new_members and m not in must_leave]
    tp_new, pp_new = getattr(plan.new_layout, "tp", None), getattr(plan.new_layout, "pp", None)
    old = plan.old_layout
    if tp_new is not None:
        old_layout = {"tensor_parallel": old.tp, "data_parallel": old.dp}
    elif pp_new is not None:
        old_layout = {"pipeline_parallel": old.pp, "data_parallel": old.dp}
    else:
        old_layout = old.to_dict()
    return TransitionHeader(
        digest=plan.digest(),
        old_layout=old_layout,
        tensor_parallel_to=tp_new,
        pipeline_parallel_to=pp_new,
        old_members=list(plan.old_members),
        new_members=list(plan.new_members),
        kinds=list(state_kinds(state)),
        master_moves=not master_from_working(engine),
        max_inflight_bytes=dt.config.max_inflight_bytes,
        dtype=str(state.tensors[0][MASTER].dtype).replace("torch.", ""),
        scalars=state.scalars,
        counters={
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "requests_seen": dt.requests_seen,
        },
        lr_scheduler=sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.optimizer.param_groups],
        rng={"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        loss_scaler=None if scaler is None else {"class": type(scaler).__name__, "state": dict(vars(scaler))},
        standby=[m for m in dt.standby if m not in plan.new_members] + (leaving if dt.config.standby else []),
        history=[list(m) for m in (dt.history + [tuple(plan.new_members)])[-HISTORY_KEPT:]],
    )


def agree_on_header(header: Optional[TransitionHeader], check, src: int = 0) -> TransitionHeader:
    """Broadcast rank ``src``'s header; every rank checks it; any problem is the same error
    everywhere.

    ``check(header)`` returns None or a problem string. Raises :class:`LayoutMismatchError` on
    the rank whose check failed with a layout problem, :class:`TransitionAbortedError` elsewhere;
    both name the rank and the problem. Nothing has moved when this raises.
    """
    box = [header.to_dict() if header is not None else None]
    tdist.broadcast_object_list(box, src=src)
    header = TransitionHeader.from_dict(box[0])
    own = None
    try:
        problem = check(header)
    except LayoutMismatchError as err:
        problem, own = f"layout mismatch: {err}", LayoutMismatchError
    raise_on_every_rank(problem, TransitionAbortedError, "transition refused before any byte moved", own_error=own)
    return header


@contextlib.contextmanager
def header_failures(generation: int):
    """Around a joiner's wait for the header of ``generation``: a failure of the process group
    (a ``RuntimeError`` of torch or gloo) becomes :class:`TransitionAbortedError` naming the
    generation; our own errors (which subclass ``RuntimeError`` too) pass through unchanged."""
    try:
        yield
    except DynatrainError:
        raise
    except RuntimeError as err:
        raise TransitionAbortedError(f"generation {generation}: the header did not arrive: {err}") from err


def join_header(rec: GenerationRecord, own: ZeroLayout) -> Tuple[TransitionHeader, Plan]:
    """A joiner's side of :func:`agree_on_header` for generation ``rec``: receive the header from
    ``rec.header_rank``, check the layout against ``own`` and the plan's digest. Returns
    ``(header, plan)``.

    Raises:
        LayoutMismatchError, TransitionAbortedError: as :func:`agree_on_header`.
    """
    box = {}

    def check(header: TransitionHeader):
        old = ZeroLayout.from_dict(header.old_layout)
        old.check_same_model(own.with_world_size(old.world_size))
        plan = plan_transition(old, old.with_world_size(rec.world_size), header.old_members, header.new_members)
        box["plan"] = plan
        if plan.digest() != header.digest:
            return "plan digest differs"
        if transition_ranks(plan) != rec.transition_members:
            return f"transition members {list(transition_ranks(plan))} differ from the published generation's"
        return None

    with header_failures(rec.generation):
        header = agree_on_header(None, check, src=rec.header_rank)
    return header, box["plan"]


def install_header_state(engine, header: TransitionHeader, dests, joiner: bool) -> None:
    """Put the received master partitions (when they were moved) and rank 0's non-tensor state
    into a freshly built engine. The optimizer moments follow when the background transfer ends.

    Raises:
        DynatrainError: the rebuilt engine's loss scaler is of another kind than rank 0's.
    """
    if dests is not None and all(MASTER in dests[g] for g in dests):
        install_master(engine, [dests[g][MASTER] for g in sorted(dests)])
    sent = header.loss_scaler
    if sent is not None:  # survivors and joiners alike: the rebuild made a fresh scaler
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        if type(scaler).__name__ != sent["class"]:
            raise DynatrainError(
                f"rank 0's loss scaler is a {sent['class']}, this rebuilt engine's a "
                f"{type(scaler).__name__}: the processes run different configs"
            )
        scaler.__dict__.update(sent["state"])
    dt, c = engine._dt, header.counters
    engine.global_steps = c["global_steps"]
    engine.global_samples = c["global_samples"]
    engine.skipped_steps = c["skipped_steps"]
    dt.requests_seen = c.get("requests_seen", dt.requests_seen)
    dt.standby = tuple(header.standby)
    dt.history = [tuple(m) for m in header.history]
    engine.micro_steps = c["global_steps"] * engine.gradient_accumulation_steps()
    if joiner:
        if engine.lr_scheduler is not None and header.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(header.lr_scheduler)
        for g, h in zip(engine.optimizer.optimizer.param_groups, header.param_groups):
            g.update(h)
        torch.set_rng_state(header.rng["torch"])
        random.setstate(header.rng["python"])
        np.random.set_state(header.rng["numpy"])
