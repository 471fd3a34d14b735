"""``dynatrain plan --pipeline-parallel-from A --pipeline-parallel-to B``: the plan of a change of
PP and DP degree of a Hugging Face causal LM trained as a DeepSpeed pipeline (``PipelineModule``
+ ZeRO-1), from metadata alone."""

from __future__ import annotations

import os
import time
from functools import lru_cache
from typing import Tuple

from ..errors import ConfigError, LayoutMismatchError
from ..planner.pp_plan import plan_pp_transition
from ..vps.layout import ParamMeta
from ..vps.pipeline import TIED_PREFIX, PipelineLayer, PipelineLayout
from .plan import meta_model
from .plan_tp import box_plan_report


@lru_cache(maxsize=4)
def pipeline_of_model(model_config: str, dtype: str) -> Tuple[Tuple[PipelineLayer, ...], Tuple[str, ...]]:
    """The causal LM of a Hugging Face config file as the layer list of a Megatron-DeepSpeed /
    GPT-NeoX style pipeline: the token embedding, one layer per decoder layer, the final norm and
    the head (a ``TiedLayerSpec`` pair with the embedding where the model ties them); and each
    layer's class name (for ``type:`` partitioning).

    Raises:
        ConfigError: the file is unreadable, or the model is not a decoder stack of this shape
            (``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``).
    """
    model = meta_model(os.path.abspath(model_config))
    try:
        embed, blocks, norm, head = model.model.embed_tokens, model.model.layers, model.model.norm, model.lm_head
    except AttributeError as err:
        raise ConfigError(f"--model-config {model_config!r}: not a decoder stack a pipeline can hold ({err})") from None
    tied = head.weight is embed.weight

    def metas(module, prefix: str):
        return tuple(ParamMeta(prefix + n, tuple(p.shape), dtype) for n, p in module.named_parameters())

    if tied:
        first = PipelineLayer(metas(embed, f"{TIED_PREFIX}embed."), "embed")
        last = first
    else:
        first = PipelineLayer(metas(embed, "0."))
        last = PipelineLayer(metas(head, f"{len(blocks) + 2}."))
    layers = [first, *(PipelineLayer(metas(b, f"{i + 1}.")) for i, b in enumerate(blocks))]
    layers += [PipelineLayer(metas(norm, f"{len(blocks) + 1}.")), last]
    names = [type(embed).__name__, *(type(b).__name__ for b in blocks), type(norm).__name__, type(head).__name__]
    return tuple(layers), tuple(names)


def pp_layout(model_config: str, world_size: int, pp: int, dtype: str, method: str = "parameters") -> PipelineLayout:
    """The pipeline + ZeRO-1 layout of the causal LM of a Hugging Face config file at
    ``world_size`` ranks and ``pp`` stages (DP = ``world_size / pp``), split by DeepSpeed's
    partition function for ``method``.

    Raises:
        ConfigError: ``pp`` does not divide ``world_size``, more stages than layers, an unknown
            partition method, or as :func:`pipeline_of_model`.
    """
    from ..zero.pipeline import pipeline_parts

    if pp < 1 or world_size < 1:
        raise ConfigError(f"PP degree {pp} and world size {world_size}: both must be >= 1")
    if world_size % pp:
        raise ConfigError(f"PP degree {pp} does not divide world size {world_size}")
    layers, names = pipeline_of_model(os.path.abspath(model_config), dtype)
    if pp > len(layers):
        raise ConfigError(f"PP degree {pp}: the pipeline has {len(layers)} layers")
    try:
        return PipelineLayout(pp, world_size // pp, layers, pipeline_parts(layers, names, pp, method), stage=1)
    except LayoutMismatchError as err:
        raise ConfigError(f"PP degree {pp}: {err}") from None


def pp_plan_report(
    model_config: str,
    old_ws: int,
    new_ws: int,
    pp_from: int,
    pp_to: int,
    dtype: str = "bfloat16",
    assignment: str = "best",
    method: str = "parameters",
) -> dict:
    """:func:`~ds_dynatrain.cli.plan_tp.box_plan_report` of the change (a layer that changes stage
    moves its fp32 master with the two Adam moments, 12 bytes per element; its working parameters
    are made from the master), with both layouts' stage bounds.

    Raises:
        ConfigError: as :func:`pp_layout`.
    """
    old = pp_layout(model_config, old_ws, pp_from, dtype, method)
    t0 = time.perf_counter()
    new = pp_layout(model_config, new_ws, pp_to, dtype, method)
    head = {"model_config": model_config, "zero_stage": 1, "from": old_ws, "to": new_ws}
    head.update(pipeline_parallel_from=pp_from, pipeline_parallel_to=pp_to, dtype=dtype)
    head.update(stage_bounds_from=list(old.parts), stage_bounds_to=list(new.parts))
    return box_plan_report(old, new, plan_pp_transition, assignment, t0, head)
