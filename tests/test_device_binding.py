"""Which device a worker binds (``ds_dynatrain.engine.device``) and the ``LOCAL_RANK`` it is read
from (``ds_dynatrain.elastic.launch_env.local_rank``).

Oracle: the rule written out by hand (``LOCAL_RANK`` modulo the host's device count) for hosts
with a device per worker and with fewer devices than workers; DeepSpeed's CPU accelerator (the
real one) for the CPU case, where nothing is bound and DeepSpeed keeps its own choice.
"""

from __future__ import annotations

import pytest

from ds_dynatrain.elastic.launch_env import local_rank
from ds_dynatrain.engine.device import bind_device, device_index, engine_args

# (local rank, devices on the host, the device the worker uses)
CASES = [
    (0, 1, 0),
    (1, 1, 0),  # two workers sharing one GPU over gloo
    (2, 1, 0),
    (3, 8, 3),  # a device per worker: LOCAL_RANK itself
    (7, 8, 7),
    (9, 8, 1),  # a joiner past the host's eight slots (--allow-oversubscribe)
    (5, 2, 1),
]


@pytest.mark.parametrize("rank, count, expected", CASES, ids=[f"{r}of{c}" for r, c, _ in CASES])
def test_device_index(rank, count, expected):
    assert device_index(rank, count) == expected


@pytest.mark.parametrize("rank, count, message", [(-1, 1, "local rank -1"), (0, 0, "device count 0")])
def test_device_index_refuses(rank, count, message):
    with pytest.raises(ValueError, match=message):
        device_index(rank, count)


def test_cpu_accelerator_binds_nothing():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert bind_device(CPU_Accelerator(), 3) is None
    assert engine_args(None) is None
    assert engine_args(2).device_rank == 2


@pytest.mark.parametrize("env, expected", [({}, 0), ({"LOCAL_RANK": "3"}, 3)])
def test_local_rank(env, expected):
    assert local_rank(env) == expected


@pytest.mark.parametrize("value", ["-1", "one", ""])
def test_local_rank_refuses(value):
    with pytest.raises(ValueError, match=f"LOCAL_RANK={value!r}"):
        local_rank({"LOCAL_RANK": value})
