"""Oracle of a TP + ZeRO layout: a rank's flat partitions cut straight from the full tensors with
numpy slicing (the TP shard) and ``ZeroLayout.fragments`` (the 1-D ZeRO layout proven against
DeepSpeed in ``tests/test_layout_vs_deepspeed.py``), with no box geometry of the planner."""

from __future__ import annotations

import numpy as np

from ds_dynatrain.vps.tensor_parallel import TensorParallelLayout, matrix_shape


def partitions(layout: TensorParallelLayout, full: dict) -> list:
    """Oracle: per global rank, its flat partitions (float64 arrays, NaN where padding)."""
    out = [None] * layout.world_size
    for t in range(layout.tp):
        zl = layout.zero(t)
        for d in range(layout.dp):
            parts = [np.full(zl.partition_numel(b), np.nan) for b in range(zl.num_partitions)]
            for f in zl.fragments(d):
                p = next(q for q in layout.params if q.key == f.key)
                r0, nr, c0, nc = layout.band(p, t)
                shard = full[f.key].reshape(matrix_shape(p.shape))[r0 : r0 + nr, c0 : c0 + nc].reshape(-1)
                parts[f.group][f.local : f.local + f.numel] = shard[f.start : f.start + f.numel]
            out[layout.rank(t, d)] = parts
    return out
