"""Which accelerator device a worker trains on.

DeepSpeed binds a worker to device ``LOCAL_RANK`` (``DeepSpeedEngine._set_distributed_vars``,
``deepspeed/runtime/engine.py``), which fails with "invalid device ordinal" on a host that runs
more workers than it has devices: several workers sharing one GPU over gloo
(``dynatrain.dist_backend: "gloo"``; NCCL refuses two ranks on one device), or joiners placed on a
host past its slots (``--allow-oversubscribe``). Here a worker's device is ``LOCAL_RANK`` modulo
the host's device count, which is ``LOCAL_RANK`` itself on a host with a device per worker.

The device is made current as soon as the worker's place is known, before any state is
allocated: a joiner allocates its new partitions before its engine is built
(:func:`~ds_dynatrain.engine.transfer.begin_transition`), on the current device. DeepSpeed is
handed the same index through its own hook, ``args.device_rank``.
"""

from __future__ import annotations

import argparse
from typing import Optional


def device_index(local_rank: int, device_count: int) -> int:
    """The device a worker with ``local_rank`` uses on a host with ``device_count`` devices:
    ``local_rank mod device_count``.

    Raises:
        ValueError: a negative ``local_rank`` or a ``device_count`` below 1 (names the value).
    """
    if local_rank < 0:
        raise ValueError(f"local rank {local_rank}: must be >= 0")
    if device_count < 1:
        raise ValueError(f"device count {device_count}: a host with an accelerator has at least one device")
    return local_rank % device_count


def bind_device(accelerator, local_rank: int) -> Optional[int]:
    """Make :func:`device_index` the current device of ``accelerator`` (DeepSpeed's accelerator
    object) and return it; None on the CPU accelerator (nothing to bind)."""
    if accelerator.device_name() == "cpu":
        return None
    index = device_index(local_rank, accelerator.device_count())
    accelerator.set_device(index)
    return index


def engine_args(index: Optional[int]) -> Optional[argparse.Namespace]:
    """The ``args`` ``DeepSpeedEngine.__init__`` is given: ``device_rank`` = ``index`` when a device
    is bound, else None (DeepSpeed's own choice, the CPU)."""
    return None if index is None else argparse.Namespace(device_rank=index)
