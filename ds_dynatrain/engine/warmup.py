"""A joiner warmed up before it joins: the modules rank 0 has imported, then forward and backward on a
synthetic micro-batch of the job's shape and an optimizer step on a scratch tensor, while the
survivors train and with no collective they must match, so that its engine's set-up and its first
real step cost what they cost the survivors.

Rank 0 lists the modules it has imported after its first optimizer step
(:data:`~ds_dynatrain.elastic.keys.MODULES_KEY`). A joiner imports those of the packages it uses
itself: DeepSpeed imports parts of itself at first use, inside the engine's set-up that runs after
the switch, while the survivors wait at the first gradient reduction. Measured on DeepSpeed 0.19:
its ZeRO optimizer check imports its Muon optimizer, which loads torch.compile's machinery,
2.7 s of the 2.9 s a joiner's engine set-up took (``deepspeed/runtime/zero/utils.py``,
``is_zero_supported_optimizer``).

The memory the warm-up needed on top of the process as it stood (the rise of its peak resident set),
and as much as the engine's set-up allocates first (the ZeRO partitions of the fp32 master and the
moments, and DeepSpeed's flat copy of the working parameters: :func:`hold_engine_memory`), stay
allocated and touched until the switch (:func:`held_memory`): memory a process frees goes back
to its kernel, and on a host that reports free pages to its hypervisor (a virtio balloon with free
page reporting, as a Firecracker VM may have) back to the host about 2 s later;
touching it again then costs a fault on the host for every page. Measured on such a VM, 1.2 GB touched
again 8 s after it was freed took 0.95 s, within 1 s of the free 0.05 s. The joiner frees the held
memory as the survivors switch, so that its engine's set-up and first step reuse pages that are
still warm.

Rank 0 describes the inputs of its first forward (shapes and dtypes, never values) in the job's
store (:data:`~ds_dynatrain.elastic.keys.BATCH_KEY`); a joiner builds zeros of that description,
runs them through its model under a forked RNG (the training RNG streams stay as they are) and drops
the gradients again. Where the description is missing (rank 0 has not run a forward yet, or its
inputs are not tensors and plain values) the joiner joins cold, as before.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..elastic.keys import BATCH_KEY, GO_KEY, MODULES_KEY
from ..log import logger
from .construct import own_layout
from .pending import rss_peak_rise, start_peak_rss
from .switch_memory import memory_cap, world_change_bytes, world_change_partitions

_PLAIN = (bool, int, float, str, type(None))
POLL_S = 0.05


def describe_inputs(inputs: tuple, kwargs: dict) -> Optional[dict]:
    """The shape of one forward call's inputs: ``{"args": [...], "kwargs": {name: ...}}`` where a
    tensor is ``{"shape": [int, ...], "dtype": "torch.int64"}`` and a plain value (None, bool,
    int, float, str) is ``{"value": v}``. None when an input is anything else (a nested
    structure, an object): no synthetic batch can stand for it."""

    def one(x) -> Optional[dict]:
        if isinstance(x, torch.Tensor):
            return {"shape": list(x.shape), "dtype": str(x.dtype)}
        if isinstance(x, _PLAIN):
            return {"value": x}
        return None

    args = [one(x) for x in inputs]
    kw = {k: one(v) for k, v in kwargs.items()}
    if any(d is None for d in args) or any(d is None for d in kw.values()):
        return None
    return {"args": args, "kwargs": kw}


def synthetic_inputs(desc: dict, device: torch.device) -> Tuple[tuple, Dict[str, Any]]:
    """Zeros of the shapes and dtypes of :func:`describe_inputs`'s ``desc`` on ``device`` (token
    id 0 is a valid id for every vocabulary; a zero attention mask or label is as cheap as any)."""

    def make(d: dict):
        if "value" in d:
            return d["value"]
        dtype = getattr(torch, d["dtype"].removeprefix("torch."))
        return torch.zeros(d["shape"], dtype=dtype, device=device)

    return tuple(make(d) for d in desc["args"]), {k: make(d) for k, d in desc["kwargs"].items()}


def loss_of(out) -> Optional[torch.Tensor]:
    """The scalar a backward can start from in a model's output: the output itself, its ``loss``
    (Hugging Face), or its first floating tensor (summed); None if there is none."""
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.is_floating_point() and out.requires_grad else None
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss.float().sum()
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for x in items:
        found = loss_of(x)
        if found is not None:
            return found
    return None


def warm_up(model: torch.nn.Module, desc: dict) -> float:
    """Forward and backward of ``model`` on zeros shaped as ``desc``, then one AdamW step on a
    scratch tensor; the parameters' gradients are dropped again and no parameter changes.
    The RNG streams of the CPU and of the model's device are forked, so the training that follows
    draws what it would have drawn cold. Returns the seconds it took.

    Raises:
        whatever the model's forward raises on the synthetic batch (the caller joins cold).
    """
    t0 = time.perf_counter()
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    args, kwargs = synthetic_inputs(desc, device)
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            loss = loss_of(model(*args, **kwargs))
            if loss is not None:
                loss.backward()
    finally:
        for p in model.parameters():
            p.grad = None
    if param is not None:
        scratch = torch.zeros(1 << 16, dtype=torch.float32, device=device, requires_grad=True)
        scratch.grad = torch.ones_like(scratch)
        torch.optim.AdamW([scratch], lr=1e-3).step()
    return time.perf_counter() - t0


def publish_inputs(store, inputs: tuple, kwargs: dict) -> bool:
    """Rank 0, at its first forward: describe the inputs in the job's store for joiners (once
    per process; a later joiner reads the first description). Returns whether one was written."""
    desc = describe_inputs(inputs, kwargs)
    if desc is None:
        return False
    store.set(BATCH_KEY, json.dumps(desc))
    return True


def imported_modules() -> List[str]:
    """The names of the modules this process has imported (``sys.modules``), sorted, without the
    script's own (``__main__``, ``__mp_main__``). Read from one copy of the names (``list`` copies
    them under the GIL): another thread's import during an iteration would raise RuntimeError."""
    return sorted(n for n in list(sys.modules) if n not in ("__main__", "__mp_main__"))


def publish_modules(store) -> int:
    """Rank 0, after its first optimizer step: list its imported modules in the job's store for
    joiners (a JSON list of names). Returns how many."""
    names = imported_modules()
    store.set(MODULES_KEY, json.dumps(names))
    return len(names)


def preload_modules(names: Sequence[str]) -> Tuple[int, float]:
    """Import each module of ``names`` that this process has not imported yet and whose top-level
    package it has imported (the packages it uses itself: nothing of the script's own is
    imported twice, no package it never touched is started). A module that fails to import is
    skipped (its import would fail the same way later, where it is not this function's business);
    import warnings are not shown again (rank 0 showed them). Not cut short when the generation's
    go comes: what is not imported here is imported inside the engine's set-up after the switch.

    Returns:
        (modules imported, seconds).
    """
    t0 = time.perf_counter()
    imported = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if name in sys.modules or name.partition(".")[0] not in sys.modules:
                continue
            try:
                importlib.import_module(name)
                imported += 1
            except Exception:  # noqa: BLE001 - an optimisation: a module that cannot be imported here is left alone
                continue
    return imported, time.perf_counter() - t0


def held_memory(nbytes: int) -> Optional[torch.Tensor]:
    """``nbytes`` bytes allocated and written (every page touched), to be held until the memory is
    wanted and then freed (uint8, 1-D); None for 0 bytes."""
    if nbytes <= 0:
        return None
    held = torch.empty(nbytes, dtype=torch.uint8)
    held.fill_(0)
    return held


def held_partitions(nbytes: int, partitions: Sequence[int]) -> List[torch.Tensor]:
    """``nbytes`` bytes written ahead as one fp32 tensor (1-D) of each length in ``partitions``
    while they fit, in order, then the rest as one uint8 tensor (:func:`held_memory`)."""
    out: List[torch.Tensor] = []
    for numel in partitions:
        if numel * 4 > nbytes:
            break
        tensor = torch.empty(numel, dtype=torch.float32)
        tensor.fill_(0)  # every page written
        out.append(tensor)
        nbytes -= numel * 4
    rest = held_memory(nbytes)
    return out + ([rest] if rest is not None else [])


def engine_bytes(layout, world_size: int) -> int:
    """Bytes a joiner's engine set-up allocates first at ``world_size`` ranks, its model described
    by ZeRO ``layout``: its partitions of the fp32 master and two moments
    (:func:`~ds_dynatrain.engine.switch_memory.world_change_bytes`, an Adam-like optimizer's) and,
    at ZeRO-1/2, the flat copy of the working parameters DeepSpeed builds (``stage_1_and_2.py``,
    ``bit16_groups_flat``). An estimate."""
    nbytes = world_change_bytes(layout, world_size, 3)
    if layout.stage != 3:
        nbytes += sum(p.numel * p.element_size for g in layout.groups for p in g)
    return nbytes


def hold_engine_memory(dt, model: torch.nn.Module, groups: List[list], world_size: int, generation: int) -> int:
    """A DP joiner of ``generation`` before it forms: touch and hold, in ``dt.held`` (freed with
    the warm-up's at the switch), the memory its engine's set-up will allocate first
    (:func:`engine_bytes` of its layout at ``world_size``, at most
    :func:`~ds_dynatrain.engine.switch_memory.memory_cap`): its new partitions as fp32 tensors
    (:func:`held_partitions`; those the moments arrive in are used as they are), the rest as one
    piece. Returns the bytes held; 0 where
    ``dynatrain.warm_switch_steps`` is 0, the parameters are on an accelerator (the new memory is
    device memory), the generation's go has come (the survivors are switching: touching now would
    make them wait), or the layout cannot be described (logged, never raised: the engine's set-up
    says why, if it fails). ``groups``: the parameter groups the optimizer will hold."""
    param = next(model.parameters(), None)
    if dt.config.warm_switch_steps <= 0 or param is None or param.device.type != "cpu":
        return 0
    if dt.membership.store.check([GO_KEY.format(generation)]):
        logger.info("joiner holds no memory for its engine: its generation is forming")
        return 0
    t0 = time.perf_counter()
    try:
        layout = own_layout(dt, model, groups, world_size)
        nbytes = min(engine_bytes(layout, world_size), memory_cap())
        partitions = world_change_partitions(layout, world_size, 3)
    except Exception as err:  # noqa: BLE001 - an optimisation: the joiner joins with less held
        logger.info(f"joiner holds no memory for its engine: {type(err).__name__}: {err}")
        return 0
    if nbytes <= 0:
        return 0
    dt.held.extend(held_partitions(nbytes, partitions))
    logger.info(
        f"joiner holds {nbytes / 2**20:.0f} MiB touched for its engine's partitions until the switch "
        f"({time.perf_counter() - t0:.2f} s)"
    )
    return nbytes


def warm_joiner(store, model: torch.nn.Module, generation: int, timeout_s: float, hold: Optional[list] = None):
    """A joiner of ``generation``, before its rendezvous: wait until rank 0 has described its
    inputs or the generation is about to form (its go key), whichever comes first, at most
    ``timeout_s`` seconds; in the first case import rank 0's modules (:func:`preload_modules`,
    where it has listed them) and warm up. Returns the seconds of both, or None where
    it joined cold (no description before the go or the limit, or the model failed on the
    synthetic batch: logged, never raised; the caller's wait for the go then decides).

    ``hold``: a list that gets the memory the warm-up needed on top of the process as it stood
    (:func:`held_memory`, the rise of its peak resident set, bytes), for the caller to free when
    the survivors switch; nothing where it cannot be measured (no ``/proc/self/clear_refs``)."""
    go = GO_KEY.format(generation)
    deadline = time.monotonic() + timeout_s
    while not store.check([BATCH_KEY]):
        if store.check([go]) or time.monotonic() > deadline:
            return None
        time.sleep(POLL_S)
    desc = json.loads(store.get(BATCH_KEY))
    preload_s = 0.0
    if store.check([MODULES_KEY]):
        count, preload_s = preload_modules(json.loads(store.get(MODULES_KEY)))
        logger.info(f"joiner imported {count} module(s) that rank 0 uses in {preload_s:.2f} s")
    base = start_peak_rss() if hold is not None else None
    try:
        seconds = warm_up(model, desc)
    except Exception as err:  # the warm-up is an optimisation: a model it cannot feed joins cold
        logger.info(f"joiner warm-up skipped: the model failed on a synthetic batch ({type(err).__name__}: {err})")
        return None
    rise = rss_peak_rise(base)
    held = held_memory(rise)
    if held is not None:
        hold.append(held)
    logger.info(
        f"joiner warmed up in {seconds:.2f} s (forward, backward and an optimizer step on a synthetic batch)"
        + (f"; {rise / 2**20:.0f} MiB held touched until the switch" if held is not None else "")
    )
    return preload_s + seconds
