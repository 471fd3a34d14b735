"""A pipeline checkpoint's layout: for a load, the live model's layer list at the saved PP and DP
degree, split where the saved stages' files say (each stage's ``mp_rank_XX`` model-state file
lists the parameters it held, ``param_shapes``; DeepSpeed records no partition method), with the
saved working dtype and ZeRO settings, checked against every saved stage's files before anything
is read (read by :mod:`~ds_dynatrain.checkpoint.resharded_bands`); without a model, the stages'
``param_shapes`` alone (what ``verify``, ``inspect`` and ``export`` use)."""

from __future__ import annotations

import math

from ..errors import CheckpointIncompleteError, LayoutMismatchError
from ..vps.layout import ParamMeta
from ..vps.pipeline import TIED_PREFIX, PipelineLayer, PipelineLayout, stage_bounds
from .saved import SavedCheckpoint
from .saved_tp import check_shards, tp_layout_from_metadata


def saved_pp_layout(saved: SavedCheckpoint, live: PipelineLayout) -> PipelineLayout:
    """The layout ``saved`` was written in: ``live``'s layers at ``saved.pp`` stages of
    ``saved.world_size`` ZeRO ranks, split as the saved stages held them
    (:func:`~ds_dynatrain.vps.pipeline.stage_bounds`).

    Raises:
        LayoutMismatchError: the checkpoint is not a pipeline's of this model (saved with AutoTP,
            a stage holding a parameter the layer list lacks or no split giving each stage its
            parameters, a shape or a partition's size that differs), naming the stage and
            parameter or the file.
    """
    if saved.tp != 1:
        raise LayoutMismatchError(
            f"{saved.dir} was saved at {saved.degrees()} with AutoTP; a pipeline job cannot load it"
        )
    dtype = saved.working_dtype()
    layers = tuple(PipelineLayer(tuple(ParamMeta(p.key, p.shape, dtype) for p in x.params), x.tie) for x in live.layers)
    stage_keys = [
        [
            str(n)
            for g in (saved.model_state_of(s).get("param_shapes") or [])
            for n, shape in g.items()
            if math.prod(shape)
        ]
        for s in range(saved.pp)
    ]
    try:
        parts = stage_bounds(layers, stage_keys, live.optimizer_groups)
        rr, align, stage, sub_group_size = saved.zero_settings()
        zero = (stage, rr, align, sub_group_size, live.optimizer_groups)
        old = PipelineLayout(saved.pp, saved.world_size, layers, parts, *zero)
    except (LayoutMismatchError, ValueError) as err:
        raise LayoutMismatchError(
            f"{saved.dir} (saved at {saved.degrees()}) does not fit the model's layers: {err}"
        ) from None
    for s in range(saved.pp):
        check_shards(saved, old, s)
        saved.check_sizes(old.zero(s), s)
    return old


def pp_layout_from_metadata(saved: SavedCheckpoint) -> PipelineLayout:
    """The :class:`PipelineLayout` ``saved`` (a pipeline checkpoint, ``saved.pp > 1``) was written
    in, from its metadata alone (no model: what ``verify``, ``inspect`` and ``export`` use): each
    stage's ``param_shapes`` (its model-state file) as the stage's layers, one per tied key
    (``tied_modules.<key>.*``) and one per layer index (``<index>.*``), and its optimizer groups
    (each list of ``param_shapes``; a stage lists only the groups holding some of its
    parameters). Not checked against the partitions: the callers do that.

    Raises:
        CheckpointIncompleteError: a stage's model-state file without ``param_shapes``.
        LayoutMismatchError: the stages do not describe one model (a parameter with two shapes,
            a stage holding nothing), naming it.
    """
    dtype = saved.working_dtype()
    layers, parts, group_of = [], [0], {}
    for s in range(saved.pp):
        groups = [g for g in (saved.model_state_of(s).get("param_shapes") or []) if len(g)]
        if not groups:
            raise CheckpointIncompleteError(f"{saved.dir}: stage {s}'s model-state file has no param_shapes")
        owners = {}  # layer name -> its parameters, in the stage's order
        for g, shapes in enumerate(groups):
            for name, shape in shapes.items():
                name = str(name)
                if group_of.setdefault(name, g) != g:  # the stages' empty groups were left out differently
                    raise LayoutMismatchError(
                        f"{saved.dir}: tied parameter {name} is in the optimizer group at position "
                        f"{group_of[name]} on one stage and {g} on stage {s}: the groups cannot be told apart"
                    )
                owner = ".".join(name.split(".", 2)[:2]) if name.startswith(TIED_PREFIX) else name.split(".", 1)[0]
                owners.setdefault(owner, []).append(ParamMeta(name, tuple(int(d) for d in shape), dtype))
        # PipelineModule's order: tied modules first (as listed), then the layers by index
        order = sorted(
            owners, key=lambda o: (0, 0) if o.startswith(TIED_PREFIX) else (1, int(o)) if o.isdigit() else (2, 0)
        )
        for owner in order:
            tie = owner[len(TIED_PREFIX) :] if owner.startswith(TIED_PREFIX) else None
            layers.append(PipelineLayer(tuple(owners[owner]), tie))
        parts.append(len(layers))
    rr, align, stage, sub_group_size = saved.zero_settings()
    in_groups = tuple(sorted((k, g) for k, g in group_of.items() if g))
    try:
        return PipelineLayout(
            saved.pp, saved.world_size, tuple(layers), tuple(parts), stage, rr, align, sub_group_size, in_groups
        )
    except (LayoutMismatchError, ValueError) as err:
        raise LayoutMismatchError(f"{saved.dir}: the stages' param_shapes do not describe one model: {err}") from None


def band_layout_from_metadata(saved: SavedCheckpoint):
    """The saved band layout from metadata alone: :func:`pp_layout_from_metadata` for a pipeline
    checkpoint, else :func:`~ds_dynatrain.checkpoint.saved_tp.tp_layout_from_metadata` (TP 1:
    the ZeRO layout of ``param_shapes``)."""
    if saved.pp > 1:
        return pp_layout_from_metadata(saved)
    return tp_layout_from_metadata(saved)
