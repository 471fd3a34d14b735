"""A pipeline checkpoint's layout for a load: the live model's layer list at the saved PP and DP
degree, split where the saved stages' files say (each stage's ``mp_rank_XX`` model-state file
lists the parameters it held, ``param_shapes``; DeepSpeed records no partition method), with the
saved working dtype and ZeRO settings, checked against every saved stage's files before anything
is read (read by :mod:`~ds_dynatrain.checkpoint.resharded_bands`)."""

from __future__ import annotations

import math

from ..errors import LayoutMismatchError
from ..vps.layout import ParamMeta
from ..vps.pipeline import PipelineLayer, PipelineLayout, stage_bounds
from .saved import SavedCheckpoint
from .saved_tp import check_shards


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
        parts = stage_bounds(layers, stage_keys)
        rr, align, stage, sub_group_size = saved.zero_settings()
        old = PipelineLayout(saved.pp, saved.world_size, layers, parts, stage, rr, align, sub_group_size)
    except (LayoutMismatchError, ValueError) as err:
        raise LayoutMismatchError(
            f"{saved.dir} (saved at {saved.degrees()}) does not fit the model's layers: {err}"
        ) from None
    for s in range(saved.pp):
        check_shards(saved, old, s)
        saved.check_sizes(old.zero(s), s)
    return old
