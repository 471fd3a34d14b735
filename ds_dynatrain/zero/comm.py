"""DeepSpeed's communication state across generations: what caches the old process group is reset,
and ``deepspeed.comm`` is started again on the new default group.

DeepSpeed caches its backend (``deepspeed.comm.comm.cdb``) and groups (``deepspeed.utils.groups``)
in module globals; after the default process group changes for a new generation these must be
reset, or the next engine would use the dead group.
"""

from __future__ import annotations


def reset_deepspeed_comm() -> None:
    """Forget DeepSpeed's cached comm backend and process groups.

    DeepSpeed caches its backend (``deepspeed.comm.comm.cdb``) and groups
    (``deepspeed.utils.groups``) in module globals; after the default process group is destroyed
    and re-formed for a new generation these must be reset, or the next engine would use the dead
    group.
    """
    import deepspeed.comm.comm as dcomm
    import deepspeed.utils.groups as groups

    dcomm.cdb = None
    groups._WORLD_GROUP = None
    groups._DATA_PARALLEL_GROUP = None
    groups._MODEL_PARALLEL_GROUP = None
    groups._TENSOR_MODEL_PARALLEL_GROUP = None
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    groups._EXPERT_PARALLEL_GROUP = {}
    groups._EXPERT_PARALLEL_GROUP_RANKS = {}
    groups._EXPERT_DATA_PARALLEL_GROUP = {}
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS = {}
    groups._ALL_TO_ALL_GROUP = {}
    groups.mesh_device = None
    groups.mpu = None


def start_deepspeed_comm(backend: str) -> None:
    """Start ``deepspeed.comm`` on the current default process group (after a switch of it)."""
    import deepspeed.comm as dcomm

    dcomm.init_distributed(dist_backend=backend, dist_init_required=False)


def skip_cpu_shm_op(accelerator) -> None:
    """Tell DeepSpeed its CPU shared-memory all-reduce op is unavailable, so it is not built.

    ``deepspeed.comm`` JIT-compiles that op (``deepspeed_shm_comm``) whenever it starts on the CPU
    accelerator, though only ``inference_all_reduce`` uses it. The build takes about 30 s on a
    fresh machine, and a worker killed during it leaves a lock file in the torch extensions
    directory that makes every later job wait forever. Training never calls it; marking it
    incompatible (DeepSpeed's own switch, ``deepspeed.ops.__compatible_ops__``) skips the build.
    """
    if accelerator.device_name() != "cpu":
        return
    import deepspeed.ops as ops

    ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _skip_in_launched_workers() -> None:
    """In a process ``dynatrain launch`` started, :func:`skip_cpu_shm_op` as soon as this module is
    imported (``import ds_dynatrain``): a script may start DeepSpeed's comm itself
    (``deepspeed.init_distributed()``) before ``ds_dynatrain.initialize``, and that start would
    otherwise build the op in every worker, joiners included."""
    from ..elastic.launch_env import launched

    if launched():
        from deepspeed.accelerator import get_accelerator

        skip_cpu_shm_op(get_accelerator())


_skip_in_launched_workers()


def _holds_group(value) -> bool:
    import torch.distributed as tdist

    if isinstance(value, tdist.ProcessGroup):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(isinstance(v, tdist.ProcessGroup) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, tdist.ProcessGroup) for v in value.values())
    return False


def _zero3_init_contexts(params) -> list:
    """The ``deepspeed.zero.Init`` objects ZeRO-3 parameters' methods close over (DeepSpeed's
    ``partition_parameters.py`` binds ``all_gather``, ``partition``, ... per parameter as closures
    of the ``Init`` that converted it; it holds ``ds_process_group``), each once."""
    found = {}
    for p in params:
        fn = getattr(p, "all_gather", None)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if hasattr(value, "ds_process_group"):
                found[id(value)] = value
    return list(found.values())


def release_default_arguments() -> int:
    """``torch.distributed.nn.functional`` defines ``group=group.WORLD`` defaults: imported once a
    default group exists (DeepSpeed imports it while it builds the engine), every such function
    keeps that group alive for good. Put None (the current default group) in their place."""
    import sys

    import torch.distributed as tdist

    module = sys.modules.get("torch.distributed.nn.functional")
    gone = 0
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if callable(fn) and defaults and any(isinstance(d, tdist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, tdist.ProcessGroup) else d for d in defaults)
            gone += 1
    return gone


def release_process_groups(engine) -> int:
    """Drop every reference a DeepSpeed engine keeps to a ``torch.distributed`` process group (in
    the engine, its optimizers, ZeRO-3's parameter offload and ``zero.Init``, a pipeline's grid,
    the model's modules and parameters, DeepSpeed's module globals and the default arguments of
    ``torch.distributed.nn.functional``), so that the groups are destroyed once
    ``torch.distributed`` lets them go, their gloo threads joined. Call it when the engine will
    run no collective any more (at exit). Returns how many references went.

    Why: ``shutdown()`` of a gloo group does not stop its threads; only its destruction does.
    DeepSpeed's own data-parallel subgroup (``new_group``) is held by the engine, the ZeRO
    optimizer and every parameter, in reference cycles that live until the interpreter tears
    down. A gloo worker thread that then frees a finished collective needs the GIL to release
    its tensors; during interpreter finalization Python ends such a thread with
    ``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls ``std::terminate``:
    "terminate called without an active exception", status -6, after training finished.
    """
    objects = [engine, getattr(engine, "optimizer", None)]
    objects.append(getattr(objects[-1], "optimizer", None))
    objects.append(getattr(objects[1], "parameter_offload", None))  # ZeRO-3's DeepSpeedZeRoOffload
    objects += [getattr(engine, "mpu", None), getattr(engine, "grid", None)]  # a pipeline's grid
    module = getattr(engine, "module", None)
    if module is not None:
        objects.extend(module.modules())  # a PipelineModule's world group, AutoTP layers' mp_group
        params = list(module.parameters())
        objects.extend(params)
        objects.extend(_zero3_init_contexts(params))
    from .zero3 import clear_release_cache

    gone = release_default_arguments()
    clear_release_cache()  # it holds ZeRO-3 engines' modules (and their groups) the process let go
    for obj in objects:
        attrs = getattr(obj, "__dict__", None)
        if not attrs:
            continue
        for name in [k for k, v in attrs.items() if _holds_group(v)]:
            attrs[name] = None
            gone += 1
    reset_deepspeed_comm()
    return gone
