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
