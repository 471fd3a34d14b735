"""The receiving side's buffers: a process's new partitions, allocated from the plan before any
byte arrives."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from ..planner.plan import Plan


def allocate_partitions(
    plan: Plan,
    member: str,
    kinds: Sequence[str],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    reuse: Sequence[torch.Tensor] = (),
) -> Dict[int, Dict[str, torch.Tensor]]:
    """New partitions of ``member`` in ``plan.new_layout``: ``{partition: {kind: 1-D tensor}}`` of
    ``plan.new_layout.partition_numel(partition)`` elements of ``dtype`` on ``device``.

    Each is one of ``reuse`` where one is left of that length, dtype and device (1-D tensors
    allocated and written ahead, e.g. the memory held for a prepared switch: its pages are mapped
    already, so the transfer writes into them without a page fault), else a new allocation.
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
    spare = [t for t in reuse if t.dim() == 1 and t.dtype == dtype and t.device == torch.device(device)]
    out = {}
    for g in range(layout.num_partitions):
        n = layout.partition_numel(g)
        out[g] = {k: _take(spare, n, dtype, device) for k in kinds}
        pos = 0
        for lo, hi in sorted(covered.get(g, [])) + [(n, n)]:
            if lo > pos:
                for k in kinds:
                    out[g][k][pos:lo].zero_()
            pos = max(pos, hi)
    return out


def _take(spare: List[torch.Tensor], numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The first tensor of ``spare`` with ``numel`` elements (removed from it), else a new one."""
    for i, t in enumerate(spare):
        if t.numel() == numel:
            return spare.pop(i)
    return torch.empty(numel, dtype=dtype, device=device)


def reused_bytes(parts: Dict[int, Dict[str, torch.Tensor]], reuse: Sequence[torch.Tensor]) -> int:
    """Bytes of the partitions ``parts`` (as :func:`allocate_partitions` returns them) that are
    tensors of ``reuse``."""
    ids = {id(t) for t in reuse}
    return sum(t.numel() * t.element_size() for g in parts.values() for t in g.values() if id(t) in ids)
