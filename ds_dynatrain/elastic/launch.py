"""``dynatrain launch`` and ``dynatrain join`` on one host: check the config, this host's place in
the job (flags, else SLURM's or Kubernetes' variables: :mod:`~ds_dynatrain.elastic.cluster_env`)
and the store address, then run this host's :class:`~ds_dynatrain.elastic.agent.Agent`."""

from __future__ import annotations

import socket
from typing import Optional, Sequence

from ..batch import largest_world_size
from ..config import (
    check_elastic_config,
    check_snapshot_storage,
    check_tensor_parallel,
    load_ds_config,
    resolve_global_batch,
)
from ..errors import ConfigError, DynatrainError
from ..log import logger, plural
from .agent import Agent
from .cluster_env import node_place, parse_store
from .requests import probe_store


def launch(
    script: str,
    script_args: Sequence[str],
    nproc: int,
    config: str,
    store: Optional[str] = None,
    nnodes: Optional[int] = None,
    node_rank: Optional[int] = None,
    join: bool = False,
    slots: Optional[int] = None,
    allow_oversubscribe: bool = False,
    max_refills: int = 0,
    pass_config: bool = True,
) -> int:
    """Validate ``config``, then run this node's share of the job under an :class:`Agent`.
    Returns the exit status.

    Args:
        nproc: workers this node starts.  nnodes, node_rank: the hosts at launch and this one's
            index (node 0 hosts the store); None: from the scheduler's variables, else 1 and 0.
        join: this host joins a running job (``dynatrain join``).
        slots: the workers this host can hold (default ``nproc``); joiners of a grow go to free
            slots.  allow_oversubscribe: joiners may start on this host past its slots.
        max_refills: after a failure shrank the job, grow it back to its slots at most this often.
        pass_config: add ``--deepspeed_config CONFIG`` to the script's arguments (False: they name it).

    Raises:
        ConfigError: a bad config, store address, node place or slot count; a world size the batch
            cannot serve; a ``resize_schedule`` past the slots; a ``snapshot.dir`` that is not a
            writable directory and cannot be created.
    """
    ds_config, dt_cfg = load_ds_config(config)  # refuse a bad config before any process starts
    storage = check_snapshot_storage(dt_cfg)  # and a snapshot directory that cannot be written
    if storage is not None:
        logger.info(storage.describe())
    slots = nproc if slots is None else slots
    if slots < nproc:
        raise ConfigError(f"--slots {slots} is less than --nproc {nproc}: a host starts at most its slots")
    if join:
        host, port, nnodes, node_rank, (global_batch, micro) = _join_place(store, ds_config)
    else:
        host, port, nnodes, node_rank = _launch_place(nnodes, node_rank, store)
        if any(e.pipeline_parallel is not None for e in dt_cfg.resize_schedule):
            # a PipelineModule job's schedule: its DP sizes depend on the PP degrees its script and
            # entries pick, which its start checks against its layout (a schedule naming PP degrees
            # for any other model is refused there); here the batch keys only
            global_batch, micro = check_elastic_config(ds_config, dt_cfg, 1, elastic=True)
        else:
            tp = check_tensor_parallel(ds_config, dt_cfg, nproc * nnodes, launched=True)  # an AutoTP job: DP ranks
            global_batch, micro = check_elastic_config(ds_config, dt_cfg, nproc * nnodes // tp, elastic=True)
        _check_schedule_slots(dt_cfg, nnodes, slots, allow_oversubscribe)
    restore = dt_cfg.snapshot.dir if dt_cfg.snapshot.interval_steps and dt_cfg.snapshot.restore_on_failure else None

    def largest(alive: int) -> int:
        return largest_world_size(global_batch, micro, alive, dt_cfg.max_world_size)

    try:
        agent = Agent(
            script,
            script_args,
            nproc,
            config if pass_config else None,
            host,
            port,
            restore_dir=restore,
            largest=largest,
            nnodes=nnodes,
            node_rank=node_rank,
            join=join,
            slots=slots,
            oversubscribe=allow_oversubscribe,
            max_refills=max_refills,
            joiner_nice=dt_cfg.joiner_nice,
            recovery_timeout_s=dt_cfg.recovery.timeout_s if dt_cfg.recovery.peer_replicas else None,
        )
    except RuntimeError as err:
        raise ConfigError(f"no dynatrain job store at {host}:{port}: {err}") from None
    what = "joining the job with" if join else f"node {agent.node} of {nnodes}, starting"
    workers = f"{plural(nproc, 'worker')} ({plural(slots, 'slot')})"
    logger.info(f"agent: store at {host}:{agent.store_port}, {what} {workers}")
    return agent.run()


def _join_place(store: Optional[str], ds_config: dict):
    """``(host, port, nnodes, node_rank, (global batch, micro-batch))`` of ``dynatrain join``: the
    running job's store, which must answer. Raises ConfigError."""
    host, port = parse_store(store)
    if not host or not port:
        raise ConfigError("dynatrain join needs --store HOST:PORT of the running job")
    try:
        probe_store(host, port)  # a job runs there already: fail at once when nothing listens
    except DynatrainError as err:
        raise ConfigError(str(err)) from None
    return host, port, 1, 0, resolve_global_batch(ds_config, 1)


def _launch_place(nnodes: Optional[int], node_rank: Optional[int], store: Optional[str]):
    """``(store host, store port, nnodes, node_rank)`` of ``dynatrain launch``, from the flags or the
    scheduler's variables; node 0 must be able to host the store. Raises ConfigError."""
    place = node_place(nnodes, node_rank, store)
    nnodes, node_rank, host, port = place.nnodes, place.node_rank, place.store_host or "127.0.0.1", place.store_port
    if place.source != "flags":
        logger.info(f"agent: node {node_rank} of {nnodes}, store at {host}:{port} (from {place.source})")
    if (nnodes > 1 or node_rank) and not port:
        raise ConfigError("a job on several hosts needs --store HOST:PORT with a fixed port")
    if node_rank == 0:
        _check_store_host(host, port)
    return host, port, nnodes, node_rank


def _check_store_host(host: str, port: int) -> None:
    """Node 0 hosts the store: ``host`` must be an address of this host."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
    except OSError as err:
        raise ConfigError(
            f"--store {host}:{port}: node 0 hosts the store, but {host} is not an address of this host ({err})"
        ) from None


def _check_schedule_slots(dt_cfg, nnodes: int, slots: int, oversubscribe: bool) -> None:
    """A ``resize_schedule`` grow past ``nnodes * slots`` (hosts alike) is refused at launch."""
    if oversubscribe or not dt_cfg.resize_schedule:
        return
    top = max(dt_cfg.resize_schedule, key=lambda e: e.world_size)
    if top.world_size > nnodes * slots:
        raise ConfigError(
            f"dynatrain.resize_schedule grows to {top.world_size} ranks at step {top.step}, but the job has "
            f"{plural(nnodes * slots, 'slot')} ({plural(nnodes, 'host')} x {slots}); "
            "give --slots, more hosts, or --allow-oversubscribe"
        )
