"""Rebuilding a DeepSpeed engine in place: detach the old one from the model and give the torch
optimizer back its parameters, then build the new one with less work than a fresh set-up.

DeepSpeed internals: ``DeepSpeedZeroOptimizer.initialize_optimizer_states`` and
``flatten_dense_tensors_aligned`` (deepspeed/runtime/zero/stage_1_and_2.py), the engine's module
hooks and ``destroy()`` (deepspeed/runtime/engine.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Sequence

import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from .geometry import is_zero3, zero_optimizer_of


@contextmanager
def light_rebuild(reuse_flat: Sequence[torch.Tensor] = (), values_follow: bool = False):
    """While building a ZeRO-1/2 optimizer whose state is installed right after (a resize):

    * skip ``DeepSpeedZeroOptimizer.initialize_optimizer_states``: without offload and for
      optimizers that create their state lazily (everything but Adagrad), it only allocates a
      zero gradient partition and drops it again (deepspeed/runtime/zero/stage_1_and_2.py),
      which costs a full partition's page faults on the resize's critical path;
    * flatten the parameter groups in place when they already lie in one of ``reuse_flat`` (the
      old engine's flat buffers), long enough and in the order and padding DeepSpeed asks for
      (:func:`flat_in_place`; after a shrink). Parameters anywhere else are copied as DeepSpeed
      does: a client's own memory is never taken over;
    * ``values_follow``: the working parameters are all written from the installed master right
      after (a TP switch's freshly cut model, whose values mean nothing yet), so each flat buffer
      is allocated with its padding zeroed (:func:`flat_unfilled`) instead of copied from them: a
      copy of every parameter (0.35-0.47 s at 100 M fp32 parameters on one rank, measured) off
      the switch's critical path.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    init_states = DeepSpeedZeroOptimizer.initialize_optimizer_states
    flatten = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned
    owned = {t.untyped_storage().data_ptr() for t in reuse_flat}

    def initialize_optimizer_states(self):
        if self.cpu_offload or isinstance(self.optimizer, torch.optim.Adagrad):
            return init_states(self)

    def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False, param_padding=None):
        if values_follow and not use_cpu_data and tensor_list:
            return flat_unfilled(tensor_list, alignment, param_padding)
        reused = None
        if not use_cpu_data and tensor_list and tensor_list[0].untyped_storage().data_ptr() in owned:
            reused = flat_in_place(tensor_list, alignment, param_padding)
        return reused if reused is not None else flatten(self, tensor_list, alignment, use_cpu_data, param_padding)

    DeepSpeedZeroOptimizer.initialize_optimizer_states = initialize_optimizer_states
    DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned = flatten_dense_tensors_aligned
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer.initialize_optimizer_states = init_states
        DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned = flatten


def flat_unfilled(tensors: List[torch.Tensor], alignment: int, padding=None) -> torch.Tensor:
    """A buffer of the size, dtype and device of the one DeepSpeed's ``flatten_dense_tensors_aligned``
    builds from ``tensors`` (each followed by ``padding[i]`` elements, the total padded to a
    multiple of ``alignment``), its padding zeroed and the parameters' places left unwritten."""
    first = tensors[0]
    sizes = [t.numel() + (padding[i] if padding else 0) for i, t in enumerate(tensors)]
    total = -(-sum(sizes) // alignment) * alignment
    flat = torch.empty(total, dtype=first.dtype, device=first.device)
    _zero_padding(flat, tensors, padding)
    return flat


def _zero_padding(flat: torch.Tensor, tensors: List[torch.Tensor], padding) -> None:
    """Zero the per-parameter padding and the tail of ``flat`` (laid out as
    :func:`flat_unfilled` says)."""
    with torch.no_grad():
        pos = 0
        for i, t in enumerate(tensors):
            pos += t.numel()
            pad = padding[i] if padding else 0
            if pad:
                flat[pos : pos + pad].zero_()
            pos += pad
        flat[pos:].zero_()


def flat_in_place(tensors: List[torch.Tensor], alignment: int, padding=None):
    """The flat buffer DeepSpeed's ``flatten_dense_tensors_aligned`` would build from ``tensors``
    (each followed by ``padding[i]`` zeros, the total padded to a multiple of ``alignment``), as
    a view of the storage they already live in, or None.

    After a shrink the parameters still sit in the old engine's flat buffer, in the same order
    and with the same per-parameter padding; only the tail padding depends on the world size.
    When the old buffer is long enough, the new one is a view of it (the tail zeroed) instead of
    a copy of every parameter.
    """
    if not tensors:
        return None
    first = tensors[0]
    storage, el = first.untyped_storage(), first.element_size()
    base = first.storage_offset()
    pos = 0
    for i, t in enumerate(tensors):
        if (
            t.dtype != first.dtype
            or t.device != first.device
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage.data_ptr()
            or t.storage_offset() != base + pos
        ):
            return None
        pos += t.numel() + (padding[i] if padding else 0)
    total = -(-pos // alignment) * alignment
    if (base + total) * el > storage.nbytes():
        return None
    flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, base, (total,))
    _zero_padding(flat, tensors, padding)  # zeros, as DeepSpeed's copy would have them
    return flat.detach()


def detach_engine(engine) -> None:
    """Remove everything a built engine hooked into the model, so it can be rebuilt in place.

    Raises:
        DynatrainError: hooks remain on the model after the engine's own teardown (a DeepSpeed
            feature we do not know how to detach), rather than train with two engines hooked in.
    """
    for attr in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
        h = getattr(engine, attr, None)
        if h is not None:
            h.remove()
            setattr(engine, attr, None)
    DeepSpeedEngine.destroy(engine)  # DeepSpeed's own (an engine may keep itself from a front-end's destroy)


def count_module_hooks(module: torch.nn.Module) -> int:
    """Forward/backward hooks registered on ``module`` and its children (to prove a detach)."""
    n = 0
    for m in module.modules():
        n += len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
        n += len(getattr(m, "_backward_pre_hooks", {}))
    return n


def teardown(engine) -> None:
    """Detach a built engine from the model and give the torch optimizer back its parameters (per
    optimizer group, in group order); the optimizer's state is dropped (a resize moved it)."""
    zopt = zero_optimizer_of(engine)
    basic = zopt.optimizer
    if is_zero3(zopt):
        by_group: Dict[int, list] = {}
        for i, sub in enumerate(zopt.fp16_groups):
            by_group.setdefault(zopt.sub_group_to_group_id[i], []).extend(sub)
        for i, g in enumerate(basic.param_groups):
            g["params"] = by_group.get(i, [])
    else:
        for i, g in enumerate(basic.param_groups):
            g["params"] = list(zopt.bit16_groups[i])
    basic.state.clear()
    detach_engine(engine)
