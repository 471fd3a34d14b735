"""The receiving side's buffers: a process's new partitions, allocated from the plan before any
byte arrives."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..planner.plan import Plan


def allocate_partitions(
    plan: Plan, member: str, kinds: Sequence[str], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Dict[int, Dict[str, torch.Tensor]]:
    """New partitions of ``member`` in ``plan.new_layout``: ``{partition: {kind: 1-D tensor}}`` of
    ``plan.new_layout.partition_numel(partition)`` elements of ``dtype`` on ``device``.

    Uninitialised except for the elements no transfer of the plan writes (DeepSpeed's alignment
    padding), which are zeroed: the transfers fill the rest, so the memory is touched once.

    Raises:
        ValueError: ``member`` is not a member of the new world.
    """
    if member not in plan.new_members:
        raise ValueError(f"member {member} is not in the new world {list(plan.new_members)}")
    layout = plan.new_layout
    covered: Dict[int, List[Tuple[int, int]]] = {}
    for _, _, _, _, dst_offset, numel, dst_group in plan.rows_into(member).tolist():
        covered.setdefault(dst_group, []).append((dst_offset, dst_offset + numel))
    out = {}
    for g in range(layout.num_partitions):
        n = layout.partition_numel(g)
        out[g] = {k: torch.empty(n, dtype=dtype, device=device) for k in kinds}
        pos = 0
        for lo, hi in sorted(covered.get(g, [])) + [(n, n)]:
            if lo > pos:
                for k in kinds:
                    out[g][k][pos:lo].zero_()
            pos = max(pos, hi)
    return out
