"""The contract between ``dynatrain launch`` and its worker processes.

The launcher agent hands each worker its place in the job through environment variables, as
``torchrun`` and DeepSpeed's launcher do; this module is the only place in the library that reads
them. ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are the usual
torch.distributed ones (DeepSpeed reads them too); ours are:

=====================  ======================================================================
``DYNATRAIN_STORE``    ``HOST:PORT`` of the job's ``TCPStore`` (hosted by the launcher agent)
``DYNATRAIN_MEMBER``   this process's member id, stable across generations (``g0r1``)
``DYNATRAIN_GEN``      the generation this process starts in
``DYNATRAIN_JOIN``     ``1`` when the process joins a running job at a resize
=====================  ======================================================================
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

STORE = "DYNATRAIN_STORE"
MEMBER = "DYNATRAIN_MEMBER"
GENERATION = "DYNATRAIN_GEN"
JOIN = "DYNATRAIN_JOIN"


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

    @staticmethod
    def from_environ(environ: Optional[Mapping[str, str]] = None) -> Optional["LaunchContext"]:
        """The context the launcher set, or None when the process was not started by it."""
        env = os.environ if environ is None else environ
        if STORE not in env:
            return None
        host, _, port = env[STORE].rpartition(":")
        return LaunchContext(store_host=host, store_port=int(port), member=env[MEMBER],
                             generation=int(env.get(GENERATION, "0")), rank=int(env["RANK"]),
                             world_size=int(env["WORLD_SIZE"]), local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                             joiner=env.get(JOIN, "0") == "1")

    def worker_environ(self) -> dict:
        """The variables the launcher sets for a worker with this context."""
        return {
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


def member_id(generation: int, rank: int) -> str:
    """The member id of the process created for ``rank`` of ``generation``."""
    return f"g{generation}r{rank}"
