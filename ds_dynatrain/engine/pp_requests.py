"""Resize requests to a pipeline job under ``dynatrain launch``: read by rank 0 at a step boundary,
served on every process (a PP switch at the job's world size, prepared ``dynatrain.
warm_switch_steps`` steps ahead; a shrink; a grow prepared behind training and finished once its
group is built) or refused with the reason, and answered."""

from __future__ import annotations

from typing import Optional, Tuple

from ..elastic.placement import place_joiners
from ..errors import ResizeRefusedError
from ..log import logger, plural
from .members import reports
from .pp_grow import assign_pp_grow, grow_pipeline_parallel
from .pp_resize import pp_for_world, shrink_pipeline_parallel
from .pp_switch import switch_pipeline_parallel
from .requests import defer_band_switch, prepare
from .state import Preparation


def read_request(engine) -> Tuple[int, int, int]:
    """Rank 0: ``(index, world size, PP degree)`` of the next request this job serves at this step
    (a PP change at its world size, fewer processes or more, a ``dynatrain join`` of a host's slots:
    a grow by them, its joiners on that host; PP 0: the job's choice), else ``(-1, 0, 0)``; any
    other request (a TP degree, a grow the hosts have no free slots for) is answered as refused
    here."""
    dt = engine._dt
    while (request := dt.membership.pending_request(dt.requests_seen)) is not None:
        index, body = request
        dt.requests_seen = index + 1
        if "join" in body:
            dt.join_node = (index, int(body["join"]))  # the joiners start on the joining host
            return index, len(dt.members) + int(body["slots"]), 0
        world, pp = int(body.get("world_size", 0)), body.get("pipeline_parallel")
        why = None
        if world < 1:
            why = f"world size {world} refused: a job needs at least 1 process"
        elif body.get("tensor_parallel") is not None:
            why = (
                f"a PipelineModule job of {plural(len(dt.members), 'process', 'processes')} changes its PP and DP "
                f"degrees (dynatrain resize --world-size W [--pipeline-parallel P]); it has no TP degree"
            )
        elif world > len(dt.members):
            try:
                new = [f"new{i}" for i in range(world - len(dt.members))]
                place_joiners(dt.membership.store, tuple(dt.members), new)
            except ResizeRefusedError as err:
                why = f"resize to {world} processes refused: {err}"
        if why is None:
            return index, world, int(pp or 0)
        dt.membership.answer(index, False, why)
        logger.info(f"resize request {index}: refused: {why}")
    return -1, 0, 0


def serve(engine, index: int, world: int, pp: int) -> None:
    """Every rank: request ``index`` (``world`` processes at PP degree ``pp``; 0: the degree
    :func:`~ds_dynatrain.engine.pp_resize.pp_for_world` picks): a PP switch (with
    ``dynatrain.warm_switch_steps`` above 0, the default, only prepared here: the memory the new
    layout needs is touched while the job trains that many steps, and
    :func:`~ds_dynatrain.engine.requests.finish_band_switch` switches at the step it names), a
    shrink, or a grow
    (with ``background_groups``, the default, only prepared here: the joiners start and the new
    group is built while training goes on, and :func:`finish_grow` switches once every process has
    it; else the survivors wait at the new generation's rendezvous for the joiners' start-up); old
    rank 0 answers it where it stays, else new rank 0 (the record, or why it was refused: nothing
    changed then)."""
    dt = engine._dt
    first = dt.members[0]  # old rank 0 answers where it stays (a grow may give its rank to a joiner)
    try:
        if world == len(dt.members):
            pp = pp or dt.pp_layout.pp
            if pp != dt.pp_layout.pp and defer_band_switch(engine, index, world, pipeline_parallel=pp):
                return
            rec = switch_pipeline_parallel(engine, pp).to_dict() if pp != dt.pp_layout.pp else None
        elif world > len(dt.members):
            pp = pp or pp_for_world(engine, world) or dt.pp_layout.pp  # none: the grow refuses, saying why
            if dt.config.background_groups:  # joiners started and the group built while training goes on
                assign_pp_grow(engine, world, pp)
                prepare(engine, index, world, pipeline_parallel=pp)
                return
            rec = grow_pipeline_parallel(engine, world, pp).to_dict()
        else:
            pp = pp or pp_for_world(engine, world) or dt.pp_layout.pp  # none: the shrink refuses, saying why
            rec = shrink_pipeline_parallel(engine, world, pp)
            rec = rec.to_dict() if rec is not None else None
    except ResizeRefusedError as err:
        if engine.global_rank == 0:
            dt.membership.answer(index, False, str(err))
            logger.info(f"resize request {index}: {err}")
        return
    if reports(dt, first):
        dt.membership.answer(index, True, layout_change(rec) if rec else f"the job already runs at PP {pp}", rec)


def finish_grow(engine, prep: Preparation) -> None:
    """Every process has the prepared generation's group: grow to it now (collective); old rank 0
    answers the request."""
    dt = engine._dt
    dt.preparing = None
    first = dt.members[0]
    rec = grow_pipeline_parallel(engine, prep.world_size, prep.pipeline_parallel, prepared=prep)
    if reports(dt, first):
        msg = f"{layout_change(rec.to_dict())} ({rec.prepare_s:.2f} s prepared in the background)"
        dt.membership.answer(prep.index, True, msg, rec.to_dict())


def switch_message(rec: Optional[dict]) -> str:
    """The answer to a served PP switch: :func:`layout_change` of its record, or that the job
    already ran at that layout (None)."""
    return layout_change(rec) if rec else "the job already runs at that PP degree"


def layout_change(rec: dict) -> str:
    """``PP a x DP b -> PP c x DP d after step S in T s`` of a resize record (a dict)."""
    pp_from, pp_to = rec["pipeline_parallel_from"], rec["pipeline_parallel_to"]
    return (
        f"PP {pp_from} x DP {rec['from'] // pp_from} -> PP {pp_to} x DP {rec['to'] // pp_to} after step "
        f"{rec['step']} in {rec['seconds']:.2f} s"
    )
