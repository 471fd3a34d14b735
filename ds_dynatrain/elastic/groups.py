"""Process groups of the elastic device manager: built in the background, cached by member set.

The logical layout (ranks, partitions) is decoupled from the physical groups: the default
process group of a generation is a gloo group over its members in rank order, built by
:meth:`GroupCache.prepare` in a background thread while training goes on in the current
generation, and kept after the job leaves it, so that a later generation over the same members
(4 -> 2 -> 4 with the two leavers standing by) switches to it without any rendezvous. This is the
device manager of DynaTrain (group caching and background construction of the next world).

``torch.distributed`` has one default group per process and no public way to swap it without
destroying it (``destroy_process_group`` shuts every backend down). :func:`install_default` and
:func:`detach_default` register and unregister a group object in ``torch.distributed``'s world
table (``distributed_c10d._world``) the way ``init_process_group`` and ``destroy_process_group``
do, leaving the object itself alive. They use private names of torch (2.13); the tests pin what
they must do (``tests/test_groups.py``).

Only gloo groups are built in the background; other backends form their group in the
foreground with ``init_process_group`` (:meth:`GroupCache.activate` falls back to it).
"""

from __future__ import annotations

import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as tdist

from ..errors import TransitionAbortedError
from ..log import logger
from ..transition.background import BackgroundCall

DEAD_POLL_S = 0.05  # how often a group being formed checks whether a member died

DEFAULT_NAME = "0"  # the name init_process_group gives the default group (its group counter starts at 0)
_CACHES: list = []  # weak references to every GroupCache of this process (closed at exit)


def close_all() -> None:
    """Shut down every cached group of this process (at exit, before the interpreter tears down:
    a gloo group left to the interpreter's teardown can abort the process)."""
    for ref in _CACHES:
        cache = ref()
        if cache is not None:
            cache.close()


ARRIVAL_POLL_MAX_S = 0.02  # the longest pause between two looks at the arrival keys
CLOSE_JOIN_S = 5.0  # at exit, how long the background builds may take to end once cancelled


def await_members(store, rank: int, world_size: int, timeout_s: float, cancel: threading.Event) -> None:
    """Arrival barrier before gloo's rendezvous: set this rank's arrival key on ``store`` (a
    ``PrefixStore`` of one formation) and poll (``store.check``, pauses growing from 1 ms to
    :data:`ARRIVAL_POLL_MAX_S`) until every rank's is there. gloo's rendezvous blocks inside
    ``ProcessGroupGloo``'s constructor until its timeout when a member never comes (one that died
    after the formation was published), where nothing can stop it; this wait can be stopped.

    Raises:
        TransitionAbortedError: ``cancel`` was set (the process exits, or a later formation
            replaced this one).
        RuntimeError: not every rank arrived within ``timeout_s`` seconds (naming those missing).
    """
    store.set(f"dynatrain-arrived/{rank}", b"1")
    keys = [f"dynatrain-arrived/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check(keys):
        if cancel.wait(pause):
            raise TransitionAbortedError(f"rank {rank} of {world_size}: the group's formation was cancelled")
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([keys[r]])]
            raise RuntimeError(f"ranks {missing} of {world_size} did not arrive within {timeout_s:.0f} s")
        pause = min(2 * pause, ARRIVAL_POLL_MAX_S)


def build_gloo_group(store, rank: int, world_size: int, timeout_s: float) -> tdist.ProcessGroup:
    """A gloo ``ProcessGroup`` over ``store`` (rank ``rank`` of ``world_size``), not registered
    anywhere: it can be built in any thread and installed later as the default group.

    The one gloo backend serves CPU and CUDA tensors, as in a group ``init_process_group("gloo")``
    makes (torch registers it for both device types): gloo copies CUDA tensors through pinned
    host memory for the collectives DeepSpeed's ZeRO-1/2 and this plugin issue on the default
    group (all-reduce, reduce, broadcast, all-gather). Without the CUDA entry a collective on a
    device tensor fails with "No backend type associated with device type cuda".

    Blocks until all ``world_size`` processes called it with the same ``store`` prefix (gloo's
    full-mesh rendezvous), at most ``timeout_s`` seconds.

    Raises:
        RuntimeError: the rendezvous did not complete in time (gloo's error).
    """
    backend = tdist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    backend._set_sequence_number_for_group()
    pg = tdist.ProcessGroup(store, rank, world_size)
    pg._set_default_backend(tdist.ProcessGroup.BackendType.GLOO)
    for device in ("cpu", "cuda"):
        pg._register_backend(torch.device(device), tdist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_group_name(DEFAULT_NAME)
    pg._set_group_desc("default_pg")
    return pg


def install_default(pg: tdist.ProcessGroup, store, backend: str = "gloo", group_count: int = 1) -> None:
    """Make ``pg`` the default process group, as ``init_process_group`` leaves it.

    ``group_count``: torch's counter that names the next ``new_group`` (``"1"`` after
    ``init_process_group``). A group installed again must go on from where its last use left it:
    subgroups rendezvous on the default group's store under their name, and a name used before
    would meet the old subgroup's keys.

    Raises:
        RuntimeError: a default group is installed already.
    """
    from torch.distributed import distributed_c10d as c10d

    if tdist.is_initialized():
        raise RuntimeError("a default process group is installed already; detach it first")
    config = str(c10d.BackendConfig(backend))
    if hasattr(c10d, "_register_pg_in_world"):
        c10d._register_pg_in_world(
            pg,
            backend_name=backend,
            store=store,
            group_name=DEFAULT_NAME,
            backend_config=config,
            add_to_default_tag=True,
        )
    else:  # torch before 2.13 has no helper: the same tables, as its init_process_group fills them
        c10d._world.pg_map[pg] = (backend, store)
        c10d._world.pg_names[pg] = DEFAULT_NAME
        c10d._world.pg_backend_config[pg] = config
        c10d._register_process_group(DEFAULT_NAME, pg)
        tag = f"ptd:{DEFAULT_NAME}"
        c10d._world.tags_to_pg.setdefault("", []).append(pg)
        c10d._world.tags_to_pg.setdefault(tag, []).append(pg)
        c10d._world.pg_to_tag[pg] = tag
    c10d._update_default_pg(pg)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(pg.size())}
    c10d._world.group_count = group_count


def detach_default() -> Optional[tdist.ProcessGroup]:
    """Unregister the default group and every other group of ``torch.distributed``, as
    ``destroy_process_group()`` does, but shut down only the others: the default group object
    stays usable and is returned (None when there was none)."""
    from torch.distributed import distributed_c10d as c10d

    if not tdist.is_initialized():
        return None
    default = c10d._world.default_pg
    for pg in list(c10d._world.pg_names):
        if pg is not default:
            pg.shutdown()
    c10d._update_default_pg(None)
    for table in (
        c10d._world.pg_map,
        c10d._world.pg_names,
        c10d._world.pg_group_ranks,
        c10d._world.pg_backend_config,
        c10d._world.pg_to_tag,
        c10d._world.tags_to_pg,
        c10d._world.pg_coalesce_state,
    ):
        table.clear()
    c10d._unregister_all_process_groups()
    c10d._world.group_count = 0
    return default


class _Build:
    """One group being built (or built) for a member tuple."""

    def __init__(self, members: Tuple[str, ...], prefix: str, rank: int):
        self.members, self.prefix, self.rank = members, prefix, rank
        self.pg: Optional[tdist.ProcessGroup] = None
        self.store = None
        self.error: Optional[str] = None
        self.seconds = 0.0
        self.group_count = 1  # torch's subgroup counter when this group was last the default
        self.done = threading.Event()
        self.cancel = threading.Event()  # set at exit or when replaced: a build still waiting ends
        self.thread: Optional[threading.Thread] = None


class GroupCache:
    """This process's gloo groups by member tuple (members in rank order).

    Args:
        connect: returns a new client of the job's ``TCPStore`` (every group rendezvous on its own
            prefix of it, through its own connection: a store client blocks in a wait, and the
            training thread must not wait behind a rendezvous).
        member: this process's member id.
        backend: ``torch.distributed`` backend of the job (background builds: gloo only).
        on_new_default: called after every switch of the default group (DeepSpeed's comm reset).
    """

    def __init__(
        self,
        connect: Callable[[], object],
        member: str,
        backend: str,
        on_new_default: Optional[Callable[[], None]] = None,
    ):
        self.connect = connect
        self.member = member
        self.backend = backend
        self.on_new_default = on_new_default
        self._builds: Dict[Tuple[str, ...], _Build] = {}
        self.active: Optional[Tuple[str, ...]] = None
        _CACHES.append(weakref.ref(self))

    def prepare(self, members: Sequence[str], prefix: str, timeout_s: float, background: bool = True) -> None:
        """Start building the group of ``members`` on store prefix ``prefix`` (once per member
        tuple; a cached group is kept). Collective over ``members``: each calls it with the same
        ``prefix``. ``background``: in a daemon thread (training goes on); else here."""
        members = tuple(members)
        old = self._builds.get(members)
        if old is not None and old.error is None and (old.pg is not None or old.prefix == prefix):
            return
        if old is not None:
            old.cancel.set()  # an abandoned formation still waiting for its members ends
        b = _Build(members, prefix, members.index(self.member))
        self._builds[members] = b
        if self.backend != "gloo":
            b.done.set()  # formed in the foreground by activate
            return

        def run():
            t = time.perf_counter()
            try:
                store = tdist.PrefixStore(prefix, self.connect())
                await_members(store, b.rank, len(members), timeout_s, b.cancel)
                pg = build_gloo_group(store, b.rank, len(members), timeout_s)
                if self._builds.get(members) is not b:  # replaced by a later formation meanwhile
                    pg.shutdown()
                else:
                    b.pg, b.store = pg, store
            except Exception as err:  # noqa: BLE001 - reported to the step that waits for it
                b.error = f"{type(err).__name__}: {err}"
            b.seconds = time.perf_counter() - t
            b.done.set()

        if background:
            b.thread = threading.Thread(target=run, name=f"dynatrain-group-{prefix}", daemon=True)
            b.thread.start()
        else:
            run()

    def ready(self, members: Sequence[str]) -> bool:
        """Whether the group of ``members`` is built or failed (no wait)."""
        b = self._builds.get(tuple(members))
        return b is not None and b.done.is_set()

    def error(self, members: Sequence[str]) -> Optional[str]:
        b = self._builds.get(tuple(members))
        return None if b is None else b.error

    def activate(
        self,
        members: Sequence[str],
        prefix: str,
        timeout_s: float,
        cannot_form: Optional[Callable[[], Optional[str]]] = None,
    ) -> bool:
        """Make the group of ``members`` the default process group: the cached one, or the one
        being built (waited for), or one built now. The current default group is detached and
        stays cached. Returns True when an existing group was reused. ``cannot_form``: polled
        while the group is being built; a reason it returns (a member is dead) ends the wait.

        Raises:
            TransitionAbortedError: the group could not be built within ``timeout_s``, or
                ``cannot_form`` gave a reason.
        """
        members = tuple(members)
        b = self._builds.get(members)
        reused = b is not None and b.pg is not None and b.prefix != prefix
        if b is None or b.error is not None or (b.pg is None and b.prefix != prefix):
            self.prepare(members, prefix, timeout_s, background=cannot_form is not None)
            b = self._builds[members]
        deadline = time.monotonic() + timeout_s + 5.0
        while not b.done.wait(DEAD_POLL_S if cannot_form is not None else timeout_s + 5.0):
            why = cannot_form() if cannot_form is not None else None
            if why is not None:
                raise TransitionAbortedError(f"the process group of {list(members)} cannot form: {why}")
            if time.monotonic() > deadline:
                raise TransitionAbortedError(
                    f"the process group of {list(members)} was not built within {timeout_s:.0f} s"
                )
        self.detach()
        if self.on_new_default is not None:
            self.on_new_default()
        if self.backend != "gloo":
            tdist.init_process_group(
                self.backend,
                store=tdist.PrefixStore(prefix, self.connect()),
                rank=b.rank,
                world_size=len(members),
                timeout=timedelta(seconds=timeout_s),
            )
        else:
            if b.error is not None:
                del self._builds[members]
                raise TransitionAbortedError(
                    f"rank {b.rank} of {len(members)} could not form the process group "
                    f"of {list(members)} within {timeout_s:.0f} s: {b.error}"
                )
            install_default(b.pg, b.store, self.backend, b.group_count)
        self.active = members
        return reused

    def detach(self) -> None:
        """Unregister the default group (it stays cached), remembering its subgroup counter. A
        default group that is none of this cache's (the script's own ``init_process_group``
        before ``ds_dynatrain.initialize``) is shut down: the job's group replaces it."""
        current = self._builds.get(self.active) if self.active is not None else None
        if current is not None and tdist.is_initialized():
            from torch.distributed import distributed_c10d as c10d

            current.group_count = c10d._world.group_count
        foreign = self.active is None
        old = detach_default()
        if old is not None and foreign and not any(b.pg is old for b in self._builds.values()):
            old.shutdown()  # nothing of the job runs on it; its last reference goes with the caller's
        self.active = None

    def evict(self, keep: Callable[[Tuple[str, ...]], bool]) -> int:
        """Shut down cached groups (not the active one) for which ``keep(members)`` is false,
        e.g. those with a member that has left the job. Returns how many went."""
        gone = 0
        for members in list(self._builds):
            b = self._builds[members]
            if members == self.active or keep(members) or not b.done.is_set():
                continue
            del self._builds[members]
            if b.pg is not None:
                b.pg.shutdown()
            gone += 1
        return gone

    def close(self) -> None:
        """Detach the default group and shut down every cached group (at exit). Builds still
        running are cancelled and waited for (at most :data:`CLOSE_JOIN_S` in all): a thread left
        inside torch's code during the interpreter's teardown can abort the process.

        One case cannot be cancelled: a member that arrived and then died leaves the others inside
        gloo's rendezvous (``ProcessGroupGloo``'s constructor), which returns only at its timeout,
        up to five times ``timeout_s`` when the dead member had already published its address
        (measured on torch 2.13). Such a build is named in a warning and its thread (with gloo's
        ``gloo_tcp_loop``) ends with the process."""
        detach_default()
        for b in self._builds.values():
            b.cancel.set()
        deadline = time.monotonic() + CLOSE_JOIN_S  # one wait for all: the builds end together
        for b in self._builds.values():
            if b.thread is not None:
                b.thread.join(max(0.0, deadline - time.monotonic()))
                if b.thread.is_alive():
                    logger.warning(
                        f"member {self.member}: the formation of the group of {list(b.members)} is still inside "
                        f"gloo's rendezvous {CLOSE_JOIN_S:.0f} s after it was cancelled (a member that arrived "
                        "never completed it, as one that died does); its thread ends with the process"
                    )
        for b in self._builds.values():
            if b.pg is not None and b.done.is_set():
                try:
                    b.pg.shutdown()
                except Exception:  # noqa: BLE001 - exiting
                    pass
        self._builds.clear()
        self.active = None


class BackgroundGroup:
    """A group built by ``build()`` in a daemon thread (a transition's private group, built while
    training goes on). :meth:`get` waits for it and re-raises the build's error."""

    def __init__(self, build: Callable[[], object], name: str):
        self._closed = False
        self._built = None  # the group, until close() shuts it down
        self._lock = threading.Lock()  # the build's end and close() decide who shuts it down

        def keep(group):
            with self._lock:
                if self._closed:  # given up while it was built: nobody will take it
                    group.shutdown()
                    return None
                self._built = group
                return group

        self._call = BackgroundCall(build, name, keep)

    def ready(self) -> bool:
        return self._call.done()

    def close(self) -> None:
        """Shut the group down if it was built (a given-up transition); a build still running
        shuts its group down when it ends."""
        with self._lock:
            self._closed = True
            group, self._built = self._built, None
        if group is not None:
            group.shutdown()

    @property
    def error(self) -> Optional[str]:
        return None if self._call.error is None else str(self._call.error)

    def get(self, timeout_s: float):
        """The group, once built; None once :meth:`close` gave it up.

        Raises:
            TransitionAbortedError: the build failed or did not end within ``timeout_s``.
        """
        group = self._call.result(
            timeout_s,
            lambda: f"a transition group was not built within {timeout_s:.0f} s",
            "a transition group could not be built",
        )
        return None if self._closed else group
