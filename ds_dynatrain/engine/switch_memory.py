"""Memory a change of layout will need on top of what the process holds, touched ahead in a
background thread while training goes on and held until the change frees it for the new engine (a
prepared switch): a TP or PP switch over the same processes, and a DP job's change of world size on
the ranks that stay.

Why: a switch that makes a rank's share of the model larger (PP 2 -> 1, TP 2 -> 1) needs memory the
process never held: the new partitions the transfer writes, the larger working parameters, and
DeepSpeed's per-step gradient buffers (its reduction bucket, allocated and freed at every step,
``stage_1_and_2.py`` ``setup_buckets``/``reduce_gradients``, and the flat copy ``allreduce_bucket``
all-reduces). Memory new to a process costs a page fault per page, and on a VM whose host takes
back free pages (a virtio balloon with free page reporting) a fault on the host too. Measured on a
2-core VM, a 100 M-parameter PP 2 -> 1 switch at world 2: the copies into the new partitions took
0.42-0.57 s and the first step after the switch 0.9-1.8 s more than a normal one; with 1.2 GB per
rank touched in the background during the step before and freed at the switch, 0.05-0.09 s and
none in the first runs (freed pages the kernel hands out again at once cost a fault in the guest
only, not on the host); the benchmarks' runs since show the gain and its spread (README,
"Performance"). A DP resize's survivor allocates its new partitions too: in a 1 -> 2 grow of that
size, copying the half it keeps into them took 0.7-0.9 s cold against 0.05 s in a 2 -> 1 shrink,
whose leaver had just freed its memory. On a host without such a balloon the gain is smaller, and
with the working parameters on an accelerator nothing is held (the new layout's memory is device
memory).

What is held: for a band switch (:func:`switch_bytes`) the new partitions of the fp32 master and
the optimizer's moments, plus three times the growth of the rank's working parameters (the
parameters, their gradients in the reduction bucket, and the bucket's flat copy); for a change of
world size (:func:`world_change_bytes`) the new partitions, as fp32 tensors of their lengths: the
resize receives and keeps the moments (and a bf16/fp16 master) in them as they are, so those bytes
land in pages already mapped (:func:`release_switch_memory` hands them over); at most a share of
the host's available memory (:func:`memory_cap`).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import psutil
import torch

from io_engine.priority import lower_thread_priority

from ..errors import ResizeRefusedError
from ..log import logger
from ..zero.geometry import layout_of
from .members import planned_members

# touched and held in pieces, so that a release stops the thread soon; each above glibc's largest
# mmap threshold (32 MiB on 64-bit, mallopt(3)), so that it is a mapping of its own, which goes back
# to the kernel when freed for any thread to take (a smaller piece stays in the thread's arena)
CHUNK_BYTES = 64 << 20
WORKING_COPIES = 3  # parameters, their gradients in DeepSpeed's bucket, the bucket's flat copy
TOUCH_NICE = 19  # the touching thread's nice value (added to its own, capped at 19)


def band_numel(layout, rank: int) -> int:
    """Elements of the working parameters global ``rank`` holds under ``layout`` (a band layout:
    its stage's or its TP shard's trainable parameters)."""
    return sum(p.numel for g in layout.zero_of(rank).groups for p in g)


def partition_numel(layout, rank: int) -> int:
    """Elements of global ``rank``'s ZeRO partitions under ``layout`` (one fp32 master or one
    moment), padding included."""
    zl = layout.zero_of(rank)
    return sum(zl.partition_numel(b) for b in range(zl.num_partitions))


def switch_bytes(old, new, rank: int, working_size: int, state_kinds: int) -> int:
    """Bytes global ``rank`` will need at band layout ``new`` that it does not hold at ``old``:
    its new partitions (``state_kinds`` fp32 tensors each: master and moments) and
    :data:`WORKING_COPIES` times the growth of its working parameters (``working_size`` bytes an
    element; none at ZeRO-3, whose working parameters are partitioned too). An estimate for
    DeepSpeed's ZeRO-1/2 with contiguous gradients; 0 or more."""
    partitions = partition_numel(new, rank) * 4 * state_kinds
    growth = max(0, band_numel(new, rank) - band_numel(old, rank)) * working_size
    if new.zero_of(rank).stage == 3:
        growth = 0
    return partitions + WORKING_COPIES * growth


def world_change_partitions(layout, world_size: int, state_kinds: int) -> List[int]:
    """Lengths of the fp32 tensors a rank that stays in a DP job's change from ZeRO ``layout`` to
    ``world_size`` ranks will need that it does not hold: each of its new partitions
    (``layout.with_world_size(world_size).partition_numel``; every rank's are the same size,
    padding included) ``state_kinds`` times, in partition order."""
    new = layout.with_world_size(world_size)
    return [new.partition_numel(b) for b in range(new.num_partitions) for _ in range(state_kinds)]


def world_change_bytes(layout, world_size: int, state_kinds: int) -> int:
    """Bytes of :func:`world_change_partitions`. The working parameters stay as they are
    (ZeRO-1/2; at ZeRO-3 their partitions change too, not counted: an estimate). 0 or more."""
    return 4 * sum(world_change_partitions(layout, world_size, state_kinds))


def memory_cap() -> int:
    """The most one process holds ahead: half the host's available memory over the processes of
    the host (``LOCAL_WORLD_SIZE``), bytes."""
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return psutil.virtual_memory().available // (2 * local)


class HeldMemory:
    """``nbytes`` bytes allocated and written in a background thread at nice value
    :data:`TOUCH_NICE`, held until :meth:`release`: first one fp32 tensor (1-D) of each length in
    ``partitions`` (the new partitions a DP resize will receive into, handed over as they are by
    :meth:`release`), then the rest in uint8 pieces of :data:`CHUNK_BYTES`. Each is written a
    piece at a time. ``key`` names the layout it was prepared for (``("dp"|"pp"|"tp", world
    size, degree)``)."""

    def __init__(self, nbytes: int, key: Tuple, partitions: Sequence[int] = ()):
        self.nbytes, self.key = nbytes, key
        self.touched = 0  # bytes touched so far
        self.seconds: Optional[float] = None  # how long the touching took, once done
        self._partitions = list(partitions)
        self._tensors: List[torch.Tensor] = []
        self._chunks: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._touch, name="dynatrain-switch-memory", daemon=True)
        self._thread.start()

    def _touch(self) -> None:
        lower_thread_priority(TOUCH_NICE)  # the CPU time training leaves idle first
        t0 = time.perf_counter()
        for numel in self._partitions:
            if self._stop.is_set() or self.touched + numel * 4 > self.nbytes:
                break
            tensor = torch.empty(numel, dtype=torch.float32)
            self._tensors.append(tensor)
            step = CHUNK_BYTES // 4
            for pos in range(0, numel, step):
                if self._stop.is_set():
                    break
                n = min(step, numel - pos)
                tensor.narrow(0, pos, n).fill_(0)  # releases the GIL: training goes on beside it
                self.touched += n * 4
        while self.touched < self.nbytes and not self._stop.is_set():
            n = min(CHUNK_BYTES, self.nbytes - self.touched)
            chunk = torch.empty(n, dtype=torch.uint8)
            chunk.fill_(0)
            self._chunks.append(chunk)
            self.touched += n
        self.seconds = time.perf_counter() - t0

    def release(self) -> Tuple[int, float, List[torch.Tensor]]:
        """Stop the thread (after the piece it is writing) and free the pieces; returns the bytes
        touched, the seconds the touching took (until now where it was stopped), and the partition
        tensors, which the caller owns from now on (a tensor the thread was stopped in is written
        in part)."""
        self._stop.set()
        self._thread.join()
        self._chunks.clear()
        tensors, self._tensors = self._tensors, []
        return self.touched, self.seconds or 0.0, tensors


def state_kinds(engine) -> int:
    """fp32 tensors of a partition's optimizer state: the master and each tensor moment the torch
    optimizer holds (Adam: 3); 3 before the first step."""
    basic = engine.optimizer.optimizer
    for st in basic.state.values():
        return 1 + sum(1 for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return 3


def prepare_switch(engine, key: Tuple, new_layout: Callable[[], object]) -> int:
    """Start holding the memory the band layout ``new_layout()`` will need on this rank (``key``:
    ``("pp"|"tp", world size, degree)``; a hold for the same key goes on without computing the
    layout again, another one is released once the new layout is known). Returns the bytes the
    thread will touch (fewer are touched where the switch comes first); 0: ``dynatrain.
    warm_switch_steps`` is 0, the working parameters are on an accelerator (the new layout's memory
    is then device memory, which a host thread cannot touch ahead), or nothing to hold. Not
    collective.

    Raises:
        ResizeRefusedError: from ``new_layout()``; the hold as it was.
    """
    dt = engine._dt

    def wanted(param: torch.Tensor) -> Tuple[int, List[int]]:
        new = new_layout()
        old = dt.tp_layout if dt.tp_layout is not None else dt.pp_layout
        return switch_bytes(old, new, engine.global_rank, param.element_size(), state_kinds(engine)), []

    return _hold(engine, key, wanted)


def prepare_world_change(engine, world_size: int) -> int:
    """Start holding the memory a DP job's change to ``world_size`` ranks will need on this rank
    if it stays (:func:`world_change_bytes`; key ``("dp", world_size, None)``), as
    :func:`prepare_switch` does for a band switch. A rank that a shrink to ``world_size`` would
    let go (not among :func:`~ds_dynatrain.engine.members.planned_members`, the members the
    resize will pick unless a preemption comes first) holds nothing and lets go of a hold made
    before. Returns the bytes the thread will touch; 0 as there. Not collective.

    Raises:
        LayoutMismatchError: (ZeRO-3) DeepSpeed's sub-groups differ from the computed ones.
    """
    dt = engine._dt

    def wanted(param: torch.Tensor) -> Tuple[int, List[int]]:
        if world_size < len(dt.members) and dt.member not in planned_members(engine, world_size):
            return 0, []  # let go by the shrink: _hold releases a hold made before and holds nothing
        partitions = world_change_partitions(layout_of(engine), world_size, state_kinds(engine))
        return 4 * sum(partitions), partitions

    return _hold(engine, ("dp", world_size, None), wanted)


def _hold(engine, key: Tuple, wanted_of: Callable[[torch.Tensor], Tuple[int, List[int]]]) -> int:
    """The hold of :func:`prepare_switch` and :func:`prepare_world_change`: ``wanted_of(a working
    parameter)`` is ``(bytes, lengths of the partition tensors among them)``, capped by
    :func:`memory_cap`; its errors go up with the hold as it was."""
    dt = engine._dt
    if dt.config.warm_switch_steps <= 0:
        return 0
    if dt.switch_hold is not None and dt.switch_hold.key == key:
        return dt.switch_hold.nbytes
    param = next(iter(engine.module.parameters()))
    if param.device.type != "cpu":
        return 0
    wanted, partitions = wanted_of(param)
    release_switch_memory(dt)
    nbytes = min(wanted, memory_cap())
    if nbytes <= 0:
        return 0
    dt.switch_hold = HeldMemory(nbytes, key, partitions)
    if engine.global_rank == 0:
        what = (
            f"the resize to world size {key[1]}"
            if key[0] == "dp"
            else f"{key[0].upper()} {key[2]} at world size {key[1]}"
        )
        logger.info(f"{what}: {nbytes / 2**20:.0f} MiB touched ahead")
    return nbytes


def record_key(rec) -> Tuple:
    """The key of a hold made for the layout resize record ``rec`` changes to: ``("tp", world size,
    TP degree)``, ``("pp", world size, PP degree)`` or ``("dp", world size, None)``."""
    if rec.tensor_parallel_to is not None:
        return "tp", rec.to_world_size, rec.tensor_parallel_to
    if rec.pipeline_parallel_to is not None:
        return "pp", rec.to_world_size, rec.pipeline_parallel_to
    return "dp", rec.to_world_size, None


def release_switch_memory(dt, rec=None, key: Optional[Tuple] = None) -> List[torch.Tensor]:
    """Free the memory held for a switch (none: nothing happens); with ``rec`` (the record of the
    switch it was held for), put the bytes held and the seconds the touching took into it, unless
    ``key`` is given and the hold was made for another layout (its key differs). Returns the
    hold's partition tensors (:class:`HeldMemory`, written ahead) where ``key`` is given and is
    the hold's, for the new partitions; else none (they are freed)."""
    hold, dt.switch_hold = dt.switch_hold, None
    if hold is None:
        return []
    nbytes, seconds, tensors = hold.release()
    if rec is not None and (key is None or hold.key == key):
        rec.prepared_bytes, rec.prepared_touch_s = nbytes, seconds
    return tensors if key is not None and hold.key == key else []


@contextmanager
def released_on_refusal(dt) -> Iterator[None]:
    """Around an ``engine.resize``: a ``ResizeRefusedError`` from it frees the memory held for a
    switch (it will not come as prepared) and goes on up."""
    try:
        yield
    except ResizeRefusedError:
        release_switch_memory(dt)
        raise


def _next_scheduled(dt, step: int) -> Optional[Tuple[int, int]]:
    """The first entry of the resize schedule after ``step``, if it is within ``dynatrain.
    warm_switch_steps`` steps: ``(its step, world size)``; None otherwise."""
    later = [(s, world) for s, world in sorted(dt.schedule.items()) if s > step]
    if not later or later[0][0] - step > dt.config.warm_switch_steps:
        return None
    return later[0]


def next_band_switch(dt, step: int) -> Optional[Tuple[int, int]]:
    """The next entry of the resize schedule after ``step`` that changes the TP or PP degree at the
    job's world size, within ``dynatrain.warm_switch_steps`` steps: ``(world size, degree)``;
    None where there is none (a grow or shrink of the world is prepared by its joiners and their
    warm-up instead)."""
    entry = _next_scheduled(dt, step)
    if entry is None:
        return None
    s, world = entry
    degree = (dt.pp_schedule if dt.pp_layout is not None else dt.tp_schedule).get(s)
    current = dt.pp_layout.pp if dt.pp_layout is not None else dt.tp
    if world != len(dt.members) or degree is None or degree == current:
        return None
    return world, degree


def next_world_change(dt, step: int) -> Optional[int]:
    """The world size of a DP job's next change of world size (no AutoTP, no pipeline): a
    ``dynatrain resize`` request being prepared behind training (``dt.preparing``), or else the
    next entry of the resize schedule after ``step``, within ``dynatrain.warm_switch_steps`` steps;
    None where there is none or ``warm_switch_steps`` is 0."""
    ahead = dt.config.warm_switch_steps
    if ahead <= 0 or dt.tp_layout is not None or dt.pp_layout is not None:
        return None
    if dt.preparing is not None:
        world = dt.preparing.world_size
    else:
        entry = _next_scheduled(dt, step)
        world = None if entry is None else entry[1]
    return None if world == len(dt.members) else world


def prepare_scheduled(engine) -> None:
    """At a step boundary: prepare the next change of layout known ahead: a DP job's change of
    world size (:func:`next_world_change`) with :func:`prepare_world_change`, a scheduled TP or PP
    switch at the job's world size (:func:`next_band_switch`) with ``engine.prepare_resize``. A
    layout the switch will refuse is left to it, which says why, and any other failure is logged,
    never raised (training goes on and the switch comes cold)."""
    dt = engine._dt
    world = next_world_change(dt, engine.global_steps)
    if world is not None:
        _prepare_or_warn(engine, f"the resize to {world}", lambda: prepare_world_change(engine, world))
        return
    ahead = next_band_switch(dt, engine.global_steps)
    if ahead is None:
        return
    degree = {"pipeline_parallel" if dt.pp_layout is not None else "tensor_parallel": ahead[1]}
    _prepare_or_warn(engine, f"the switch scheduled in {ahead}", lambda: engine.prepare_resize(ahead[0], **degree))


def _prepare_or_warn(engine, what: str, prepare: Callable[[], int]) -> None:
    try:
        prepare()
    except ResizeRefusedError:
        pass  # the switch refuses it, with the reason
    except Exception as err:  # noqa: BLE001 - an optimisation: training goes on cold
        release_switch_memory(engine._dt)
        if engine.global_rank == 0:
            logger.warning(f"the memory of {what} is not touched ahead: {err}")
