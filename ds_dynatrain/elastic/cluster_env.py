"""Where this host's agent stands in a job on a cluster: the one reader of the scheduler's variables.

``dynatrain launch`` needs three things on every host of a job: the number of hosts (``--nnodes``),
this host's index among them (``--node-rank``) and the address of node 0, which hosts the store
(``--store HOST:PORT``). Flags given on the command line always win, each on its own; what they
leave open is read here from the environment the scheduler made:

SLURM, ``srun --ntasks-per-node=1 dynatrain launch --nproc K ...`` (one agent per node):

======================================  ==============================================================
node rank                               ``SLURM_NODEID``, else ``SLURM_PROCID``
node count                              ``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES`` /
                                        ``SLURM_JOB_NUM_NODES`` (which must agree)
store host                              the first host of ``SLURM_STEP_NODELIST``, else of
                                        ``SLURM_JOB_NODELIST`` (a compressed hostlist, ``node[01-03,07]``)
store port                              the port of ``--store`` when given (``--store :PORT`` names
                                        only the port), else ``20000 + SLURM_JOB_ID mod 10000``
======================================  ==============================================================

The variables must be whole and agree: a node rank without a node list, a node list whose length
is not the node count, more tasks than nodes (several agents on one host) are refused with the
reason (:class:`~ds_dynatrain.errors.ConfigError`). A batch script on one node may also run
``dynatrain launch`` itself (its ``--ntasks`` then counts the workers, not agents).

Kubernetes, one agent per pod, the store on pod 0 (``--store POD0:PORT`` and ``--nnodes N`` in the
manifest): the node rank is ``JOB_COMPLETION_INDEX`` (an Indexed Job), else, in a pod
(``KUBERNETES_SERVICE_HOST`` set), the ordinal ``K`` of the pod's host name ``BASE-K`` when the
store's host is ``BASE-0`` or ``BASE-0.SERVICE...`` (pod 0 of the same StatefulSet, or of an
Indexed Job with a headless service as its subdomain).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

import hostlist

from ..errors import ConfigError
from ..log import plural

SLURM_PORT_BASE = 20000  # the store's port under SLURM when --store names none: base + job id mod 10000


@dataclass(frozen=True)
class NodePlace:
    """This host's place in the job.

    Attributes:
        nnodes: hosts at launch.  node_rank: this host's index (0 hosts the store).
        store_host: the store's host (None: not known, the default loopback on one host).
        store_port: its port (0: any free port, one host only).  source: where the place was
        read (``"flags"``, ``"SLURM"``, ``"Kubernetes"``).
    """

    nnodes: int
    node_rank: int
    store_host: Optional[str]
    store_port: int
    source: str


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    if name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"SLURM variable {name}={env[name]!r} is not an integer") from None


def _slurm(env: Mapping[str, str]) -> Optional[dict]:
    """``{"nnodes", "node_rank", "host", "port"}`` read from SLURM's variables; None outside a
    SLURM task (neither ``SLURM_NODEID`` nor ``SLURM_PROCID`` set)."""
    node = _int(env, "SLURM_NODEID")
    proc = _int(env, "SLURM_PROCID")
    if node is None and proc is None:
        return None
    rank = node if node is not None else proc
    nnodes = _int(env, "SLURM_STEP_NUM_NODES")
    if nnodes is None:
        counts = {n: _int(env, n) for n in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES") if n in env}
        if len(set(counts.values())) > 1:
            raise ConfigError(f"SLURM variables disagree on the node count: {counts}")
        nnodes = next(iter(counts.values()), None)
    names = [n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)]
    if nnodes is None or not names:
        missing = " and ".join(n for n, m in (("SLURM_NNODES", nnodes is None), ("SLURM_JOB_NODELIST", not names)) if m)
        raise ConfigError(
            f"partial SLURM variables: a node rank ({'SLURM_NODEID' if node is not None else 'SLURM_PROCID'}="
            f"{rank}) without {missing}; run under srun, or give --nnodes, --node-rank and --store"
        )
    try:
        hosts = hostlist.expand_hostlist(env[names[0]])
    except hostlist.BadHostlist as err:
        raise ConfigError(f"{names[0]}={env[names[0]]!r} is not a SLURM hostlist: {err}") from None
    if len(hosts) != nnodes:
        raise ConfigError(
            f"{names[0]}={env[names[0]]!r} names {plural(len(hosts), 'host')}, but the node count is {nnodes}"
        )
    tasks = _int(env, "SLURM_STEP_NUM_TASKS")  # srun's; a batch script's SLURM_NTASKS may be the workers
    if tasks is not None and tasks > nnodes:
        raise ConfigError(
            f"SLURM started {tasks} tasks on {plural(nnodes, 'node')}; dynatrain launch is one agent per node: "
            "srun --ntasks-per-node=1"
        )
    if not 0 <= rank < nnodes:
        raise ConfigError(f"SLURM node rank {rank} with {plural(nnodes, 'node')}: expected 0 <= node rank < nodes")
    job = _int(env, "SLURM_JOB_ID")
    port = SLURM_PORT_BASE + job % 10000 if job is not None else 0
    return {"nnodes": nnodes, "node_rank": rank, "host": hosts[0], "port": port}


def _kubernetes_rank(env: Mapping[str, str], store_host: Optional[str], hostname: str) -> Optional[int]:
    """The pod's index: ``JOB_COMPLETION_INDEX``, else the ordinal of a StatefulSet's pod whose
    pod 0 hosts the store; None when neither applies."""
    if "JOB_COMPLETION_INDEX" in env:
        try:
            return int(env["JOB_COMPLETION_INDEX"])
        except ValueError:
            raise ConfigError(f"JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']!r} is not an integer") from None
    if "KUBERNETES_SERVICE_HOST" not in env or not store_host:
        return None
    pod = re.fullmatch(r"(.+)-(\d+)", hostname.split(".")[0])
    if pod is None or store_host.split(".")[0] != f"{pod.group(1)}-0":
        return None
    return int(pod.group(2))


def node_place(
    nnodes: Optional[int],
    node_rank: Optional[int],
    store: Optional[str],
    environ: Optional[Mapping[str, str]] = None,
    hostname: Optional[str] = None,
) -> NodePlace:
    """This host's place from the flags (None: not given) and the scheduler's variables.

    Args:
        store: ``--store`` as given: ``HOST:PORT``, ``:PORT`` (the host from the scheduler) or None.
        environ, hostname: the environment and the host name (default: this process's).

    Raises:
        ConfigError: a malformed ``--store``; partial or inconsistent SLURM variables; a node rank
            outside ``0 .. nnodes-1``; several hosts without a store address or port.
    """
    env = os.environ if environ is None else environ
    host, port = parse_store(store)
    source = "flags"
    slurm = None if nnodes is not None and node_rank is not None and host else _slurm(env)
    if slurm is not None:
        source = "SLURM"
        nnodes = slurm["nnodes"] if nnodes is None else nnodes
        node_rank = slurm["node_rank"] if node_rank is None else node_rank
        host = host or slurm["host"]
        port = port or slurm["port"]
    elif node_rank is None:
        k8s = _kubernetes_rank(env, host, hostname or socket.gethostname())
        if k8s is not None:
            node_rank, source = k8s, "Kubernetes"
    nnodes = 1 if nnodes is None else nnodes
    if nnodes < 1:
        raise ConfigError(f"--nnodes {nnodes}: expected at least 1")
    if node_rank is None:
        if nnodes > 1:
            raise ConfigError(f"--nnodes {nnodes} needs --node-rank (or srun's or Kubernetes' variables)")
        node_rank = 0
    if not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"node rank {node_rank} ({source}) with {plural(nnodes, 'node')}: expected 0 <= node rank < nnodes"
        )
    return NodePlace(nnodes, node_rank, host, port, source)


def parse_store(store: Optional[str]):
    """``(host or None, port or 0)`` of ``--store``."""
    if not store:
        return None, 0
    host, _, p = store.rpartition(":")
    if not p.isdigit() or not 0 <= int(p) < 65536:
        raise ConfigError(f"--store {store!r}: expected HOST:PORT (or :PORT) with a port in 0-65535")
    return host or None, int(p)
