"""The model's Hugging Face config kept with a snapshot: taken from a ``transformers`` model as plain
JSON data, carried through the snapshot serializer's allow-list unchanged (no new class allowed),
and written back as a ``config.json`` that ``transformers`` reads as the same config.

Oracle: ``transformers``' own ``LlamaConfig`` (its ``to_dict`` before and after).
"""

from __future__ import annotations

import os

import pytest

from ds_dynatrain.checkpoint.model_config import (
    MODEL_CONFIG_KEY,
    model_config_of,
    with_model_config,
    write_config_json,
)
from state_providers.serialize import dumps, loads

transformers = pytest.importorskip("transformers")


def tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    return transformers.LlamaForCausalLM(cfg)


def test_config_round_trip_through_the_snapshot_serializer_and_config_json(tmp_path):
    model = tiny_llama()
    state = with_model_config({"mine": 1}, model)
    assert state["mine"] == 1 and state[MODEL_CONFIG_KEY]["hidden_size"] == 32
    data, sink = dumps(state, key="client")
    assert len(sink) == 0  # plain JSON data, no tensor
    back = loads(data, lambda i: None, key="client")
    assert back == state
    path = write_config_json(back, str(tmp_path))
    assert path == os.path.join(tmp_path, "config.json")
    assert sorted(os.listdir(tmp_path)) == ["config.json"]  # the temporary file renamed, none left
    again = transformers.LlamaConfig.from_pretrained(str(tmp_path))
    assert again.to_dict() == model.config.to_dict()


def test_modules_without_a_config_and_callers_own_key():
    import torch

    assert model_config_of(torch.nn.Linear(2, 2)) is None
    assert with_model_config(None, torch.nn.Linear(2, 2)) == {}
    assert with_model_config({MODEL_CONFIG_KEY: "the caller's"}, tiny_llama()) == {MODEL_CONFIG_KEY: "the caller's"}

    class NotJson:
        def to_dict(self):
            return {"f": object()}

    class M(torch.nn.Module):
        config = NotJson()

    assert model_config_of(M()) is None


def test_no_saved_config_writes_nothing(tmp_path):
    assert write_config_json({"module": {}}, str(tmp_path)) is None
    assert write_config_json({MODEL_CONFIG_KEY: "not an object"}, str(tmp_path)) is None
    assert os.listdir(tmp_path) == []
    with pytest.raises(OSError):
        write_config_json({MODEL_CONFIG_KEY: {"a": 1}}, str(tmp_path / "missing"))
