"""A saved checkpoint opened for reading: every file of the saving world checked complete, the saved
layout rebuilt from metadata, tensors read only where asked.

A checkpoint directory holds, per saving rank, DeepSpeed's optimizer-state file
(``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: the rank's fp32 master partitions and their
Adam moments) and the model-state file(s) (``mp_rank_00_model_states.pt`` at ZeRO-1/2, one
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank at ZeRO-3), written either by the
snapshot engine (this project's format: raw tensors at aligned offsets, a footer) or by
DeepSpeed's default engine (``torch.save`` zip files).

The saved layout comes from the saved world size, ZeRO settings and ``param_shapes`` of the
model-state file, checked against the live model and against every partition's size (and, in this
project's files, against the fragments each partition's footer item records). Before anything is
read, every file of the saving world is checked present and complete
(:class:`~ds_dynatrain.errors.CheckpointIncompleteError` lists every missing or damaged file).
"""

from __future__ import annotations

import os
import re
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointNotPartitionedError,
    LayoutMismatchError,
)
from ..vps.layout import DEFAULT_SUB_GROUP_SIZE, ParamMeta, ZeroLayout
from .footer import fragment_mismatches
from .saved_file import SavedFile, TensorRef, is_snapshot_file

MODEL_FILE = "mp_rank_00_model_states.pt"  # ZeRO-1/2: one, written by rank 0
MODEL_FILE_ZERO3 = "zero_pp_rank_{}_mp_rank_00_model_states.pt"  # ZeRO-3: one per rank
# an AutoTP checkpoint: the same files once per TP rank (``mp_rank_<t>``, two digits)
OPTIM_FILE_TP = "zero_pp_rank_{}_mp_rank_{:02d}_optim_states.pt"
MODEL_FILE_TP = "mp_rank_{:02d}_model_states.pt"
MODEL_FILE_ZERO3_TP = "zero_pp_rank_{}_mp_rank_{:02d}_model_states.pt"
LAYER_FILE = "layer_{:02d}-model_states.pt"  # a pipeline's, one per layer (PipelineModule.ckpt_layer_path)
LAYER_FILE_RE = re.compile(r"layer_(\d+)-model_states\.pt")
MOMENTS = ("exp_avg", "exp_avg_sq")


# the first bytes of torch's legacy (non-zip) format: its magic number, pickled with protocol 2
_TORCH_LEGACY_HEAD = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."


def resolve_tag(load_dir: str, tag: Optional[str]) -> str:
    """``tag``, or the one ``load_dir/latest`` names; either must name a directory directly
    under ``load_dir`` (:func:`io_engine.check_tag`: no separators, no ``..``).

    Raises:
        CheckpointIncompleteError: no tag given and no ``latest``; ``latest`` is not UTF-8 text,
            empty, or names a path or a missing directory; ``tag`` is a path.
    """
    from io_engine import BadLatestError, check_tag, read_latest

    try:
        if tag is not None:
            return check_tag(load_dir, str(tag), f"tag {str(tag)!r}")
        found = read_latest(load_dir)
    except BadLatestError as err:
        raise CheckpointIncompleteError(f"{load_dir}: {err}") from None
    if found is None:
        raise CheckpointIncompleteError(f"{load_dir}: no tag given and no 'latest' file")
    return found


def _shape_of(x) -> Tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, TensorRef) else tuple(x.shape)


def numel_of(x) -> int:
    return x.numel()


@dataclass
class RankPartitions:
    """One saving rank's partitions: ``tensors[b][kind]`` (tensor or :class:`TensorRef`) and the
    non-partition optimizer states ``scalars[b]`` (Adam's ``step``)."""

    tensors: List[Dict[str, Any]]
    scalars: List[Dict[str, Any]]


def partitions_of(tree: dict, stage: int) -> RankPartitions:
    """The partitions in one optimizer-state file's dict.

    Paths (deepspeed 0.19.8): stages 1/2 ``optimizer_state_dict/single_partition_of_fp32_groups/<g>``
    and ``optimizer_state_dict/base_optimizer_state/<g>/<state>`` (``DeepSpeedZeroOptimizer.
    state_dict``; both without the last rank's alignment padding); stage 3
    ``optimizer_state_dict/fp32_flat_groups/<g>`` and
    ``optimizer_state_dict/optimizer_state_dict/state/<g>/<state>`` (``_rigid_state_dict``).
    Partition-shaped states are the 1-D tensors of more than one element; 0-dimensional ones
    (``step``) and other values are scalars.

    Raises:
        CheckpointIncompleteError: the dict lacks those entries.
    """
    try:
        osd = tree["optimizer_state_dict"]
        if stage == 3:
            masters = list(osd["fp32_flat_groups"])
            states = osd["optimizer_state_dict"]["state"]
            per = [states.get(b, {}) for b in range(len(masters))]
        else:
            masters = list(osd["single_partition_of_fp32_groups"])
            base = osd["base_optimizer_state"]
            if isinstance(base, dict) and "state" in base:
                per = [base["state"].get(b, {}) for b in range(len(masters))]
            else:
                per = list(base)
    except (KeyError, TypeError) as err:
        raise CheckpointIncompleteError(f"optimizer-state file without ZeRO-{stage} partitions ({err!r})") from None
    tensors, scalars = [], []
    for b, m in enumerate(masters):
        kinds = {"fp32": m}
        sc = {}
        for k, v in sorted(per[b].items()):
            if isinstance(v, (torch.Tensor, TensorRef)) and len(_shape_of(v)) == 1 and numel_of(v) > 1:
                kinds[k] = v
            else:
                sc[k] = v
        tensors.append(kinds)
        scalars.append(sc)
    return RankPartitions(tensors, scalars)


def _step_of(f: SavedFile, value) -> int:
    """Adam's ``step`` of a partition as an int (read from ``f`` when left unread).

    Raises:
        CheckpointCorruptError: its bytes fail their checksum.
    """
    if isinstance(value, TensorRef):
        out = torch.empty(max(value.numel(), 1), dtype=value.dtype)
        f.read_into([(value, 0, out)])
        value = out[0]
    return int(float(value))


def check_parameters(saved_shapes: Dict[str, Tuple[int, ...]], live: ZeroLayout, where: str) -> None:
    """The trainable parameters a checkpoint records (``name -> shape``) are the live layout's:
    the same names, the same shapes.

    Raises:
        LayoutMismatchError: the first parameter of the model missing from the checkpoint (in
            ``where``) or of another shape, else the first of the checkpoint's the model does not train.
    """
    for gi, params in enumerate(live.groups):
        for p in params:
            if p.key not in saved_shapes:
                raise LayoutMismatchError(
                    f"parameter group {gi}: parameter {p.key} {list(p.shape)} of the model "
                    f"is not in the checkpoint {where}"
                )
            if saved_shapes[p.key] != tuple(p.shape):
                raise LayoutMismatchError(
                    f"parameter group {gi}: {p.key} is {list(saved_shapes[p.key])} in the checkpoint "
                    f"and {list(p.shape)} in the model"
                )
    live_keys = {p.key for g in live.groups for p in g}
    for name, shape in saved_shapes.items():
        if name not in live_keys:
            raise LayoutMismatchError(
                f"checkpoint parameter {name} {list(shape)} is not a trainable parameter of the model"
            )


class SavedCheckpoint:
    """A checkpoint directory at one tag, checked complete, with its saved layout.

    Attributes:
        dir: ``load_dir/tag``.  world_size: the saving data-parallel world size.  mp: the saving
        model-parallel size (``mp_world_size``: one set of files per TP rank or pipeline stage,
        ``mp_rank_XX`` in their names; the files of every one are checked).  pp: the saving
        pipeline degree (``checkpoint_parallel_dimensions``; 1 when not recorded).  tp: the saving
        AutoTP degree (``mp // pp``; 1 without TP).
        stage: ZeRO stage.  step: ``global_steps`` at the save.  model_state: rank 0's model-state dict
        (large tensors of this project's files left unread, see :class:`SavedFile`).

    Raises:
        CheckpointIncompleteError: naming every missing, truncated or damaged file.
    """

    def __init__(self, load_dir: str, tag: Optional[str] = None):
        self.tag = resolve_tag(load_dir, tag)
        self.dir = os.path.join(load_dir, self.tag)
        if not os.path.isdir(self.dir):
            raise CheckpointIncompleteError(f"no checkpoint directory {self.dir}")
        first = os.path.join(self.dir, MODEL_FILE)
        if not os.path.isfile(first):
            first = os.path.join(self.dir, MODEL_FILE_ZERO3.format(0))
        if not os.path.isfile(first):
            raise CheckpointIncompleteError(
                f"{self.dir}: missing model-state file ({MODEL_FILE} or {MODEL_FILE_ZERO3.format(0)})"
            )
        self._optim: Dict[Tuple[int, int], SavedFile] = {}
        self._models: Dict[Any, SavedFile] = {}  # by TP rank, or by name (ZeRO-3 ranks other than 0)
        self.model_file = SavedFile(first)
        try:
            self._read_metadata(first)
        except BaseException:
            self.close()  # a refused checkpoint leaves no file open
            raise

    def _read_metadata(self, first: str) -> None:
        self.model_state = self.model_file.tree
        try:
            self.world_size = int(self.model_state["dp_world_size"])
            self.mp = max(int(self.model_state.get("mp_world_size") or 1), 1)
            dims = self.model_state.get("checkpoint_parallel_dimensions") or {}
            self.pp = max(int(dims.get("pp_degree") or 1), 1) if isinstance(dims, dict) else 1
            self.ds_config = dict(self.model_state.get("ds_config") or {})
            self.stage = int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))
            self.step = int(self.model_state.get("global_steps", 0))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointIncompleteError(f"{first}: not a DeepSpeed model-state file ({err!r})") from None
        if self.stage not in (1, 2, 3):
            raise CheckpointNotPartitionedError(
                f"{self.dir}: saved at ZeRO stage {self.stage}; only ZeRO-1/2/3 "
                "partitions can be loaded onto another world size"
            )
        if self.mp % self.pp:
            raise CheckpointIncompleteError(
                f"{first}: {self.mp} model-parallel ranks cannot hold {self.pp} pipeline stages"
            )
        self.tp = self.mp // self.pp
        self.files = self.expected_files()
        self.check_complete()
        self.check_one_step()

    def expected_files(self) -> List[str]:
        """Every file the saving world wrote (paths); a pipeline's layer files too
        (:meth:`layer_files`)."""
        names = self.layer_files()
        for t in range(self.mp):
            names += [self.optim_name(r, t) for r in range(self.world_size)]
            if self.stage == 3:
                names += [MODEL_FILE_ZERO3_TP.format(r, t) for r in range(self.world_size)]
            else:
                names.append(MODEL_FILE_TP.format(t))
        return [os.path.join(self.dir, n) for n in names]

    def layer_files(self) -> List[str]:
        """A pipeline checkpoint's layer files (names): those in the directory, and one for every
        layer index a stage's parameters name (``<index>.<sub>`` in its ``param_shapes``), present
        or not; a tied layer's file is only checked when present (its index is not recorded)."""
        indices = {int(m.group(1)) for n in os.listdir(self.dir) if (m := LAYER_FILE_RE.fullmatch(n))}
        if self.pp == 1 and not indices:
            return []
        for s in range(self.mp):
            try:
                shapes = self.model_state_of(s).get("param_shapes") or []
            except CheckpointIncompleteError:
                continue  # a missing or damaged model-state file: check_complete names it
            indices |= {int(n.split(".", 1)[0]) for g in shapes for n in g if str(n).split(".", 1)[0].isdigit()}
        return [LAYER_FILE.format(i) for i in sorted(indices)]

    def check_complete(self) -> None:
        """Every file of the saving world present and complete (this project's files: header,
        footer and size; DeepSpeed's: the zip directory), before any is loaded.

        Raises:
            CheckpointIncompleteError: listing every missing or damaged file.
        """
        from io_engine import read_footer
        from io_engine.errors import IOEngineError

        problems = []
        for path in self.files:
            name = os.path.basename(path)
            if not os.path.isfile(path):
                problems.append(f"{name}: missing")
                continue
            try:
                if is_snapshot_file(path):
                    problems += [f"{name}: {p}" for p in self._identity_problems(name, read_footer(path).file_attrs)]
                elif zipfile.is_zipfile(path):
                    with zipfile.ZipFile(path) as z:
                        z.namelist()
                elif os.path.getsize(path) == 0:
                    problems.append(f"{name}: empty")
                else:
                    with open(path, "rb") as f:
                        head = f.read(len(_TORCH_LEGACY_HEAD))
                    if head != _TORCH_LEGACY_HEAD:
                        problems.append(
                            f"{name}: damaged (neither this project's format nor torch's: starts {head[:8]!r})"
                        )
                # torch's legacy format has no directory to check: a damaged file is found when it
                # is read, and every rank agrees on that before anything is installed
            except (IOEngineError, zipfile.BadZipFile, OSError) as err:
                problems.append(f"{name}: damaged ({err})")
        if problems:
            raise CheckpointIncompleteError(
                f"checkpoint {self.dir} (saved by {self._saving_world()} at ZeRO stage {self.stage}) is incomplete: "
                + "; ".join(problems)
            )

    def check_one_step(self) -> None:
        """Every file of the saving world is of one save: the ``global_steps`` of every model-state
        file, and Adam's ``step`` of every partition of every optimizer-state file, are the same
        (every partition of a ZeRO job steps together). A file copied in from another save of the
        same job (an older stage's or rank's) is otherwise loaded without a word, the model mixed
        from two steps. DeepSpeed's own files carry no checksum or step in their names; this is
        what tells them apart.

        Raises:
            CheckpointIncompleteError: naming the files of each step found.
        """
        found: Dict[str, Dict[int, List[str]]] = {"global_steps": {}, "Adam step": {}}
        for t in range(self.mp):
            for r in range(self.world_size if self.stage == 3 else 1):
                name = MODEL_FILE_ZERO3_TP.format(r, t) if self.stage == 3 else MODEL_FILE_TP.format(t)
                try:
                    tree = self.model_state_of(t) if r == 0 else self._model_tree(name)
                except CheckpointCorruptError:
                    continue
                if "global_steps" in tree:
                    found["global_steps"].setdefault(int(tree["global_steps"]), []).append(name)
        for t in range(self.mp):
            for r in range(self.world_size):
                try:
                    f = self.optim(r, t)
                    steps = [
                        _step_of(f, sc["step"]) for sc in partitions_of(f.tree, self.stage).scalars if "step" in sc
                    ]
                except CheckpointCorruptError:
                    continue  # a damaged file: what reads it names the item (verify reports each)
                for step in steps:
                    names = found["Adam step"].setdefault(step, [])
                    if not names or names[-1] != self.optim_name(r, t):
                        names.append(self.optim_name(r, t))
        for what, steps in found.items():
            if len(steps) > 1:
                each = "; ".join(
                    f"{what} {k} in {', '.join(v[:4])}{' ...' if len(v) > 4 else ''}" for k, v in sorted(steps.items())
                )
                raise CheckpointIncompleteError(
                    f"checkpoint {self.dir} mixes files of several saves: {each}; every file of a checkpoint "
                    "must come from the same save"
                )

    def _model_tree(self, name: str) -> dict:
        """The dict of model-state file ``name`` of a ZeRO-3 rank other than 0 (opened once)."""
        if name not in self._models:
            self._models[name] = SavedFile(os.path.join(self.dir, name))
        return self._models[name].tree

    def _identity_problems(self, name: str, attrs) -> List[str]:
        """The saving rank and world size this project's file records (footer ``file_attrs``)
        against its name and the model-state file's: a file of another rank or job copied into
        place is refused. Files that record neither are not checked."""
        out = []
        ws, rank = attrs.get("world_size"), attrs.get("rank")
        if ws is not None and ws != self.world_size * self.mp:
            out.append(f"written by a world of {ws} ranks, the checkpoint's is {self.world_size * self.mp}")
        if LAYER_FILE_RE.fullmatch(name):  # a layer's file: its name holds no rank
            rank = None
        bare = name.removeprefix("bf16_")
        dp_rank = int(bare[len("zero_pp_rank_") :].split("_", 1)[0]) if bare.startswith("zero_pp_rank_") else 0
        mp_rank = int(name.rsplit("mp_rank_", 1)[1].split("_", 1)[0]) if "mp_rank_" in name else 0
        want = self.global_rank(dp_rank, mp_rank)
        if rank is not None and rank != want:
            out.append(f"written by rank {rank}, its name is rank {want}'s")
        return out

    def global_rank(self, dp_rank: int, mp_rank: int) -> int:
        """The saving global rank of the files of ``(dp_rank, mp_rank)``: stage-major in a
        pipeline (``PipeDataParallelTopology``: ``stage * DP + dp_rank``), TP groups consecutive
        under AutoTP (``dp_rank * TP + tp_rank``)."""
        if self.pp > 1:
            return mp_rank * self.world_size + dp_rank
        return dp_rank * self.mp + mp_rank

    def coords(self, rank: int) -> Tuple[int, int]:
        """``(dp_rank, mp_rank)`` of saving global ``rank`` (:meth:`global_rank`'s inverse)."""
        if self.pp > 1:
            return rank % self.world_size, rank // self.world_size
        return divmod(rank, self.mp)

    def optim_name(self, rank: int, tp_rank: int = 0) -> str:
        """The name of the optimizer-state file of data-parallel rank ``rank`` of TP rank
        ``tp_rank``: DeepSpeed prefixes it with ``bf16_`` when the saving job trained in bf16
        (``DeepSpeedEngine._get_zero_ckpt_prefix``); a checkpoint with the other naming (as
        DeepSpeed's own load, which tries both) is read as it is."""
        bf16 = self.working_dtype() == "bfloat16"
        name = ("bf16_" if bf16 else "") + OPTIM_FILE_TP.format(rank, tp_rank)
        other = name[len("bf16_") :] if bf16 else "bf16_" + name
        if not os.path.exists(os.path.join(self.dir, name)) and os.path.exists(os.path.join(self.dir, other)):
            return other
        return name

    def _saving_world(self) -> str:
        return f"{self.world_size * self.mp} ranks" + ("" if self.mp == 1 else f", {self.degrees()}")

    def degrees(self) -> str:
        """The saving layout in words: ``"TP 2 x DP 4"``, ``"PP 2 x DP 1"``, or ``"DP 4"``."""
        if self.pp > 1:
            return f"PP {self.pp} x DP {self.world_size}"
        if self.tp > 1:
            return f"TP {self.tp} x DP {self.world_size}"
        return f"DP {self.world_size}"

    def optim(self, rank: int, tp_rank: int = 0) -> SavedFile:
        """The optimizer-state file of saving data-parallel rank ``rank`` of TP rank ``tp_rank``
        (opened once)."""
        if (rank, tp_rank) not in self._optim:
            path = os.path.join(self.dir, self.optim_name(rank, tp_rank))
            self._optim[(rank, tp_rank)] = SavedFile(path)
        return self._optim[(rank, tp_rank)]

    def model_state_of(self, tp_rank: int) -> dict:
        """The model-state dict of TP rank ``tp_rank`` (its ``param_shapes`` are that rank's TP
        shards' shapes); TP rank 0's is :attr:`model_state`."""
        if tp_rank == 0:
            return self.model_state
        if tp_rank not in self._models:
            name = MODEL_FILE_ZERO3_TP.format(0, tp_rank) if self.stage == 3 else MODEL_FILE_TP.format(tp_rank)
            self._models[tp_rank] = SavedFile(os.path.join(self.dir, name))
        return self._models[tp_rank].tree

    def param_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """``name -> shape`` of every parameter the optimizer holds, from the model-state file."""
        out = {}
        for group in self.model_state.get("param_shapes") or []:
            for name, shape in group.items():
                out[str(name)] = tuple(int(d) for d in shape)
        return out

    def working_dtype(self) -> str:
        if (self.ds_config.get("bf16") or {}).get("enabled"):
            return "bfloat16"
        if (self.ds_config.get("fp16") or {}).get("enabled"):
            return "float16"
        return "float32"

    def layout_from_metadata(self) -> ZeroLayout:
        """The saved layout from the checkpoint alone (no model): the groups of ``param_shapes``
        as DeepSpeed wrote them, which are the flat order of each partition (stages 1/2: one
        per parameter group, round robin already applied; stage 3: one per sub-group, so each
        is its own group here). Checked against every partition's size like :meth:`layout_for`.

        Raises:
            LayoutMismatchError: the partitions do not fit the metadata.
        """
        dtype = self.working_dtype()
        groups = tuple(
            tuple(ParamMeta(str(n), tuple(int(d) for d in shape), dtype) for n, shape in g.items())
            for g in (self.model_state.get("param_shapes") or [])
            if len(g)
        )
        z = self.ds_config.get("zero_optimization") or {}
        if self.stage == 3:
            layout = ZeroLayout(self.world_size, groups, stage=3, sub_group_size=2**62)
        else:
            layout = ZeroLayout(self.world_size, groups, False, bool(z.get("parameter_alignment", False)), self.stage)
        self.check_sizes(layout)
        return layout

    def layout_for(self, live: ZeroLayout) -> ZeroLayout:
        """The layout the checkpoint was saved in, for the live model's parameter groups.

        The parameters must be those of the model (names and shapes, from ``param_shapes``);
        ZeRO settings come from the saved config; every saved partition's size is checked
        against the layout (and, for this project's snapshots, every fragment against the
        footer's VPS attributes), so a wrong reconstruction cannot go unnoticed.

        Raises:
            LayoutMismatchError: naming the first parameter that differs, or a partition whose
                size does not fit.
        """
        check_parameters(self.param_shapes(), live, self.dir)
        dtype = self.working_dtype()
        groups = tuple(tuple(ParamMeta(p.key, p.shape, dtype) for p in g) for g in live.groups)
        layout = ZeroLayout(self.world_size, groups, *self.zero_settings())
        self.check_sizes(layout)
        return layout

    def zero_settings(self) -> Tuple[bool, bool, int, int]:
        """``(round_robin, parameter_alignment, stage, sub_group_size)`` of the saving config, in
        :class:`ZeroLayout`'s order (ZeRO-3: neither round robin nor alignment)."""
        z = self.ds_config.get("zero_optimization") or {}
        if self.stage == 3:
            return False, False, 3, int(z.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))
        rr, align = bool(z.get("round_robin_gradients", False)), bool(z.get("parameter_alignment", False))
        return rr, align, self.stage, DEFAULT_SUB_GROUP_SIZE

    def check_sizes(self, layout: ZeroLayout, tp_rank: int = 0) -> None:
        """Every saved partition of TP rank ``tp_rank``'s data-parallel ranks holds at least its
        fragments under ``layout`` and at most the partition's size (DeepSpeed saves ZeRO-1/2
        partitions without the last rank's padding); this project's files also record each
        partition's fragments, which must be the layout's.

        Raises:
            LayoutMismatchError: naming the file and partition that does not fit.
        """
        for r in range(self.world_size):
            name = self.optim_name(r, tp_rank)
            parts = partitions_of(self.optim(r, tp_rank).tree, self.stage)
            if len(parts.tensors) != layout.num_partitions:
                raise LayoutMismatchError(
                    f"{name} holds {len(parts.tensors)} partitions, the model's "
                    f"layout at {self.world_size} ranks has {layout.num_partitions}"
                )
            ends = defaultdict(int)
            for f in layout.fragments(r):
                ends[f.group] = max(ends[f.group], f.local + f.numel)
            for b, kinds in enumerate(parts.tensors):
                n = layout.partition_numel(b)
                for kind, t in kinds.items():
                    if not ends[b] <= numel_of(t) <= n:
                        raise LayoutMismatchError(
                            f"{name}: partition {b} ({kind}) has {numel_of(t)} "
                            f"elements; the model's layout needs {ends[b]} to {n}"
                        )
            if self.optim(r, tp_rank).ours and tp_rank == 0 and self.mp == 1:
                self._check_footer_fragments(r, layout)

    def _check_footer_fragments(self, rank: int, layout: ZeroLayout) -> None:
        """This project's snapshots record each partition's fragments; they must be the layout's."""
        for bad in fragment_mismatches(self.optim(rank)._reader.layout.items, layout, rank):
            raise LayoutMismatchError(
                f"{self.optim_name(rank)}: partition {bad.partition} holds fragments "
                f"other than the rebuilt layout's (first {bad.got} vs {bad.want})"
            )

    def close(self) -> None:
        for f in [*self._optim.values(), *self._models.values()]:
            f.close()
        self._optim.clear()
        self._models.clear()
        self.model_file.close()
