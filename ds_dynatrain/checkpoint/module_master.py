"""The working parameters a ZeRO-1/2 snapshot leaves out of its model-state file, because the fp32
master partitions hold them: replaced by empty placeholders on save, rebuilt from every rank's
master fragments when the file is read.

At ZeRO-1/2 DeepSpeed makes every working parameter the cast of its fp32 master at each optimizer
step (``DeepSpeedZeroOptimizer.step`` copies each fp32 partition into the bit16 partition, then
all-gathers it; deepspeed/runtime/zero/stage_1_and_2.py) and at set-up clones the master from the
working parameters, so ``working == master.to(working dtype)`` bitwise between steps. A snapshot
that writes both writes the fp32 state twice: an 85 M-parameter fp32 job's 1.36 GB snapshot
holds 340 MB of ``module`` on rank 0 that the optimizer files also hold. The files keep the
``module`` dict's keys in order (export and the loads read only frozen parameters and buffers
from it by range) and list the stripped names under :data:`MARKER`.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Mapping, Tuple

import torch

from ..errors import CheckpointIncompleteError

MARKER = "dynatrain_module_from_master"  # model-state key: the module entries rebuilt from the master


def strip_working(state: dict, shapes: Mapping[str, Tuple[int, ...]]) -> dict:
    """``state`` (a model-state dict DeepSpeed is saving) with each floating-point ``module`` entry
    named in ``shapes`` (trainable parameter name -> its shape) and of that shape replaced by an
    empty tensor of its dtype (shape ``(0,)``), their names listed under :data:`MARKER`; ``state``
    itself is not changed. Other entries (a name not in ``module``, another shape, as a state-dict
    hook may give) are kept; a state without a ``module`` dict, or with none to strip, is returned
    as it is."""
    module = state.get("module")
    if not isinstance(module, dict):
        return state
    stripped = [
        n
        for n, shape in shapes.items()
        if torch.is_tensor(module.get(n)) and module[n].is_floating_point() and tuple(module[n].shape) == shape
    ]
    if not stripped:
        return state
    kept = dict(module)
    for n in stripped:
        kept[n] = torch.empty(0, dtype=module[n].dtype)
    return {**state, "module": kept, MARKER: stripped}


def rebuild_working(state: dict, model_path: str, map_location=None) -> dict:
    """Fill ``state["module"]``'s stripped entries (``state``: the model-state dict read from
    ``model_path``) from the fp32 master fragments of every optimizer-state file in the same
    directory, cast to each entry's saved dtype as DeepSpeed's step casts them (``copy_``:
    round to nearest even); drop :data:`MARKER`. A state without it is returned as it is.

    Reads only the master partitions' ranges (io_uring, checksums verified), the size of the
    stripped parameters in all.

    Raises:
        CheckpointIncompleteError: an optimizer-state file is missing or damaged, a stripped name
            is not a parameter of ``param_shapes``, or the partitions do not cover it.
        CheckpointCorruptError: a checksum mismatch in a master range.
    """
    names = state.pop(MARKER, None)
    if names is None:
        return state
    from .saved import SavedCheckpoint, partitions_of

    tag_dir = os.path.dirname(os.path.abspath(model_path))
    try:
        saved = SavedCheckpoint(os.path.dirname(tag_dir), os.path.basename(tag_dir))
    except CheckpointIncompleteError as err:  # its subclasses too: the same class, the reason first
        raise type(err)(
            f"{model_path} leaves the module's trainable parameters to the fp32 master partitions of the "
            f"optimizer-state files beside it (snapshot.module_from_master), and {err}"
        ) from None
    try:
        layout = saved.layout_from_metadata()
        shapes = {p.key: p.shape for g in layout.groups for p in g}
        module = state["module"]
        unknown = [n for n in names if n not in shapes or n not in module]
        if unknown:
            raise CheckpointIncompleteError(
                f"{model_path}: {unknown[0]} is listed as held by the fp32 master but is no saved parameter"
            )
        full: Dict[str, torch.Tensor] = {n: torch.empty(math.prod(shapes[n]), dtype=module[n].dtype) for n in names}
        covered = dict.fromkeys(names, 0)
        for r in range(saved.world_size):
            f = saved.optim(r)
            parts = partitions_of(f.tree, saved.stage)
            requests: List[tuple] = []
            for fr in layout.fragments(r):
                if fr.key in full:
                    dest = full[fr.key][fr.start : fr.start + fr.numel]
                    requests.append((parts.tensors[fr.group]["fp32"], fr.local, dest))
                    covered[fr.key] += fr.numel
            f.read_into(requests)
        short = [n for n in names if covered[n] != full[n].numel()]
        if short:
            raise CheckpointIncompleteError(f"{saved.dir}: the master partitions do not cover parameter {short[0]}")
        for n in names:
            t = full[n].view(shapes[n])
            module[n] = t.to(map_location) if isinstance(map_location, (str, torch.device)) else t
    finally:
        saved.close()
    return state


__all__ = ["MARKER", "rebuild_working", "strip_working"]
