"""CPU threads of a worker: the host's CPUs shared among the job's workers on that host, set again at
every generation, because a resize changes how many workers a host runs.

torchrun sets ``OMP_NUM_THREADS=1`` once for a multi-process launch; under an elastic job the count
changes: a host that grows from one worker to two would otherwise run two intra-op thread pools
of all its CPUs each, and OpenMP's spinning workers then make a step several times slower in CPU
time as soon as the two are out of step (measured on a 2-CPU host: the first step after a 1 -> 2
grow cost 2.8x a normal step's CPU time with torch's default of one thread per CPU, 1.0x with one
thread per worker). A user's own ``OMP_NUM_THREADS`` always wins: then nothing is changed.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from .keys import MEMBER_NODE_KEY
from .placement import used_slots

USER_THREADS_ENV = "OMP_NUM_THREADS"


def threads_per_worker(cpus: int, workers: int) -> int:
    """Intra-op threads of each of ``workers`` processes sharing ``cpus`` CPUs: ``cpus // workers``,
    at least 1.

    Raises:
        ValueError: ``cpus`` or ``workers`` below 1 (names the value).
    """
    if cpus < 1:
        raise ValueError(f"{cpus} CPUs: a host has at least one")
    if workers < 1:
        raise ValueError(f"{workers} workers: a host that runs this one runs at least one")
    return max(1, cpus // workers)


def host_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, as ``torch`` counts them by default)."""
    return len(os.sched_getaffinity(0))


def threads_fixed_by_user() -> bool:
    """The user chose the thread count (``OMP_NUM_THREADS`` set where the worker started)."""
    return USER_THREADS_ENV in os.environ


def share_cpus(store, members: Sequence[str], member: str) -> Optional[int]:
    """Set this worker's intra-op threads (``torch.set_num_threads``) to its share of the host's
    CPUs among ``members`` (a generation's processes) that run on the same host as ``member``
    (from the agents' ``dynatrain/member/<m>/node`` keys). Returns the count set, or None where
    the user fixed it (:func:`threads_fixed_by_user`) or this member's host is not known."""
    if threads_fixed_by_user():
        return None
    key = MEMBER_NODE_KEY.format(member)
    if not store.check([key]):
        return None
    node = int(store.get(key))
    n = threads_per_worker(host_cpus(), max(1, used_slots(store, list(members)).get(node, 1)))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def one_thread_unless_fixed() -> None:
    """A process that starts beside a host's running workers (a joiner warming up before its
    generation forms) takes one thread, unless the user fixed the count: the workers keep their
    CPUs until the generation that includes it forms and :func:`share_cpus` sets its share."""
    if not threads_fixed_by_user():
        torch.set_num_threads(1)
