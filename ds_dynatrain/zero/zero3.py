"""ZeRO-3 around a rebuild: gather the partitioned working parameters whole, and turn them back into
plain parameters (DeepSpeed's attributes and process-wide counters reset) so a new engine
partitions them afresh for the new world.

DeepSpeed internals: ``GatheredParameters`` and ``Init`` (deepspeed/runtime/zero/
partition_parameters.py), ``DeepSpeedZeRoOffload`` and ``FWD_MODULE_STACK``
(deepspeed/runtime/zero/parameter_offload.py), deepspeed 0.19.8.
"""

from __future__ import annotations

from typing import Dict

import torch

from ..errors import LayoutMismatchError


def gather_whole_params(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter of a ZeRO-3 module, gathered whole (``name -> full tensor``, a copy in the
    working dtype). Collective over the parameters' data-parallel group: every rank of the
    engine calls it. One parameter at a time, so the transient memory is one parameter beyond
    the copies.
    """
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    out = {}
    for name, p in module.named_parameters():
        with GatheredParameters([p]):
            out[name] = p.data.detach().clone()
    return out


# attributes DeepSpeed's ZeRO-3 attaches to modules besides those named ``ds_*``
# (deepspeed/runtime/zero/parameter_offload.py, partition_parameters.py, deepspeed 0.19.8)
ZERO3_MODULE_ATTRS = frozenset(
    {
        "_external_params",
        "_original_parameters",
        "all_parameters",
        "applied_pre_backward_ref_cnt",
        "pre_bwd_fn",
        "post_bwd_fn",
        "to_empty",
    }
)


def client_attrs(module: torch.nn.Module) -> Dict[str, frozenset]:
    """The attribute names of every parameter (``"param:<name>"``) and submodule
    (``"module:<name>"``) of a model no engine has touched yet: what
    :func:`release_zero3_params` keeps."""
    out = {f"param:{n}": frozenset(vars(p)) for n, p in module.named_parameters()}
    out.update({f"module:{n}": frozenset(vars(m)) for n, m in module.named_modules()})
    return out


def release_zero3_params(
    module: torch.nn.Module, whole: Dict[str, torch.Tensor], own_attrs: Dict[str, frozenset]
) -> None:
    """Turn the ZeRO-3 parameters of a detached engine back into plain parameters holding
    ``whole`` (from :func:`gather_whole_params`), so a new engine partitions them afresh.

    DeepSpeed's ZeRO-3 set-up skips parameters and modules that carry its attributes (it treats
    them as converted already; a module keeps backward hooks bound to the old engine), so:

    * every attribute DeepSpeed attached to a parameter (``ds_tensor``, ``ds_id``,
      ``all_gather``, ...) is removed, keeping those in ``own_attrs`` (:func:`client_attrs`);
    * every ``ds_*`` attribute and those of :data:`ZERO3_MODULE_ATTRS` are removed from the
      submodules (again keeping the client's own), and each module's parameter dict is a plain
      dict again (ZeRO-3 replaces it with one that gathers on access).

    The Parameter objects stay the same, so tied parameters stay tied and references held by
    the caller stay valid.

    Raises:
        LayoutMismatchError: ``whole`` lacks a parameter of the module.
    """
    for name, p in module.named_parameters():
        if name not in whole:
            raise LayoutMismatchError(f"no whole copy of parameter {name} to rebuild the ZeRO-3 engine from")
        keep = own_attrs.get(f"param:{name}", frozenset())
        for attr in list(vars(p)):
            if attr not in keep:
                delattr(p, attr)
        p.data = whole[name]
    for name, m in module.named_modules():
        keep = own_attrs.get(f"module:{name}", frozenset())
        for attr in list(vars(m)):
            if attr not in keep and (attr.startswith("ds_") or attr in ZERO3_MODULE_ATTRS):
                delattr(m, attr)
        if type(m._parameters) is not dict:
            m._parameters = dict(m._parameters.items())
    forget_zero3_module(module)


def forget_zero3_module(module: torch.nn.Module) -> None:
    """Drop what DeepSpeed's ZeRO-3 keeps process-wide of a detached engine's module (its place on
    the forward module stack, :func:`clear_release_cache`) and start its counters from 0 again,
    before another engine is built."""
    from deepspeed.runtime.zero import parameter_offload

    stack = parameter_offload.FWD_MODULE_STACK  # the engine pushed its module at set-up
    while stack and stack[-1] is module:
        stack.pop()
    clear_release_cache()
    reset_zero3_counters()


def clear_release_cache() -> None:
    """Empty the process-wide cache of DeepSpeed's ``PartitionedParameterCoordinator.
    __params_to_release`` (``functools.lru_cache`` without a bound on a method, DeepSpeed's
    ``partitioned_param_coordinator.py``): its keys hold every coordinator and submodule that ever
    ran a traced step, so a detached engine's model, its parameters and its process groups would
    live as long as the process. Entries of an engine still in use are computed again on its next
    step."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    fn = getattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    # DeepSpeed wraps the cached function in ``instrument_w_nvtx`` (no functools.wraps): in its closure
    candidates = [fn]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            candidates.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    for cached in candidates:
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def reset_zero3_counters() -> None:
    """Start DeepSpeed's ZeRO-3 process-wide counters from 0 again, as in a fresh process.

    Module ids come from a counter kept in a default argument of
    ``DeepSpeedZeRoOffload._register_deepspeed_module``, parameter ids from ``Init.param_id``, and
    the persistent-parameter budget from ``Init.num_persisted_*``; all run on across engines in
    one process. Every rank checks that all ranks trace the same module and parameter ids, and a
    process joining the job starts from 0, so a rebuilt engine must too.
    """
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import Init

    parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 0
    Init.param_id = 0
    Init.num_persisted_parameters = 0
    Init.num_persisted_elements = 0
