"""The model-size arithmetic of ``benchmarks.pp_reconfig`` (the layer count it picks for
``--params``) against the layers its worker builds."""

from __future__ import annotations

import pytest

from benchmarks.pp_reconfig import layers_for
from benchmarks.pp_reconfig_worker import specs


@pytest.mark.parametrize("hidden,layers", [(64, 1), (128, 3), (192, 5)])
def test_layers_for_counts_the_built_pipeline(hidden, layers):
    built = specs(hidden, layers)
    params = sum(p.numel() for s in built[:-1] for p in s.build().parameters())  # the tied head adds none
    assert layers_for(params, hidden) == layers
