"""Whether a saved checkpoint holds the live engine's model, checked from metadata before any
partition is read, at the saving world size and at any other.

The trainable parameters come from the model-state file's ``param_shapes`` (per saved partition,
in the order they lie in it), the frozen ones from ``frozen_param_shapes`` (DeepSpeed writes it at
ZeRO-2/3) or the saved module state, the optimizer's parameter groups from rank 0's
optimizer-state file. Every check raises :class:`~ds_dynatrain.errors.LayoutMismatchError`
naming the first parameter (or group) that differs.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

from ..errors import LayoutMismatchError
from ..vps.layout import ZeroLayout, round_robin_order
from .saved import SavedCheckpoint, check_parameters, numel_of


def _shape(p) -> Tuple[int, ...]:
    """A live parameter's full shape (a ZeRO-3 parameter's ``ds_shape``)."""
    return tuple(int(d) for d in getattr(p, "ds_shape", p.shape))


def saved_partition_keys(saved: SavedCheckpoint) -> List[Tuple[str, ...]]:
    """Per saved partition (a parameter group at ZeRO-1/2, a sub-group at ZeRO-3), the names of
    its parameters in the order they lie in it, from ``param_shapes``; parameters without
    elements are left out (DeepSpeed keeps them out of its partitions)."""
    out = []
    for group in saved.model_state.get("param_shapes") or []:
        keys = tuple(str(n) for n, shape in group.items() if math.prod(int(d) for d in shape) > 0)
        if keys:
            out.append(keys)
    return out


def check_model(engine, saved: SavedCheckpoint, live: ZeroLayout, frozen_from_module: bool = False) -> None:
    """The checkpoint holds the model of ``engine`` (whose layout is ``live``): the same trainable
    parameters (names and shapes) and the same frozen ones.

    ``frozen_from_module``: also require every frozen parameter of the model in the saved module
    state when the checkpoint records no ``frozen_param_shapes`` (what a resharded load at
    ZeRO-1/2 reads them from).

    Raises:
        LayoutMismatchError: a parameter of the model missing from the checkpoint, one of the
            checkpoint's that the model does not train, or a shape that differs (the first).
    """
    # the trainable parameters, as DeepSpeed partitions them (none without elements)
    saved_shapes = {n: s for n, s in saved.param_shapes().items() if math.prod(s) > 0}
    check_parameters(saved_shapes, live, saved.dir)
    live_keys = {p.key for g in live.groups for p in g}
    check_frozen(engine, saved, live_keys, frozen_from_module)


def check_frozen(engine, saved: SavedCheckpoint, live_keys, from_module: bool) -> None:
    """The model's frozen parameters (those not in ``live_keys``) are the checkpoint's: by
    ``frozen_param_shapes`` where it has them, else (``from_module``, ZeRO-1/2) in the saved
    module state.

    Raises:
        LayoutMismatchError: naming the first frozen parameter that differs.
    """
    frozen: Dict[str, Tuple[int, ...]] = {
        n: _shape(p) for n, p in engine.module.named_parameters() if n not in live_keys and not p.requires_grad
    }
    recorded = saved.model_state.get("frozen_param_shapes")
    if isinstance(recorded, dict):
        # DeepSpeed counts every parameter its optimizer does not own as frozen (zero-element ones too)
        recorded = {str(n): tuple(int(d) for d in s) for n, s in recorded.items()}
        for name, shape in frozen.items():
            if name not in recorded:
                raise LayoutMismatchError(
                    f"frozen parameter {name} {list(shape)} of the model is not in the checkpoint"
                )
            if recorded[name] != shape:
                raise LayoutMismatchError(
                    f"frozen parameter {name} is {list(recorded[name])} in the checkpoint "
                    f"and {list(shape)} in the model"
                )
        trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad and math.prod(_shape(p)) > 0}
        for name, shape in recorded.items():
            if name in trainable:
                raise LayoutMismatchError(
                    f"parameter {name} {list(shape)} is frozen in the checkpoint, trained in the model"
                )
            if name not in frozen and math.prod(shape) > 0:
                raise LayoutMismatchError(f"checkpoint frozen parameter {name} {list(shape)} is not in the model")
        return
    if not from_module or saved.stage == 3 or engine.zero_optimization_stage() == 3:
        return
    module_sd = saved.model_state.get("module") or {}
    for name, shape in frozen.items():
        src = module_sd.get(name)
        if src is None or numel_of(src) != math.prod(shape):
            raise LayoutMismatchError(f"frozen parameter {name} {list(shape)} is not in the checkpoint's module state")


def check_partition_order(saved: SavedCheckpoint, live: ZeroLayout) -> None:
    """The checkpoint's parameters lie in its partitions in the order the model's would at the
    saving world size: each optimizer group's parameters in model order (at ZeRO-1/2 in DeepSpeed's
    round-robin order when ``round_robin_gradients`` was set), group after group. A model whose
    parameters were registered in another order (same names and shapes) would otherwise read the
    right bytes into the wrong parameters.

    Raises:
        LayoutMismatchError: naming the first parameter out of place.
    """
    z = saved.ds_config.get("zero_optimization") or {}
    round_robin = saved.stage != 3 and bool(z.get("round_robin_gradients", False))
    want: List[str] = []
    for params in live.groups:
        keys = [p.key for p in params]
        if round_robin:
            keys = [keys[i] for i in round_robin_order(len(keys), saved.world_size)]
        want += keys
    got = [k for part in saved_partition_keys(saved) for k in part]
    for i in range(max(len(got), len(want))):
        here, there = (got[i] if i < len(got) else None), (want[i] if i < len(want) else None)
        if here != there:
            raise LayoutMismatchError(
                f"parameter {i} of the saved partitions is {here or 'missing'} in the checkpoint and "
                f"{there or 'missing'} in the model (parameters registered in another order)"
            )


def check_param_groups(engine, saved: SavedCheckpoint, optimizer: bool) -> None:
    """The optimizer has as many parameter groups as the checkpoint's (their hyper-parameters
    are installed group by group).

    Raises:
        LayoutMismatchError: the numbers differ.
    """
    if not optimizer:
        return
    osd = saved.optim(0).tree.get("optimizer_state_dict", {})
    base = (
        osd.get("optimizer_state_dict" if saved.stage == 3 else "base_optimizer_state")
        if isinstance(osd, dict)
        else None
    )
    groups = base.get("param_groups") if isinstance(base, dict) else None
    live = engine.optimizer.optimizer.param_groups
    if groups and len(groups) != len(live):
        raise LayoutMismatchError(f"the checkpoint has {len(groups)} optimizer parameter groups, the model {len(live)}")
