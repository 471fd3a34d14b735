"""Requests from outside a running job (``dynatrain resize``): reach its store, check the size,
queue the request and wait for the job's answer."""

from __future__ import annotations

import json
import socket
import time
from datetime import timedelta

from ..batch import split_global_batch
from ..errors import ResizeRefusedError, TransitionAbortedError
from ..log import native_stderr_hidden
from .keys import ANSWER_KEY, JOB_KEY, REQUEST_COUNT, REQUEST_KEY
from .membership import connect_store
from .placement import check_slots

CONNECT_TIMEOUT_S = 10.0  # how long a requester tries to reach a job's store


def request_resize(
    host: str, port: int, world_size: int, timeout_s: float, tensor_parallel=None, pipeline_parallel=None
) -> dict:
    """Ask the job whose store listens at ``host:port`` to change its world size to ``world_size``
    (``dynatrain resize``); an AutoTP job also its TP degree (``tensor_parallel``; ``world_size``
    is then its number of processes, TP x DP), a pipeline job its PP degree (``pipeline_parallel``;
    PP x DP processes). Requests are queued in the store and served one per
    step boundary, in order. The size is checked against the job's global batch (split over
    ``world_size / tensor_parallel`` DP ranks), ``max_world_size`` and its hosts' slots
    (:func:`~ds_dynatrain.elastic.placement.check_slots`) first.

    Returns:
        The job's answer: ``{"ok": True, "message": ..., "record": <resize record>}``.

    Raises:
        ResizeRefusedError: the size cannot serve the job or needs more slots than its hosts have
            (nothing was queued), or the job refused it.
        TransitionAbortedError: no job at the store, or no answer within ``timeout_s``.
    """
    probe_store(host, port)
    try:
        # a job's store answers at once or not at all: do not wait the whole answer timeout for it
        with native_stderr_hidden():  # the error below says it in one line
            store = connect_store(host, port, min(timeout_s, CONNECT_TIMEOUT_S))
            store.wait([JOB_KEY], timedelta(seconds=min(timeout_s, CONNECT_TIMEOUT_S)))
        job = json.loads(store.get(JOB_KEY))
    except RuntimeError as err:
        raise TransitionAbortedError(f"no dynatrain job answers at {host}:{port}: {err}") from None
    dp = world_size
    if tensor_parallel is not None and pipeline_parallel is not None:
        raise ResizeRefusedError("a TP and a PP degree: a request changes one of the two")
    for what, degree in (("TP", tensor_parallel), ("PP", pipeline_parallel)):
        if degree is None:
            continue
        if degree < 1:
            raise ResizeRefusedError(f"{what} degree {degree}: it must be >= 1")
        if world_size % degree:
            raise ResizeRefusedError(f"{what} degree {degree} does not divide the world size {world_size}")
        dp = world_size // degree
    if not (job.get("pipeline") and pipeline_parallel is None):  # a pipeline job picks the degree itself
        what = "world size" if dp == world_size else "DP size"
        split_global_batch(int(job["global_batch"]), int(job["micro_batch"]), dp, job["max_world_size"], what)
    check_slots(store, world_size)
    i = int(store.add(REQUEST_COUNT, 1)) - 1
    body = {"world_size": world_size}
    if tensor_parallel is not None:
        body["tensor_parallel"] = tensor_parallel
    if pipeline_parallel is not None:
        body["pipeline_parallel"] = pipeline_parallel
    store.set(REQUEST_KEY.format(i), json.dumps(body))
    t0 = time.monotonic()
    try:
        with native_stderr_hidden():  # a store that goes away: the error below says it in one line
            store.wait([ANSWER_KEY.format(i)], timedelta(seconds=timeout_s))
            answer = json.loads(store.get(ANSWER_KEY.format(i)))
    except RuntimeError:
        waited = time.monotonic() - t0
        if waited < 0.9 * timeout_s:  # the wait ended early: the store is gone with its job
            raise TransitionAbortedError(
                f"the job's store at {host}:{port} went away after {waited:.0f} s, before "
                f"request {i} (world size {world_size}) was answered: the job ended or "
                "failed"
            ) from None
        raise TransitionAbortedError(
            f"request {i} (world size {world_size}) got no answer within {timeout_s:g} s; it stays queued"
        ) from None
    if not answer["ok"]:
        if answer.get("aborted"):
            raise TransitionAbortedError(answer["message"])
        raise ResizeRefusedError(answer["message"])
    return answer


def probe_store(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast when nothing listens at ``host:port`` (a refused or unreachable address), instead
    of the store client's retries.

    Raises:
        TransitionAbortedError: naming the address and the reason.
    """
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise TransitionAbortedError(f"no dynatrain job answers at {host}:{port}: {err}") from None
