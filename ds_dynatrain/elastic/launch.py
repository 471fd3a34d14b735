"""``dynatrain launch`` and ``dynatrain join`` on one host: check the config and the store address,
then run this host's :class:`~ds_dynatrain.elastic.agent.Agent`."""

from __future__ import annotations

import socket
from typing import Optional, Sequence, Tuple

from ..batch import largest_world_size
from ..config import check_elastic_config, check_snapshot_storage, load_ds_config, resolve_global_batch
from ..errors import ConfigError, DynatrainError
from ..log import logger, plural
from .agent import Agent
from .requests import probe_store


def _parse_store(store: Optional[str]) -> Tuple[str, int]:
    if not store:
        return "127.0.0.1", 0
    host, _, p = store.rpartition(":")
    if not host or not p.isdigit() or not 0 <= int(p) < 65536:
        raise ConfigError(f"--store {store!r}: expected HOST:PORT with a port in 0-65535")
    return host, int(p)


def launch(
    script: str,
    script_args: Sequence[str],
    nproc: int,
    config: str,
    store: Optional[str] = None,
    nnodes: int = 1,
    node_rank: int = 0,
    join: bool = False,
) -> int:
    """Validate ``config``, then run this node's share of the job under an :class:`Agent`.
    Returns the exit status.

    Args:
        nproc: workers (slots) of this node.  nnodes, node_rank: the hosts at launch and this one's
            index (node 0 hosts the store).  join: this host joins a running job (``dynatrain join``).

    Raises:
        ConfigError: a bad config, store address or node rank; a world size the batch cannot serve;
            a ``snapshot.dir`` that is not a writable directory and cannot be created.
    """
    ds_config, dt_cfg = load_ds_config(config)  # refuse a bad config before any process starts
    storage = check_snapshot_storage(dt_cfg)  # and a snapshot directory that cannot be written
    if storage is not None:
        logger.info(storage.describe())
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} with --nnodes {nnodes}: expected 0 <= node rank < nnodes")
    host, port = _parse_store(store)
    if (nnodes > 1 or node_rank or join) and not port:
        raise ConfigError("a job on several hosts needs --store HOST:PORT with a fixed port")
    if join:
        try:
            probe_store(host, port)  # a job runs there already: fail at once when nothing listens
        except DynatrainError as err:
            raise ConfigError(str(err)) from None
    elif node_rank == 0:
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, 0))
        except OSError as err:
            raise ConfigError(
                f"--store {host}:{port}: node 0 hosts the store, but {host} is not an address of this host ({err})"
            ) from None
    if join:
        global_batch, micro = resolve_global_batch(ds_config, 1)
    else:
        global_batch, micro = check_elastic_config(ds_config, dt_cfg, nproc * nnodes, elastic=True)
    restore = dt_cfg.snapshot.dir if dt_cfg.snapshot.interval_steps and dt_cfg.snapshot.restore_on_failure else None

    def largest(alive: int) -> int:
        return largest_world_size(global_batch, micro, alive, dt_cfg.max_world_size)

    try:
        agent = Agent(
            script,
            script_args,
            nproc,
            config,
            host,
            port,
            restore_dir=restore,
            largest=largest,
            nnodes=nnodes,
            node_rank=node_rank,
            join=join,
        )
    except RuntimeError as err:
        raise ConfigError(f"no dynatrain job store at {host}:{port}: {err}") from None
    what = "joining the job with" if join else f"node {agent.node} of {nnodes}, starting"
    logger.info(f"agent: store at {host}:{agent.store_port}, {what} {plural(nproc, 'worker')}")
    return agent.run()
