"""The DeepSpeed bridge: reads ZeRO geometry and state out of a live engine and puts state back.

Everything that touches DeepSpeed internals lives here (``DeepSpeedZeroOptimizer`` of
``deepspeed/runtime/zero/stage_1_and_2.py``, ``DeepSpeedZeroOptimizer_Stage3`` of
``deepspeed/runtime/zero/stage3.py`` and its partitioned parameters, the ``_hp_mapping`` fragments of
``deepspeed/utils/tensor_fragment.py``, the cached groups of ``deepspeed.utils.groups`` and the
comm backend of ``deepspeed.comm``), so the rest of the plugin deals in layouts and flat tensors.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .errors import DynatrainError, LayoutMismatchError
from .layout import Fragment, ZeroLayout, param_metas_from_groups

MASTER = "fp32"  # state kind of the fp32 master partition


def zero_optimizer_of(engine):
    """The engine's ZeRO optimizer wrapper (stage 1/2 ``DeepSpeedZeroOptimizer`` or stage 3
    ``DeepSpeedZeroOptimizer_Stage3``).

    Raises:
        DynatrainError: the engine does not run ZeRO stage 1, 2 or 3.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    opt = engine.optimizer
    if not isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        raise DynatrainError(f"online resizing needs ZeRO stage 1, 2 or 3; the engine runs "
                             f"{type(opt).__name__} at ZeRO stage {engine.zero_optimization_stage()}")
    return opt


def is_zero3(opt) -> bool:
    """Whether ``opt`` (from :func:`zero_optimizer_of`) is the stage-3 optimizer."""
    return hasattr(opt, "fp32_partitioned_groups_flat")


def fp32_partitions(opt) -> List[torch.Tensor]:
    """This rank's fp32 master partitions, one 1-D tensor per partition (the optimizer's
    parameters): per parameter group at stages 1/2, per sub-group at stage 3."""
    return list(opt.fp32_partitioned_groups_flat if is_zero3(opt) else opt.single_partition_of_fp32_groups)


def working_partitions(opt) -> List[List[torch.nn.Parameter]]:
    """Per partition (see :func:`fp32_partitions`), the model parameters it holds, in its order."""
    return [list(g) for g in (opt.fp16_groups if is_zero3(opt) else opt.bit16_groups)]


def trainable_groups(opt) -> List[List[torch.nn.Parameter]]:
    """Per optimizer parameter group, its trainable parameters in group order."""
    if not is_zero3(opt):
        return [list(g) for g in opt.bit16_groups]
    out: Dict[int, list] = {}
    for i, sub in enumerate(opt.fp16_groups):
        out.setdefault(opt.sub_group_to_group_id[i], []).extend(sub)
    return [out[g] for g in sorted(out)]


def layout_of(engine) -> ZeroLayout:
    """The :class:`ZeroLayout` of a live ZeRO-1/2/3 engine, from its groups and config.

    Raises:
        LayoutMismatchError: (stage 3) DeepSpeed's sub-groups differ from the computed ones.
    """
    opt = zero_optimizer_of(engine)
    zcfg = engine._config.zero_config
    named = list(engine.module.named_parameters())
    if not is_zero3(opt):
        groups = param_metas_from_groups(named, opt.bit16_groups)
        return ZeroLayout(world_size=engine.dp_world_size, groups=groups,
                          round_robin=bool(zcfg.round_robin_gradients),
                          parameter_alignment=bool(zcfg.parameter_alignment), stage=engine.zero_optimization_stage())
    groups = param_metas_from_groups(named, trainable_groups(opt))
    layout = ZeroLayout(world_size=engine.dp_world_size, groups=groups, stage=3,
                        sub_group_size=int(opt.sub_group_size))
    names = {id(p): n for n, p in named}
    real = [tuple(names[id(p)] for p in sub) for sub in opt.fp16_groups]
    computed = [layout.partition_keys(b) for b in range(layout.num_partitions)]
    if real != computed or [layout.partition_numel(b) for b in range(layout.num_partitions)] != [
            int(n) for n in opt.fp16_partitioned_groups_flat_numel]:
        raise LayoutMismatchError(f"DeepSpeed's ZeRO-3 sub-groups {real} differ from the computed {computed}")
    return layout


def layout_for_model(named_params, groups, world_size: int, ds_config: dict, dtype: torch.dtype) -> ZeroLayout:
    """The layout DeepSpeed will build for ``groups`` of a model not yet wrapped by an engine.

    ``dtype`` is the working dtype the engine will cast parameters to (bf16/fp16/fp32).
    """
    metas = param_metas_from_groups(named_params, groups)
    dname = str(dtype).replace("torch.", "")
    metas = tuple(tuple(type(m)(m.key, m.shape, dname) for m in g) for g in metas)
    z = ds_config.get("zero_optimization", {})
    stage = int(z.get("stage", 0))
    if stage == 3:
        return ZeroLayout(world_size, metas, stage=3, sub_group_size=int(z.get("sub_group_size", 10**9)))
    return ZeroLayout(world_size, metas, bool(z.get("round_robin_gradients", False)),
                      bool(z.get("parameter_alignment", False)), stage)


def engine_fragments(engine) -> Tuple[Fragment, ...]:
    """The fragments this rank really holds, read from each parameter's ``_hp_mapping``.

    This is DeepSpeed's own account of the layout; tests compare it with
    :meth:`ZeroLayout.fragments`.
    """
    opt = zero_optimizer_of(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for gi, params in enumerate(opt.bit16_groups):
        for p in params:
            m = getattr(p, "_hp_mapping", None)
            if m is None:
                continue
            out.append(Fragment(gi, names[id(p)], m.lp_fragment_address.start, m.lp_fragment_address.numel,
                                m.hp_fragment_address.start))
    return tuple(sorted(out, key=lambda f: (f.group, f.local)))


def engine_storage_fragments(engine) -> Tuple[Fragment, ...]:
    """The fragments this rank holds, read from where each parameter's data really sits in the
    flat low-precision buffer of its group (``bit16_groups_flat``), cut at this rank's partition.

    This is the ground truth the fp32 partition is copied from. It agrees with ``_hp_mapping``
    except under ``round_robin_gradients``, where DeepSpeed 0.19.8 links ``_hp_mapping`` in the
    original parameter order although the flat buffer is in round-robin order.
    """
    opt = zero_optimizer_of(engine)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    if is_zero3(opt):
        # each parameter's piece (ds_tensor) sits in its sub-group's flat partition; rank r's
        # piece starts at r * piece of the parameter (partition_parameters.py ``_partition_param``)
        from deepspeed import comm as dist
        for b, flat in enumerate(opt.fp16_partitioned_groups_flat):
            rank = dist.get_rank(group=opt.sub_group_process_groups[b])
            for p in opt.fp16_groups[b]:
                piece = p.partition_numel()
                lo, hi = rank * piece, min((rank + 1) * piece, p.ds_numel)
                if lo < hi:
                    local = (p.ds_tensor.data_ptr() - flat.data_ptr()) // p.ds_tensor.element_size()
                    out.append(Fragment(b, names[id(p)], lo, hi - lo, local))
        return tuple(sorted(out, key=lambda f: (f.group, f.local)))
    for gi, flat in enumerate(opt.bit16_groups_flat):
        size = opt.single_partition_of_fp32_groups[gi].numel()
        lo_p = _dp_rank(opt, gi) * size
        for p in opt.bit16_groups[gi]:
            off = (p.data.data_ptr() - flat.data_ptr()) // p.element_size()
            lo, hi = max(off, lo_p), min(off + p.numel(), lo_p + size)
            if lo < hi:
                out.append(Fragment(gi, names[id(p)], lo - off, hi - lo, lo - lo_p))
    return tuple(sorted(out, key=lambda f: (f.group, f.local)))


@dataclass
class PartitionState:
    """One rank's optimizer state for every parameter group.

    Attributes:
        tensors: per group, ``{kind: 1-D fp32 tensor of the partition}``; kind ``"fp32"`` is the
            master partition, the others are optimizer states of the same shape (``exp_avg``,
            ``exp_avg_sq`` for Adam).
        scalars: per group, the optimizer states that are not partition-shaped (Adam's ``step``).
    """

    tensors: List[Dict[str, torch.Tensor]]
    scalars: List[Dict[str, Any]]

    def kinds(self, group: int) -> Tuple[str, ...]:
        return tuple(self.tensors[group])


def extract_partitions(engine) -> PartitionState:
    """References (no copies) to this rank's fp32 master partitions and their optimizer states."""
    opt = zero_optimizer_of(engine)
    tensors, scalars = [], []
    for fp32 in fp32_partitions(opt):
        state = opt.optimizer.state.get(fp32, {})
        kinds = {MASTER: fp32.detach()}
        sc = {}
        for k in sorted(state):
            v = state[k]
            if torch.is_tensor(v) and v.shape == fp32.shape:
                kinds[k] = v.detach()
            else:
                sc[k] = v.detach().clone() if torch.is_tensor(v) else v
        tensors.append(kinds)
        scalars.append(sc)
    return PartitionState(tensors, scalars)


def install_master(engine, masters: List[torch.Tensor]) -> None:
    """Copy received fp32 master partitions (one 1-D tensor per group) into a freshly built engine.

    Raises:
        LayoutMismatchError: a received partition has another size than the engine's.
    """
    opt = zero_optimizer_of(engine)
    for gi, fp32 in enumerate(fp32_partitions(opt)):
        if masters[gi].numel() != fp32.numel():
            raise LayoutMismatchError(f"parameter group {gi}: received partition of {masters[gi].numel()} elements, "
                                      f"engine partition has {fp32.numel()}")
        with torch.no_grad():
            fp32.copy_(masters[gi])


def install_optimizer_state(engine, tensors: List[Dict[str, torch.Tensor]], scalars: List[Dict[str, Any]]) -> None:
    """Create the optimizer state of a freshly built engine from received partitions.

    ``tensors[g]``: ``{kind: 1-D tensor}`` of group ``g`` (kinds other than the master; used as
    the state, not copied); ``scalars[g]``: non-partition states (Adam's ``step``). torch's Adam
    has no state before its first ``step``; the entry is created here, and DeepSpeed's fragment
    links (``_hp_mapping.optim_fragment``) are made so ``safe_get_full_optimizer_state`` sees it.

    Raises:
        LayoutMismatchError: a received partition has another size than the engine's.
    """
    opt = zero_optimizer_of(engine)
    any_state = False
    for gi, fp32 in enumerate(fp32_partitions(opt)):
        entry = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars[gi].items()}
        for k, v in tensors[gi].items():
            if k == MASTER:
                continue
            if v.numel() != fp32.numel():
                raise LayoutMismatchError(f"parameter group {gi}: received {k} of {v.numel()} elements, "
                                          f"engine partition has {fp32.numel()}")
            entry[k] = v.to(device=fp32.device).view_as(fp32)
        if entry:
            opt.optimizer.state[fp32] = entry
            any_state = True
    if any_state and not is_zero3(opt):  # stage 3 reads optimizer.state directly
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


@contextmanager
def light_rebuild(reuse_flat: Sequence[torch.Tensor] = ()):
    """While building a ZeRO-1/2 optimizer whose state is installed right after (a resize):

    * skip ``DeepSpeedZeroOptimizer.initialize_optimizer_states``: without offload and for
      optimizers that create their state lazily (everything but Adagrad), it only allocates a
      zero gradient partition and drops it again (deepspeed/runtime/zero/stage_1_and_2.py),
      which costs a full partition's page faults on the resize's critical path;
    * flatten the parameter groups in place when they already lie in one of ``reuse_flat`` (the
      old engine's flat buffers), long enough and in the order and padding DeepSpeed asks for
      (:func:`flat_in_place`; after a shrink). Parameters anywhere else are copied as DeepSpeed
      does: a client's own memory is never taken over.
    """
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    init_states = DeepSpeedZeroOptimizer.initialize_optimizer_states
    flatten = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned
    owned = {t.untyped_storage().data_ptr() for t in reuse_flat}

    def initialize_optimizer_states(self):
        if self.cpu_offload or isinstance(self.optimizer, torch.optim.Adagrad):
            return init_states(self)

    def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False, param_padding=None):
        reused = None
        if not use_cpu_data and tensor_list and tensor_list[0].untyped_storage().data_ptr() in owned:
            reused = flat_in_place(tensor_list, alignment, param_padding)
        return reused if reused is not None else flatten(self, tensor_list, alignment, use_cpu_data, param_padding)

    DeepSpeedZeroOptimizer.initialize_optimizer_states = initialize_optimizer_states
    DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned = flatten_dense_tensors_aligned
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer.initialize_optimizer_states = init_states
        DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned = flatten


def flat_in_place(tensors: List[torch.Tensor], alignment: int, padding=None):
    """The flat buffer DeepSpeed's ``flatten_dense_tensors_aligned`` would build from ``tensors``
    (each followed by ``padding[i]`` zeros, the total padded to a multiple of ``alignment``), as
    a view of the storage they already live in, or None.

    After a shrink the parameters still sit in the old engine's flat buffer, in the same order
    and with the same per-parameter padding; only the tail padding depends on the world size.
    When the old buffer is long enough, the new one is a view of it (the tail zeroed) instead of
    a copy of every parameter.
    """
    if not tensors:
        return None
    first = tensors[0]
    storage, el = first.untyped_storage(), first.element_size()
    base = first.storage_offset()
    pos = 0
    for i, t in enumerate(tensors):
        if (t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != base + pos):
            return None
        pos += t.numel() + (padding[i] if padding else 0)
    total = -(-pos // alignment) * alignment
    if (base + total) * el > storage.nbytes():
        return None
    flat = torch.empty(0, dtype=first.dtype, device=first.device).set_(storage, base, (total,))
    with torch.no_grad():
        # per-parameter padding and the tail: zeros, as DeepSpeed's copy would have them
        pos = 0
        for i, t in enumerate(tensors):
            pos += t.numel()
            pad = padding[i] if padding else 0
            if pad:
                flat[pos:pos + pad].zero_()
            pos += pad
        flat[pos:].zero_()
    return flat.detach()


def relink_optimizer_state(engine) -> None:
    """Link every ``_hp_mapping`` to the optimizer state again.

    DeepSpeed 0.19.8's ``load_checkpoint`` re-creates the fragments of ZeRO-1/2 parameters but
    leaves its "already linked" flag set, so ``safe_get_full_optimizer_state`` fails until the
    next step; this repairs the links at once.
    """
    opt = zero_optimizer_of(engine)
    if is_zero3(opt):
        return
    if all(f in opt.optimizer.state for f in opt.single_partition_of_fp32_groups):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def gather_whole_params(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter of a ZeRO-3 module, gathered whole (``name -> full tensor``, a copy in the
    working dtype). Collective over the parameters' data-parallel group: every rank of the
    engine calls it. One parameter at a time, so the transient memory is one parameter beyond
    the copies.
    """
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    out = {}
    for name, p in module.named_parameters():
        with GatheredParameters([p]):
            out[name] = p.data.detach().clone()
    return out


# attributes DeepSpeed's ZeRO-3 attaches to modules besides those named ``ds_*``
# (deepspeed/runtime/zero/parameter_offload.py, partition_parameters.py, deepspeed 0.19.8)
ZERO3_MODULE_ATTRS = frozenset({"_external_params", "_original_parameters", "all_parameters",
                                "applied_pre_backward_ref_cnt", "pre_bwd_fn", "post_bwd_fn", "to_empty"})


def client_attrs(module: torch.nn.Module) -> Dict[str, frozenset]:
    """The attribute names of every parameter (``"param:<name>"``) and submodule
    (``"module:<name>"``) of a model no engine has touched yet: what
    :func:`release_zero3_params` keeps."""
    out = {f"param:{n}": frozenset(vars(p)) for n, p in module.named_parameters()}
    out.update({f"module:{n}": frozenset(vars(m)) for n, m in module.named_modules()})
    return out


def release_zero3_params(module: torch.nn.Module, whole: Dict[str, torch.Tensor],
                         own_attrs: Dict[str, frozenset]) -> None:
    """Turn the ZeRO-3 parameters of a detached engine back into plain parameters holding
    ``whole`` (from :func:`gather_whole_params`), so a new engine partitions them afresh.

    DeepSpeed's ZeRO-3 set-up skips parameters and modules that carry its attributes (it treats
    them as converted already; a module keeps backward hooks bound to the old engine), so:

    * every attribute DeepSpeed attached to a parameter (``ds_tensor``, ``ds_id``,
      ``all_gather``, ...) is removed, keeping those in ``own_attrs`` (:func:`client_attrs`);
    * every ``ds_*`` attribute and those of :data:`ZERO3_MODULE_ATTRS` are removed from the
      submodules (again keeping the client's own), and each module's parameter dict is a plain
      dict again (ZeRO-3 replaces it with one that gathers on access).

    The Parameter objects stay the same, so tied parameters stay tied and references held by
    the caller stay valid.

    Raises:
        LayoutMismatchError: ``whole`` lacks a parameter of the module.
    """
    from deepspeed.runtime.zero import parameter_offload
    for name, p in module.named_parameters():
        if name not in whole:
            raise LayoutMismatchError(f"no whole copy of parameter {name} to rebuild the ZeRO-3 engine from")
        keep = own_attrs.get(f"param:{name}", frozenset())
        for attr in list(vars(p)):
            if attr not in keep:
                delattr(p, attr)
        p.data = whole[name]
    for name, m in module.named_modules():
        keep = own_attrs.get(f"module:{name}", frozenset())
        for attr in list(vars(m)):
            if attr not in keep and (attr.startswith("ds_") or attr in ZERO3_MODULE_ATTRS):
                delattr(m, attr)
        if type(m._parameters) is not dict:
            m._parameters = dict(m._parameters.items())
    stack = parameter_offload.FWD_MODULE_STACK  # the engine pushed its module at set-up
    while stack and stack[-1] is module:
        stack.pop()
    reset_zero3_counters()


def reset_zero3_counters() -> None:
    """Start DeepSpeed's ZeRO-3 process-wide counters from 0 again, as in a fresh process.

    Module ids come from a counter kept in a default argument of
    ``DeepSpeedZeRoOffload._register_deepspeed_module``, parameter ids from ``Init.param_id``, and
    the persistent-parameter budget from ``Init.num_persisted_*``; all run on across engines in
    one process. Every rank checks that all ranks trace the same module and parameter ids, and a
    process joining the job starts from 0, so a rebuilt engine must too.
    """
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partition_parameters import Init
    parameter_offload.DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 0
    Init.param_id = 0
    Init.num_persisted_parameters = 0
    Init.num_persisted_elements = 0


def _dp_rank(opt, group: int) -> int:
    from deepspeed import comm as dist
    return dist.get_rank(group=opt.real_dp_process_group[group])


def reset_deepspeed_comm() -> None:
    """Forget DeepSpeed's cached comm backend and process groups.

    DeepSpeed caches its backend (``deepspeed.comm.comm.cdb``) and groups
    (``deepspeed.utils.groups``) in module globals; after the default process group is destroyed
    and re-formed for a new generation these must be reset, or the next engine would use the dead
    group.
    """
    import deepspeed.comm.comm as dcomm
    import deepspeed.utils.groups as groups
    dcomm.cdb = None
    groups._WORLD_GROUP = None
    groups._DATA_PARALLEL_GROUP = None
    groups._MODEL_PARALLEL_GROUP = None
    groups._TENSOR_MODEL_PARALLEL_GROUP = None
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    groups._EXPERT_PARALLEL_GROUP = {}
    groups._EXPERT_PARALLEL_GROUP_RANKS = {}
    groups._EXPERT_DATA_PARALLEL_GROUP = {}
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS = {}
    groups._ALL_TO_ALL_GROUP = {}
    groups.mesh_device = None
    groups.mpu = None


def detach_engine(engine) -> None:
    """Remove everything a built engine hooked into the model, so it can be rebuilt in place.

    Raises:
        DynatrainError: hooks remain on the model after the engine's own teardown (a DeepSpeed
            feature we do not know how to detach), rather than train with two engines hooked in.
    """
    for attr in ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check"):
        h = getattr(engine, attr, None)
        if h is not None:
            h.remove()
            setattr(engine, attr, None)
    engine.destroy()


def count_module_hooks(module: torch.nn.Module) -> int:
    """Forward/backward hooks registered on ``module`` and its children (to prove a detach)."""
    n = 0
    for m in module.modules():
        n += len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
        n += len(getattr(m, "_backward_pre_hooks", {}))
    return n
