"""Regions against DeepSpeed's own affine shard description: DeepSpeed's coverage check and
``rebuild`` accept our ZeRO maps, DeepSpeed's tensor-parallel maps convert to the regions of
``Region.box``, and DeepSpeed's ``plan_transfer`` moves exactly what our planner moves."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

# DeepSpeed's affine modules (the oracles here) came in 0.19.7 (affine) and 0.19.8 (affine_transfer);
# the plugin itself runs on 0.19.7 (`make compat`)
pytest.importorskip("deepspeed.checkpoint.affine_transfer", reason="DeepSpeed < 0.19.8 has no affine_transfer")
from deepspeed.checkpoint.affine import contiguous_split_map  # noqa: E402
from deepspeed.checkpoint.affine_transfer import plan_transfer  # noqa: E402

from ds_dynatrain.planner import plan_transition  # noqa: E402
from ds_dynatrain.vps.affine import affine_map_regions, zero_param_affine_map
from ds_dynatrain.vps.layout import ParamMeta, ZeroLayout
from ds_dynatrain.vps.region import Region

PARAMS = (
    ParamMeta("a", (5, 7), "float32"),
    ParamMeta("b", (1,), "float32"),
    ParamMeta("c", (3, 3, 4), "float32"),
    ParamMeta("d", (11,), "float32"),
)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("ws", [1, 2, 3, 4, 7])
def test_zero_maps_pass_deepspeeds_checks_and_rebuild(ws, stage):
    layout = ZeroLayout(ws, (PARAMS,), stage=stage, sub_group_size=8)
    for p in PARAMS:
        amap = zero_param_affine_map(layout, 0, p.key)
        amap.validate_coverage()
        full = torch.arange(p.numel, dtype=torch.float32).reshape(p.shape)
        shards = {r: full.reshape(-1)[f.start : f.start + f.numel].clone() for r, f in layout.param_fragments(0, p.key)}
        assert torch.equal(amap.rebuild(shards), full)
        regions = affine_map_regions(amap)
        assert regions == {r: layout.region(r, p.key) for r, _ in layout.param_fragments(0, p.key)}


@pytest.mark.parametrize("shape, sizes, dim", [((6, 4), (2, 4), 0), ((6, 4), (1, 3), 1), ((2, 3, 5), (2, 1, 2), 2)])
def test_tensor_parallel_maps_convert_to_boxes(shape, sizes, dim):
    amap = contiguous_split_map(shape, sizes, dim)
    regions = affine_map_regions(amap)
    start = 0
    for rank, size in enumerate(sizes):
        starts = [0] * len(shape)
        box_sizes = list(shape)
        starts[dim], box_sizes[dim] = start, size
        assert regions[rank] == Region.box(shape, starts, box_sizes)
        start += size


VECTORS = (
    ParamMeta("v", (37,), "float32"),
    ParamMeta("one", (1,), "float32"),
    ParamMeta("w", (64,), "float32"),
    ParamMeta("x", (5,), "float32"),
)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("old_ws, new_ws", [(2, 1), (1, 2), (2, 3), (3, 2), (4, 3), (3, 5)])
def test_plan_transfer_moves_what_our_planner_moves(old_ws, new_ws, stage):
    """DeepSpeed's planner accepts only pieces with the parameter's number of axes, and a ZeRO
    interval of a multi-dimensional parameter is a union of boxes, so this oracle runs on 1-D
    parameters (where every interval is a box). At stage 3 (sub-groups of 16 elements) the
    sub-groups differ between the two world sizes."""
    old = ZeroLayout(old_ws, (VECTORS,), stage=stage, sub_group_size=16)
    new = ZeroLayout(new_ws, (VECTORS,), stage=stage, sub_group_size=16)
    ours = plan_transition(old, new, [f"o{i}" for i in range(old_ws)], [f"n{j}" for j in range(new_ws)])
    ds_counts, our_counts = Counter(), Counter()
    for p in VECTORS:
        plan = plan_transfer(zero_param_affine_map(new, 0, p.key), zero_param_affine_map(old, 0, p.key))
        assert plan.moved_elements == p.numel
        for seg in plan.segments:
            ds_counts[(p.key, seg.source_rank, seg.target_rank)] += seg.numel
    for t in ours.transfers:
        # attribute each of our (merged) transfers to parameters through the destination layout
        lo, hi = t.dst_offset, t.dst_offset + t.numel
        for f in new.fragments(t.dst):
            a, b = max(lo, f.local), min(hi, f.local + f.numel)
            if f.group == t.dst_group and a < b:
                our_counts[(f.key, t.src, t.dst)] += b - a
    assert ds_counts == our_counts
