"""State providers and the allow-listed serialization: round trips, refusals at save time, and
loading that refuses anything outside the allow-list (never runs code)."""

from __future__ import annotations

import json
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

from state_providers import (
    CompositeProvider,
    DictStateProvider,
    ObjectItem,
    RNGStateProvider,
    TensorItem,
    UnrepresentableError,
)
from state_providers.serialize import DecodeError, dumps, equal, loads


def _as_read_back(items):
    return {i.key: (i.payload if isinstance(i, ObjectItem) else i.tensor.clone()) for i in items}


def deepspeed_like_state():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    fp32 = torch.randn(11)
    return {
        "module": OrderedDict([("w", torch.randn(3, 5)), ("b", torch.zeros(5, dtype=torch.bfloat16))]),
        "optimizer": {
            "loss_scaler": DynamicLossScaler(2.0**16, 1000, 1.0, False, True),
            "zero_stage": ZeroStageEnum.gradients,
            "base_optimizer_state": {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(11)}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}],
            },
            "single_partition_of_fp32_groups": [fp32],
            "partition_count": [2],
        },
        "param_shapes": [OrderedDict([("w", torch.Size([3, 5]))])],
        "lr_scheduler": {"last_batch_iteration": 7, "warmup": float("inf"), "bad": float("nan")},
        "global_steps": 7,
        "ds_version": "0.19.8",
        "dtype": torch.bfloat16,
        "rng": random.getstate(),
        "np_rng": np.random.get_state(),
        "odd": np.arange(7, dtype=np.float16),
        "flag": np.bool_(True),
        "sparse_tensor_module_names": {"embed.weight", "head.weight"},  # DeepSpeed 0.19.7 saves this set
        "frozen": frozenset({3, ("a", 1)}),
        "empty": set(),
    }


def test_dict_state_round_trips_exactly():
    st = deepspeed_like_state()
    items = list(DictStateProvider(st).items())
    assert [i.key for i in items][0] == "__skeleton__"
    tensors = [i for i in items if isinstance(i, TensorItem)]
    assert len(tensors) == 5
    assert {t.attrs["path"] for t in tensors} == {
        "module/w",
        "module/b",
        "optimizer/base_optimizer_state/state/0/step",
        "optimizer/base_optimizer_state/state/0/exp_avg",
        "optimizer/single_partition_of_fp32_groups/0",
    }
    back = DictStateProvider.rebuild(_as_read_back(items))
    assert equal(st, back)
    assert back["optimizer"]["loss_scaler"].cur_scale == 2.0**16
    assert back["optimizer"]["base_optimizer_state"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert 0 in back["optimizer"]["base_optimizer_state"]["state"]
    assert back["sparse_tensor_module_names"] == {"embed.weight", "head.weight"}
    assert type(back["frozen"]) is frozenset and back["frozen"] == frozenset({3, ("a", 1)})
    assert back["empty"] == set() and type(back["empty"]) is set


def test_a_set_is_written_the_same_whatever_its_iteration_order():
    a, b = {"x", "y", "z", "w"}, set()
    for v in ("w", "z", "y", "x"):
        b.add(v)
    assert dumps(a)[0] == dumps(b)[0] == b'{"__set__":["w","x","y","z"]}'


def test_tensor_items_are_zero_copy_views():
    t = torch.arange(10, dtype=torch.float32)
    item = next(i for i in DictStateProvider({"t": t}).items() if isinstance(i, TensorItem))
    assert item.tensor.data_ptr() == t.data_ptr()
    assert item.byte_view().data_ptr() == t.data_ptr() and item.nbytes == 40
    assert item.dtype == "float32" and item.shape == (10,)


def test_unrepresentable_object_is_refused_at_save_naming_its_key():
    class Custom:
        pass

    with pytest.raises(UnrepresentableError, match=r"optimizer/hook: object of type .*Custom"):
        DictStateProvider({"optimizer": {"hook": Custom()}})
    with pytest.raises(UnrepresentableError, match="x/f"):
        DictStateProvider({"x": {"f": lambda: 0}})


@pytest.mark.parametrize(
    "payload, what",
    [
        ({"__object__": ["os:system", {}]}, "not on the allow-list"),
        ({"__enum__": ["subprocess:Popen", 1]}, "not on the allow-list"),
        ({"__frobnicate__": 1}, "unknown tag"),
        ({"__dtype__": "not_a_dtype"}, "unknown dtype"),
    ],
)
def test_loading_refuses_classes_and_tags_outside_the_allow_list(payload, what):
    with pytest.raises(DecodeError, match=what):
        loads(json.dumps(payload).encode(), lambda i: None)


def test_loading_refuses_non_json():
    with pytest.raises(DecodeError, match="not valid JSON"):
        loads(b"\x80\x04\x95 pickle bytes", lambda i: None)


def test_composite_prefixes_and_restores_children():
    a, b = DictStateProvider({"x": torch.ones(2)}), DictStateProvider({"y": 3})
    comp = CompositeProvider([("engine", a), ("client", b)])
    items = list(comp.items())
    assert [i.key for i in items] == ["engine/__skeleton__", "engine/t/0", "client/__skeleton__"]
    back = comp.restore(_as_read_back(items))
    assert equal(back, {"engine": {"x": torch.ones(2)}, "client": {"y": 3}})
    with pytest.raises(ValueError, match="duplicate"):
        CompositeProvider([("a", a), ("a", b)])


def test_rng_state_round_trips():
    prov = RNGStateProvider()
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    items = _as_read_back(prov.items())
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    prov.restore(items)
    assert (
        torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]
    )


def test_dumps_is_deterministic():
    st = deepspeed_like_state()
    assert dumps(st)[0] == dumps(st)[0]
