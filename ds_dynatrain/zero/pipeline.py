"""The :class:`~ds_dynatrain.vps.pipeline.PipelineLayout` of a DeepSpeed ``PipelineModule`` at any
PP degree, from its layer list alone (deepspeed 0.19.8, ``runtime/pipe/module.py``).

The stage bounds come from DeepSpeed's own partition functions (``runtime/utils.py``:
``partition_uniform``, ``partition_balanced``) on the weights ``PipelineModule._partition_layers``
gives them. No layer of another stage is built for real: a ``LayerSpec`` is built on the meta
device (no memory, the random generators untouched) to read its parameters' names and shapes,
where ``PipelineModule`` builds every spec once on every rank to count them (method
``parameters``).
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

import torch

from ..errors import ConfigError
from ..vps.layout import ParamMeta
from ..vps.pipeline import TIED_PREFIX, PipelineLayer, PipelineLayout

PARTITION_METHODS = ("parameters", "uniform", "type:<regex>")


def meta_build(spec) -> torch.nn.Module:
    """``spec.build()`` on the meta device, the random generators left as they were; built for
    real where the layer cannot be made on meta (a layer that fills itself from numpy)."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return spec.build()
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return spec.build()


def pipeline_layers(module, dtype: str) -> Tuple[PipelineLayer, ...]:
    """Every entry of ``module``'s layer list as a :class:`PipelineLayer`: its trainable
    parameters under ``PipelineModule``'s stage-independent names (``"<index>.<sub>"``,
    ``"tied_modules.<key>.<sub>"``), shapes from a meta build, dtype ``dtype`` (the job's working
    dtype, e.g. ``"float32"``)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    tied: Dict[str, Tuple[ParamMeta, ...]] = {}
    out: List[PipelineLayer] = []
    for idx, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                built = meta_build(spec)
                tied[spec.key] = _metas(built, f"{TIED_PREFIX}{spec.key}.", dtype)
            out.append(PipelineLayer(tied[spec.key], spec.key))
        elif isinstance(spec, LayerSpec):
            out.append(PipelineLayer(_metas(meta_build(spec), f"{idx}.", dtype)))
        elif isinstance(spec, torch.nn.Module):
            out.append(PipelineLayer(_metas(spec, f"{idx}.", dtype)))
        else:  # a function: no parameters
            out.append(PipelineLayer())
    return tuple(out)


def _metas(layer: torch.nn.Module, prefix: str, dtype: str) -> Tuple[ParamMeta, ...]:
    return tuple(ParamMeta(prefix + n, tuple(p.shape), dtype) for n, p in layer.named_parameters() if p.requires_grad)


def layer_type_names(module) -> List[str]:
    """The name ``PipelineModule._find_layer_type`` matches for each layer: a spec's class, a
    module's class, a function's ``__name__`` (``None`` for an entry without one)."""
    from deepspeed.pipe import LayerSpec

    names = []
    for spec in module._layer_specs:
        if isinstance(spec, LayerSpec):
            names.append(spec.typename.__name__)
        elif isinstance(spec, torch.nn.Module):
            names.append(spec.__class__.__name__)
        else:
            names.append(getattr(spec, "__name__", None))
    return names


def pipeline_parts(
    layers: Sequence[PipelineLayer], type_names: Sequence, pp: int, method: str = "parameters"
) -> Tuple[int, ...]:
    """The stage bounds ``PipelineModule`` computes for ``pp`` stages with ``method``
    (``parameters``: each layer weighted by its trainable elements, a tied layer at every
    appearance; ``uniform``; ``type:<regex>``: weight 1 where the layer's class name matches,
    case-insensitive), by DeepSpeed's own ``partition_uniform`` / ``partition_balanced``.

    Raises:
        ConfigError: an unknown method (``profile`` is not implemented by DeepSpeed either), or a
            ``type:`` pattern no layer matches.
    """
    from deepspeed.runtime import utils as ds_utils

    m = method.lower()
    if m == "uniform":
        parts = ds_utils.partition_uniform(num_items=len(layers), num_parts=pp)
    elif m == "parameters":
        weights = [sum(p.numel for p in layer.params) for layer in layers]
        parts = ds_utils.partition_balanced(weights=weights, num_parts=pp)
    elif m.startswith("type:"):
        pattern = re.compile(m.split(":", 1)[1], re.IGNORECASE)
        weights = [1 if n is not None and pattern.search(n) else 0 for n in type_names]
        if not any(weights):
            raise ConfigError(f"pipeline partition method {method!r}: no layer's class matches")
        parts = ds_utils.partition_balanced(weights=weights, num_parts=pp)
    else:
        raise ConfigError(f"pipeline partition method {method!r}: one of {', '.join(PARTITION_METHODS)}")
    return tuple(int(x) for x in parts)


def pipeline_layout(module, pp: int, world_size: int, dtype: str, method: str = "parameters", **zero) -> PipelineLayout:
    """The layout of ``module``'s model at ``pp`` stages over ``world_size`` processes (DP
    ``world_size // pp``), split as ``method`` splits it, with the ZeRO settings ``zero``
    (``stage``, ``round_robin``, ``parameter_alignment``, ``sub_group_size``, and
    ``optimizer_groups``, :class:`PipelineLayout`).

    Raises:
        ConfigError: an unknown partition method.
        LayoutMismatchError: the split leaves a stage without a layer or a trainable parameter.
    """
    layers = pipeline_layers(module, dtype)
    parts = pipeline_parts(layers, layer_type_names(module), pp, method)
    return PipelineLayout(pp, world_size // pp, layers, parts, **zero)
