"""The contract between ``dynatrain launch`` and its worker processes.

The launcher agent hands each worker its place in the job through environment variables, as
``torchrun`` and DeepSpeed's launcher do; this module is the only place in the library that reads
them, and the only one that rewrites them (:func:`enter_generation`: DeepSpeed reads ``RANK`` and
``WORLD_SIZE`` again at every engine set-up, so they must be true for each generation).
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are the usual torch.distributed
ones; ours are:

=====================  ======================================================================
``DYNATRAIN_STORE``    ``HOST:PORT`` of the job's ``TCPStore`` (hosted by the launcher agent)
``DYNATRAIN_MEMBER``   this process's member id, stable across generations (``g0r1``)
``DYNATRAIN_GEN``      the generation this process starts in
``DYNATRAIN_JOIN``     ``1`` when the process joins a running job at a resize
``DYNATRAIN_RESTORE``  the snapshot directory to restore from (a restart after a worker died)
=====================  ======================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional

STORE = "DYNATRAIN_STORE"
MEMBER = "DYNATRAIN_MEMBER"
GENERATION = "DYNATRAIN_GEN"
JOIN = "DYNATRAIN_JOIN"
RESTORE = "DYNATRAIN_RESTORE"


@dataclass(frozen=True)
class LaunchContext:
    """Where a worker stands in the job when it starts."""

    store_host: str
    store_port: int
    member: str
    generation: int
    rank: int
    world_size: int
    local_rank: int
    joiner: bool
    restore_dir: Optional[str] = None

    @staticmethod
    def from_environ(environ: Optional[Mapping[str, str]] = None) -> Optional["LaunchContext"]:
        """The context the launcher set, or None when the process was not started by it."""
        env = os.environ if environ is None else environ
        if STORE not in env:
            return None
        host, _, port = env[STORE].rpartition(":")
        return LaunchContext(
            store_host=host,
            store_port=int(port),
            member=env[MEMBER],
            generation=int(env.get(GENERATION, "0")),
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            joiner=env.get(JOIN, "0") == "1",
            restore_dir=env.get(RESTORE) or None,
        )

    def worker_environ(self) -> dict:
        """The variables the launcher sets for a worker with this context."""
        env = {
            STORE: f"{self.store_host}:{self.store_port}",
            MEMBER: self.member,
            GENERATION: str(self.generation),
            JOIN: "1" if self.joiner else "0",
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.store_host,
        }
        if self.restore_dir:
            env[RESTORE] = self.restore_dir
        return env


def member_id(generation: int, rank: int) -> str:
    """The member id of the process created for ``rank`` of ``generation``."""
    return f"g{generation}r{rank}"


def enter_generation(
    rank: int, world_size: int, local_rank: int, environ: Optional[MutableMapping[str, str]] = None
) -> None:
    """Keep ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` true for the
    generation this process now trains in (DeepSpeed reads them at every engine set-up, and
    ZeRO-3 refuses a group that contradicts ``WORLD_SIZE``). ``LOCAL_RANK`` stays the process's
    own (its device): a process keeps its device across generations."""
    env = os.environ if environ is None else environ
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world_size))
