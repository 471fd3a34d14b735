"""A Hugging Face model rebuilt at another AutoTP degree without materialising it whole: DeepSpeed's
process-group globals reset for the new degree, the model re-instantiated from its config on the
meta device, cut there by DeepSpeed's own AutoTP partitioning, and only the local shards allocated.

DeepSpeed internals (deepspeed 0.19.8): ``deepspeed.utils.groups`` (``_release_process_group_references``,
``_init_tp_mesh_device``), ``module_inject.layers.set_autotp_mode``, and
``DeepSpeedEngine._apply_autotp_partitioning`` (``runtime/engine.py``), called on the meta
skeleton through a stand-in for the engine (what it reads: the TP degree, the local rank and the
DeepCompile switches). (The
method was first measured as an in-process TP 1 -> 2 switch of a small Llama on two CPU processes.)

Hazards handled: ``Module.to_empty`` makes new ``Parameter`` objects, which drops
DeepSpeed's per-parameter attributes and gradient hooks (put back: AutoTP marks its hooks as
registered, so it would not make them again) and splits parameters shared by two modules (a
tied embedding and head: tied again); non-persistent buffers come out as garbage (copied from the
old model, by name: buffers are whole on every TP rank).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Tuple

import torch

from ..errors import LayoutMismatchError


def reset_tp_groups(tp: int, same_world: bool = False) -> None:
    """Forget DeepSpeed's cached groups (TP, DP, model, world) and set its AutoTP mode and TP mesh
    for degree ``tp`` (collective over the world when ``tp > 1``: the mesh's groups are made).

    ``same_world``: the processes are those the cached groups were made over (a TP switch at an
    unchanged world), so DeepSpeed's clone of the world group, the DP group at TP 1, is kept
    (making a gloo group costs 0.1 s on a 2-core machine).
    """
    from deepspeed.module_inject.layers import set_autotp_mode
    from deepspeed.utils import groups

    world_clone = groups._WORLD_GROUP if same_world else None
    groups._release_process_group_references()
    groups._WORLD_GROUP = world_clone
    set_autotp_mode(training=tp > 1)
    if tp > 1:
        groups._init_tp_mesh_device(tensor_model_parallel_size=tp)


def _shared_parameters(model: torch.nn.Module) -> List[List[Tuple[torch.nn.Module, str]]]:
    """Every parameter held by more than one ``(module, attribute)``: the holders, grouped."""
    holders: Dict[int, List[Tuple[torch.nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((mod, name))
    return [h for h in holders.values() if len(h) > 1]


def tp_module(old: torch.nn.Module, tp: int, ds_config: dict) -> torch.nn.Module:
    """A new instance of ``old``'s class and config, cut by AutoTP at degree ``tp`` (whole at 1),
    its local shards allocated on the CPU (left unwritten), its frozen parameters (which AutoTP
    does not cut: :func:`~ds_dynatrain.engine.tp_switch.new_layout` refuses the others) and
    buffers copied from ``old``.

    Call after :func:`reset_tp_groups` for ``tp``. The parameters' values are to be installed
    (the optimizer's master partitions, then the working parameters made from them).

    Raises:
        LayoutMismatchError: ``old`` is no Hugging Face model (no ``config``), a buffer of the new
            model is missing from ``old`` or has another shape there, or
            a frozen parameter has another shape there.
    """
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config

    config = getattr(old, "config", None)
    if config is None:
        raise LayoutMismatchError(f"{type(old).__name__} has no config: a TP switch rebuilds Hugging Face models")
    with torch.device("meta"):
        model = type(old)(config)
    if tp > 1:
        tp_config = get_tensor_parallel_config(ds_config)
        stand_in = SimpleNamespace(
            autotp_size=lambda: tp, local_rank=-1, is_deepcompile_enabled=lambda: False, compile_autotp=lambda: False
        )
        DeepSpeedEngine._apply_autotp_partitioning(stand_in, model, tp_config)
    shared = _shared_parameters(model)
    attrs = {n: dict(vars(p)) for n, p in model.named_parameters()}
    # gradient hooks AutoTP put on the meta parameters (the TP all-reduce of replicated
    # parameters marked grad_allreduce, e.g. Qwen3's q_norm/k_norm): made again on the new ones
    hooks = {n: list((p._backward_hooks or {}).values()) for n, p in model.named_parameters()}
    model.to_empty(device="cpu")
    for group in shared:  # to_empty gave each holder its own copy
        first_mod, first_name = group[0]
        for mod, name in group[1:]:
            setattr(mod, name, getattr(first_mod, first_name))
    with torch.no_grad():
        for n, p in model.named_parameters():
            for k, v in attrs[n].items():
                setattr(p, k, v)
            for hook in hooks[n]:
                p.register_hook(hook)
        old_params = dict(old.named_parameters())
        for n, p in model.named_parameters():
            src = old_params.get(n)
            if src is not None and not src.requires_grad:  # frozen: no master to come from, and whole
                if src.shape != p.shape:
                    raise LayoutMismatchError(f"frozen parameter {n}: {tuple(src.shape)} before, {tuple(p.shape)} now")
                p.requires_grad_(False)
                p.copy_(src)
        old_buffers = dict(old.named_buffers())
        for n, b in model.named_buffers():
            src = old_buffers.get(n)
            if src is None or src.shape != b.shape:
                raise LayoutMismatchError(f"buffer {n}: not in the old model, or of another shape")
            b.copy_(src)
    model.train(old.training)
    return model
