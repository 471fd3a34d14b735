"""The model-size arithmetic of ``benchmarks.reconfig`` / ``benchmarks.tp_reconfig`` (the layer
count the benchmarks pick for ``--params``) against the Hugging Face model the workers build, and
the switch list of ``benchmarks.tp_reconfig`` and ``benchmarks.pp_reconfig``."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.reconfig import llama_params, parse_transitions
from benchmarks.reconfig_worker import build_model


@pytest.mark.parametrize("hidden,layers,kv_heads", [(128, 2, 0), (128, 3, 1), (256, 1, 2), (192, 2, 3)])
def test_llama_params_counts_the_built_model(hidden, layers, kv_heads):
    model = build_model(hidden, layers, 16, kv_heads)
    assert llama_params(hidden, layers, kv_heads=kv_heads or None) == sum(p.numel() for p in model.parameters())


def test_parse_transitions():
    assert parse_transitions("2:1, 1:2") == [(2, 1), (1, 2)]
    for bad in ("2:2", "2", "0:1", "a:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_transitions(bad)
