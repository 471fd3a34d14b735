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
``DYNATRAIN_RANK``     this process's rank in the generation it starts in (not rewritten later)
``DYNATRAIN_WORLD``    that generation's world size
=====================  ======================================================================

A script may start ``torch.distributed`` itself before ``ds_dynatrain.initialize``
(``deepspeed.init_distributed()``, ``init_process_group("gloo")``: env://). The job's store cannot
serve as its rendezvous (the launcher hosts it on its own port, and every group of the job has its
own prefix there), so the launcher hands such a call a store of its own through the usual
variables, with torchelastic's semantics (``TORCHELASTIC_USE_AGENT_STORE``: every rank connects
as a client, none binds ``MASTER_PORT``):

* processes started together (the launch, a restart) get ``MASTER_ADDR:MASTER_PORT`` of one store
  per such start that the launcher hosts, and their true ``RANK`` and ``WORLD_SIZE``: the script's
  group is a real one over them;
* a joiner, started while the others train, cannot form a group with them before it joins (they
  are inside a step): it gets ``RANK=0``, ``WORLD_SIZE=1`` and ``MASTER_PORT=0`` (a store of its own,
  any free port), so the script's own call forms a group of one. ``DYNATRAIN_RANK`` and
  ``DYNATRAIN_WORLD`` hold its place in the job, and :func:`enter_generation` makes ``RANK`` and
  ``WORLD_SIZE`` true when it joins.

``ds_dynatrain.initialize`` replaces a default group the script made with the job's own
(:meth:`~ds_dynatrain.elastic.groups.GroupCache.activate`); a pipeline job keeps it (its
``PipelineModule``'s groups were made on it) until its first shrink forms the job's own.

The launcher also sets ``THP_MEM_ALLOC_ENABLE=1`` where the environment does not name it
(:func:`with_huge_pages`).
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
RANK = "DYNATRAIN_RANK"
WORLD = "DYNATRAIN_WORLD"


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
            rank=int(env.get(RANK, env["RANK"])),
            world_size=int(env.get(WORLD, env["WORLD_SIZE"])),
            local_rank=int(env.get("LOCAL_RANK", env.get(RANK, env["RANK"]))),
            joiner=env.get(JOIN, "0") == "1",
            restore_dir=env.get(RESTORE) or None,
        )

    def worker_environ(self, script_store_port: Optional[int] = None) -> dict:
        """The variables the launcher sets for a worker with this context.

        ``script_store_port``: the port of the store (hosted at ``store_host``) that a script's own
        ``init_process_group`` connects to, shared by the processes started with this one; 0: a
        store of its own, so the script's own call forms a group of one (a joiner: ``RANK`` 0 and
        ``WORLD_SIZE`` 1 until it joins, see the module docstring); None: no ``MASTER_*``
        variables.
        """
        env = {
            STORE: f"{self.store_host}:{self.store_port}",
            MEMBER: self.member,
            GENERATION: str(self.generation),
            JOIN: "1" if self.joiner else "0",
            RANK: str(self.rank),
            WORLD: str(self.world_size),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.world_size),
        }
        if script_store_port == 0:
            env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
            env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        elif script_store_port is not None:
            env.update(MASTER_ADDR=self.store_host, MASTER_PORT=str(script_store_port))
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        if self.restore_dir:
            env[RESTORE] = self.restore_dir
        return env


HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def with_huge_pages(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """``env`` with torch's transparent-huge-page CPU allocation on (``THP_MEM_ALLOC_ENABLE=1``,
    read once per process at its first CPU allocation, so it must be in a worker's environment
    from its start), unless ``env`` names it already.

    Each CPU tensor of 2 MiB or more is then advised ``MADV_HUGEPAGE`` (``c10/core/alloc_cpu.cpp``):
    one page fault per 2 MiB instead of 512. It also starts on a page (measured with torch 2.13:
    page aligned, not 2 MiB aligned), which lets a snapshot write it, and the parameters at
    512-byte offsets of a flat buffer, with O_DIRECT straight from its memory
    (:mod:`io_engine.writer`). Partitions, flat
    buffers and gradients that a rebuild or the first step after a resize allocates anew are
    faulted in several times faster (measured on a 2-core VM: 1.2 GB of freed-then-reallocated
    memory touched in 0.05 s against 0.3 s); memory the process never held costs about the same
    either way.
    """
    env.setdefault(HUGE_PAGES, "1")
    return env


def launched(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process was started by ``dynatrain launch`` (or ``join``)."""
    return STORE in (os.environ if environ is None else environ)


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


# What other launchers set in their workers' environment (the first match names the launcher):
# accelerate launch runs torchrun underneath, so its own variables are looked at first.
OTHER_LAUNCHERS = (
    ("ACCELERATE_MIXED_PRECISION", "accelerate launch"),
    ("TORCHELASTIC_RUN_ID", "torchrun"),
    ("CROSS_RANK", "DeepSpeed's launcher (deepspeed)"),
    ("OMPI_COMM_WORLD_SIZE", "mpirun"),
    ("PMI_SIZE", "an MPI launcher"),
    ("SLURM_STEP_ID", "srun"),
)
# Variables of a process that is one of several: DeepSpeed's own discovery (env://, MPI, Azure ML,
# SageMaker) deals with those
WORLD_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_RANK",
    "AZUREML_EXPERIMENT_ID",
    "SM_TRAINING_ENV",
)
LAUNCHER_LIMITS = (
    "jobs started by other launchers (torchrun, deepspeed, accelerate launch) have a fixed set of processes: "
    "snapshots and loading a checkpoint at another world size work there; resizes, joins and the restart "
    "of a job after a worker died need `dynatrain launch`"
)


UNNAMED_LAUNCHER = "a launcher other than `dynatrain launch`"
NO_LAUNCHER = "no launcher"


def other_launcher(environ: Optional[Mapping[str, str]] = None) -> str:
    """The launcher that started this process, when not ``dynatrain launch``, as words for a
    message (``"torchrun"``); :data:`UNNAMED_LAUNCHER` where only ``WORLD_SIZE`` tells,
    :data:`NO_LAUNCHER` for a lone process."""
    env = os.environ if environ is None else environ
    for variable, name in OTHER_LAUNCHERS:
        if variable in env:
            return name
    return UNNAMED_LAUNCHER if "WORLD_SIZE" in env else NO_LAUNCHER


def started_elsewhere(environ: Optional[Mapping[str, str]] = None) -> str:
    """How this process was started, when not by ``dynatrain launch``, as the end of a sentence
    that begins "this process was ": ``"started by torchrun, not by `dynatrain launch`"``, or
    ``"started without a launcher, ..."`` for a lone process (:func:`other_launcher`)."""
    name = other_launcher(environ)
    if name == NO_LAUNCHER:
        return "started without a launcher, not by `dynatrain launch`"
    if name == UNNAMED_LAUNCHER:
        return f"started by {name}"
    return f"started by {name}, not by `dynatrain launch`"


def lone_process(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when no launcher started this process: no ``dynatrain launch`` context and none of
    the variables by which torch.distributed, MPI or a cloud service tell a process its place in
    a job. Such a process trains as a job of one (``python train.py``, ``accelerate launch``
    with one process), where DeepSpeed would look for MPI."""
    env = os.environ if environ is None else environ
    several = any(v in env for v in WORLD_VARIABLES) or env.get("SLURM_NTASKS", "1") != "1"
    return not launched(env) and not several


def enter_lone_process(environ: Optional[MutableMapping[str, str]] = None) -> None:
    """Make ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` those of a job of one
    process (DeepSpeed's engine requires ``LOCAL_RANK``), keeping any that is set."""
    env = os.environ if environ is None else environ
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.setdefault(key, "1" if key.endswith("WORLD_SIZE") else "0")


def local_rank(environ: Optional[Mapping[str, str]] = None) -> int:
    """This process's ``LOCAL_RANK`` (its index among the workers of its host; 0 when unset, as in
    a job of one before :func:`enter_lone_process`).

    Raises:
        ValueError: ``LOCAL_RANK`` is not a non-negative integer (names the value).
    """
    env = os.environ if environ is None else environ
    text = env.get("LOCAL_RANK", "0")
    if not text.isdigit():
        raise ValueError(f"LOCAL_RANK={text!r}: not a non-negative integer")
    return int(text)
