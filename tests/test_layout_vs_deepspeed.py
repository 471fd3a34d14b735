"""The layout computed from metadata alone equals what DeepSpeed's real engines build.

For ZeRO-1, ZeRO-2 and ZeRO-3, world sizes 1-4, models with an odd parameter count, a 1-element
parameter, a frozen embedding, two interleaved parameter groups, round-robin gradients,
parameter alignment, ZeRO-3 sub-groups and bf16: every rank's fragments (parameter, start,
length, offset in the partition) from ``ZeroLayout.fragments`` equal where DeepSpeed really put
each parameter's data in the flat buffer (stage 3: each parameter's ``ds_tensor`` in its
sub-group's flat partition), and, except under round-robin gradients, each parameter's
``_hp_mapping`` (stage 3: the layout read back from the live engine, whose sub-groups are
checked against DeepSpeed's).

DeepSpeed 0.19.8 links ``_hp_mapping`` in the original parameter order even when
``round_robin_gradients`` lays the flat buffer out in round-robin order (without parameter
alignment), so for that case ``_hp_mapping`` disagrees with the data; the test pins that too.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import WORKERS, run_plain

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize(
    "world_size",
    [
        pytest.param(1, marks=pytest.mark.slow),
        pytest.param(2, marks=pytest.mark.slow),
        pytest.param(3, marks=pytest.mark.slow),
        4,
    ],
)
def test_layout_equals_deepspeed(tmp_path, world_size):
    jobs = run_plain(
        tmp_path, os.path.join(WORKERS, "layout_worker.py"), world_size, [str(tmp_path)], timeout=180, name="layout"
    )
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    seen_cases = set()
    for rank in range(world_size):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, r in result.items():
            seen_cases.add(case)
            assert r["actual"], f"{case}: rank {rank} holds no fragment"
            assert r["expected"] == r["actual"], f"{case}: rank {rank} of {world_size}"
            if case.startswith("round_robin") and world_size > 1:
                assert r["hp_mapping"] != r["actual"], f"{case}: DeepSpeed's _hp_mapping now follows round robin"
            else:
                assert r["hp_mapping"] == r["actual"], f"{case}: rank {rank} of {world_size} (_hp_mapping)"
            assert r["expected_partition_numel"] == r["actual_partition_numel"], case
    assert len(seen_cases) == 12
