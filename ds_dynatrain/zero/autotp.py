"""Where DeepSpeed AutoTP cuts a Hugging Face model, from the model alone (it may live on the
meta device): the :class:`~ds_dynatrain.vps.tensor_parallel.TpSplit` of every parameter.

DeepSpeed 0.19.8 takes the model's Hugging Face ``tp_plan`` (``runtime/tensor_parallel/config.py``
``_get_hf_tp_plan``), turns it into layer specs (``module_inject/tp_plan_converter.py``) and
replaces each matching linear (``module_inject/auto_tp.py``, ``layers.py``):

* a column-parallel spec (``colwise``, ``colwise_gather_output``) cuts the weight and the bias
  on dimension 0;
* a row-parallel spec (``rowwise``) cuts the weight on dimension 1 and leaves the bias whole;
* ``embedding_rowwise`` and the parameters no spec names stay whole on every TP rank, except an
  embedding tied to a column-parallel head: the pair is one parameter, cut on dimension 0 as the
  head (vocab-parallel);
* the sizes come from ``module_inject/tp_shard.get_shard_size_list`` with the model's
  ``AutoTPMeta`` and the module's name (KV-head groups stay whole, so GQA splits are uneven).

The same functions are called here, so the split is DeepSpeed's own; ``tests/test_tp_layout_vs_deepspeed.py``
checks it against the ``ds_autotp_uc_meta`` of real AutoTP engines.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from ..errors import LayoutMismatchError
from ..vps.tensor_parallel import TpSplit


def autotp_splits(model: torch.nn.Module, tp: int, tp_grain_size: int = 1) -> Dict[str, TpSplit]:
    """``{VPS key: TpSplit}`` of the parameters AutoTP cuts at degree ``tp`` (empty at 1).

    Keys are ``model.named_parameters()`` names (a tied pair under its first name).

    Raises:
        LayoutMismatchError: the model has no Hugging Face ``tp_plan`` (the heuristic and
            ``partition_config`` routes are not described), or a spec cuts sub-parameters
            (``shape=``: fused QKV), which these layouts do not describe.
        ValueError: ``tp`` below 1.
    """
    from deepspeed.module_inject.autotp_config import PartitionType
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    if tp < 1:
        raise ValueError(f"TP degree must be >= 1, got {tp}")
    if tp == 1:
        return {}
    specs = TPPlanConverter.convert(_get_hf_tp_plan(model) or {})
    if not specs:
        raise LayoutMismatchError(
            f"{type(model).__name__} has no Hugging Face tp_plan: only AutoTP's tp_plan route is described"
        )
    meta = AutoTPMeta.from_model_config(getattr(model, "config", None), tp_grain_size)
    names: Dict[int, List[str]] = {}  # every name of each parameter object (a tied pair has two)
    for mod_name, mod in model.named_modules():
        for leaf, p in mod.named_parameters(recurse=False):
            names.setdefault(id(p), []).append(f"{mod_name}.{leaf}" if mod_name else leaf)
    out = {}
    for key, p in model.named_parameters():
        for name in names[id(p)]:
            module_name, _, leaf = name.rpartition(".")
            spec = next((s for s in specs if s.matches(f"{module_name}.weight")), None)
            if spec is None or spec.partition_type == PartitionType.SKIP:
                continue
            if spec.shape is not None:
                raise LayoutMismatchError(f"{name}: AutoTP cuts sub-parameters (shape=), not described here")
            dim = 0 if spec.partition_type == PartitionType.COLUMN else (1 if leaf == "weight" else None)
            if dim is not None and p.dim() > dim:
                sizes = get_shard_size_list(p.shape[dim], tp, meta, module_name)
                out[key] = TpSplit(dim, tuple(int(s) for s in sizes))
            break
    return out
