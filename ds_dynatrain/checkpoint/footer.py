"""The VPS schema of a snapshot's footer: which fragments of which parameters each ZeRO partition
tensor of a DeepSpeed checkpoint dict holds, written and read here alone.

Each partition tensor's footer item carries ``attrs["vps"] = {"kind", "group", "rank",
"world_size", "stage", "fragments"}``: the state kind (``fp32`` for the master, else the
optimizer state's name), the partition index, the saving rank, world size and ZeRO stage, and the
partition's fragments as ``[key, start, numel, local]`` lists (elements: the fragment's start and
length in the parameter's flattening, its offset in the partition). A snapshot can therefore be
read by another layout, and its reconstruction of the saved layout checked.

Paths of the partition tensors (``DeepSpeedZeroOptimizer.state_dict``,
deepspeed/runtime/zero/stage_1_and_2.py): ``optimizer_state_dict/single_partition_of_fp32_groups/<g>``
(fp32 master) and ``optimizer_state_dict/base_optimizer_state[/state]/<g>/<state>`` (Adam moments;
the torch optimizer's ``step`` is a scalar and gets none). Stage 3 (``DeepSpeedZeroOptimizer_Stage3
._rigid_state_dict``, deepspeed/runtime/zero/stage3.py), per sub-group ``<g>``:
``optimizer_state_dict/fp32_flat_groups/<g>`` and
``optimizer_state_dict/optimizer_state_dict/state/<g>/<state>``.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence

from ..vps.layout import ZeroLayout

VPS_ATTR = "vps"
PATTERN = re.compile(
    r"optimizer_state_dict/(?:(?:single_partition_of_fp32_groups|fp32_flat_groups)/(\d+)|"
    r"(?:base_optimizer_state|optimizer_state_dict)/(?:state/)?(\d+)/(\w+))"
)


def expected_fragments(layout: ZeroLayout, rank: int) -> Dict[int, List[list]]:
    """``{partition: [[key, start, numel, local], ...]}`` of ``rank`` under ``layout``, in the
    partition's order: what a footer written at that layout records."""
    out: Dict[int, List[list]] = {}
    for f in layout.fragments(rank):
        out.setdefault(f.group, []).append([f.key, f.start, f.numel, f.local])
    return out


class VPSAttributes:
    """Footer attributes of the partition tensors of one rank's checkpoint dict (the snapshot
    engine's ``tensor_attrs``): called with a tensor's path in the dict, returns ``{"vps": ...}``
    for a partition tensor and ``{}`` for anything else.

    Args:
        layout: the saving engine's layout.  rank: the saving rank.
    """

    def __init__(self, layout: ZeroLayout, rank: int):
        self.layout, self.rank = layout, rank
        self._by_group = expected_fragments(layout, rank)

    def __call__(self, path: str) -> dict:
        m = PATTERN.fullmatch(path)
        if m is None or m.group(3) == "step":
            return {}
        g = int(m.group(1) if m.group(1) is not None else m.group(2))
        return {
            VPS_ATTR: {
                "kind": "fp32" if m.group(1) is not None else m.group(3),
                "group": g,
                "rank": self.rank,
                "world_size": self.layout.world_size,
                "stage": self.layout.stage,
                "fragments": self._by_group.get(g, []),
            }
        }


class FragmentMismatch(NamedTuple):
    """A footer item whose recorded fragments differ from a layout's: the item's key, its state
    kind and partition, the first recorded fragment and the layout's first (``[]`` when none)."""

    item: str
    kind: Optional[str]
    partition: int
    got: list
    want: list


def fragment_mismatches(
    items: Iterable, layout: ZeroLayout, rank: int, kinds: Optional[Sequence[str]] = None
) -> Iterator[FragmentMismatch]:
    """The footer ``items`` (``io_engine`` item metadata with ``key`` and ``attrs``) of rank
    ``rank``'s file whose recorded fragments are not those of ``layout`` (a partition index the
    layout does not have counts as a mismatch). ``kinds``: only items of these state kinds."""
    expected = expected_fragments(layout, rank)
    attrs_of = VPSAttributes(layout, rank)
    for m in items:
        vps = (m.attrs or {}).get(VPS_ATTR)
        if not vps or (kinds is not None and vps.get("kind") not in kinds):
            continue
        try:
            b = int(vps.get("group", -1))
            got = [list(x) for x in vps.get("fragments", [])]
        except (TypeError, ValueError):
            b, got = -1, []
        if not 0 <= b < layout.num_partitions or got != expected.get(b, []):
            yield FragmentMismatch(m.key, vps.get("kind"), b, got[:1], expected.get(b, [])[:1])
            continue
        # every other attribute (kind, partition, rank, world, stage) must be what the item's
        # path in the saved dict means under the layout
        want = attrs_of(str((m.attrs or {}).get("path", ""))).get(VPS_ATTR)
        if want != vps:
            field = next((k for k in sorted(set(vps) | set(want or {})) if vps.get(k) != (want or {}).get(k)), "")
            yield FragmentMismatch(m.key, vps.get("kind"), b, [field, vps.get(field)], [field, (want or {}).get(field)])
