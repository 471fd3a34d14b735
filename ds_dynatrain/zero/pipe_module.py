"""A ``PipelineModule`` rebuilt at another number of stages from a live one's layer list, and the
pipeline globals DeepSpeed keeps between builds (deepspeed 0.19.8: ``runtime/pipe/module.py``,
``runtime/pipe/p2p.py``, ``utils/groups.py``)."""

from __future__ import annotations

import weakref
from typing import List, Optional, Sequence

import torch

from ..errors import LayoutMismatchError
from .pipeline import meta_build

# what PipelineModule keeps of its constructor's arguments, under the same names
_KEPT = (
    "loss_fn",
    "seed_layers",
    "seed_fn",
    "base_seed",
    "activation_checkpoint_interval",
    "activation_checkpoint_func",
    "checkpointable_layers",
    "dynamic_shape",
)


def reset_pipeline_globals() -> None:
    """Forget DeepSpeed's cached groups and the p2p module's grid, as a new ``PipelineModule``
    (which makes its own grid and groups) expects to find them."""
    import deepspeed.runtime.pipe.p2p as p2p
    from deepspeed.utils import groups

    groups._release_process_group_references()
    p2p._grid = None
    p2p._groups = None


def check_rebuildable(module) -> None:
    """Raise :class:`LayoutMismatchError` when ``module`` holds what a rebuild at another degree
    would lose: a persistent buffer (not moved yet; a non-persistent one is made again by the
    layer's constructor), a frozen parameter (the optimizer, whose state moves, does not hold
    it), or a topology with a model (TP) axis."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    params = dict(module.named_parameters())
    buffers = [n for n in module.state_dict() if n not in params]
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if buffers or frozen:
        what = ", ".join((buffers + frozen)[:4])
        raise LayoutMismatchError(
            f"a pipeline whose layers hold buffers or frozen parameters cannot change PP yet: {what}"
        )
    if not isinstance(module._topo, PipeDataParallelTopology):
        raise LayoutMismatchError(f"a pipeline topology {type(module._topo).__name__}: only PP x DP can change PP")


def pipeline_module_at(old, pp: int, partition_method: str, layer_params: Optional[Sequence[int]] = None):
    """A new ``PipelineModule`` of ``old``'s layer list and settings at ``pp`` stages over the
    same processes, split by ``partition_method``; the random generators are left as they were.

    Its parameters are left unwritten (their values are installed next) where no layer of the list
    holds a buffer: the module is built on the meta device (this stage's layers cost no memory and
    no initialisation) and moved to the CPU empty, where ``PipelineModule.__init__`` moves it to
    the device. A layer list with buffers is built for real (a buffer's value comes from its
    layer's constructor). ``layer_params``, when given, is each layer's count of trainable
    elements (:func:`layer_param_counts` of the job's pipeline layout): DeepSpeed's
    ``partition_balanced`` then splits those weights instead of building every layer once more to
    count them (``_count_layer_params``, method ``parameters``); the stage bounds it picks are
    checked against the layout after the rebuild as always.

    Collective: every process of the world calls it (the module makes its groups). Call after
    :func:`reset_pipeline_globals`.
    """
    from deepspeed.pipe import PipelineModule

    kwargs = {k: getattr(old, k) for k in _KEPT}
    specs = list(old._layer_specs)
    with torch.random.fork_rng(devices=[]):
        if _any_buffer(specs):
            return PipelineModule(layers=specs, num_stages=pp, partition_method=partition_method, **kwargs)
        with torch.device("meta"):
            module = _empty_built(PipelineModule, layer_params)(
                layers=specs, num_stages=pp, partition_method=partition_method, **kwargs
            )
    module.__class__ = PipelineModule
    return module


def layer_param_counts(layout) -> List[int]:
    """Trainable elements of each entry of a :class:`~ds_dynatrain.vps.pipeline.PipelineLayout`'s
    layer list (a tied layer's at each of its entries, as DeepSpeed counts a ``TiedLayerSpec``):
    the weights ``PipelineModule._count_layer_params`` gives ``partition_balanced``."""
    return [sum(p.numel for p in layer.params) for layer in layout.layers]


def _empty_built(base, layer_params: Optional[Sequence[int]] = None):
    """``base`` (``PipelineModule``) whose constructor's move to the device allocates its meta
    parameters there unwritten (``to_empty``), and whose count of each layer's parameters is
    ``layer_params`` when given."""

    class EmptyBuilt(base):
        def to(self, *args, **kwargs):
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            return self.to_empty(device=device)

        def _count_layer_params(self):
            if layer_params is None:
                return super()._count_layer_params()
            return list(layer_params)

    return EmptyBuilt


# whether a layer spec builds a layer with a buffer: the same at every rebuild of one job
_BUFFERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _any_buffer(specs) -> bool:
    """Whether a layer of the list holds a buffer (each spec built on the meta device once in the
    process's life: the answer is remembered for the spec object)."""
    from deepspeed.pipe import LayerSpec

    for spec in specs:
        if isinstance(spec, LayerSpec):
            if _spec_has_buffer(spec):
                return True
        elif isinstance(spec, torch.nn.Module) and next(spec.buffers(), None) is not None:
            return True
    return False


def _spec_has_buffer(spec) -> bool:
    """Whether the layer ``spec`` builds holds a buffer, built on the meta device the first time
    and remembered in :data:`_BUFFERED` (not for a spec class that cannot be a weak key)."""
    try:
        return _BUFFERED[spec]
    except KeyError:
        cacheable = True
    except TypeError:  # unhashable or not weakly referable: built every time
        cacheable = False
    known = next(meta_build(spec).buffers(), None) is not None
    if cacheable:
        _BUFFERED[spec] = known
    return known
