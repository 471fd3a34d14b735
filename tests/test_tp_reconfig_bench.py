"""The model-size arithmetic of ``benchmarks.reconfig`` / ``benchmarks.tp_reconfig`` (the layer
count the benchmarks pick for ``--params``) against the Hugging Face model the workers build, and
the TP switch list of ``benchmarks.tp_reconfig``."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.reconfig import llama_params
from benchmarks.reconfig_worker import build_model
from benchmarks.tp_reconfig import parse_switches


@pytest.mark.parametrize("hidden,layers,kv_heads", [(128, 2, 0), (128, 3, 1), (256, 1, 2), (192, 2, 3)])
def test_llama_params_counts_the_built_model(hidden, layers, kv_heads):
    model = build_model(hidden, layers, 16, kv_heads)
    assert llama_params(hidden, layers, kv_heads=kv_heads or None) == sum(p.numel() for p in model.parameters())


def test_parse_switches():
    assert parse_switches("2:1, 1:2") == [(2, 1), (1, 2)]
    for bad in ("2:2", "2", "0:1", "a:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_switches(bad)
