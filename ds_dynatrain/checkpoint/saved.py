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
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointCorruptError, CheckpointIncompleteError, LayoutMismatchError
from ..vps.layout import DEFAULT_SUB_GROUP_SIZE, ParamMeta, ZeroLayout
from .footer import fragment_mismatches

OPTIM_FILE = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
MODEL_FILE = "mp_rank_00_model_states.pt"  # ZeRO-1/2: one, written by rank 0
MODEL_FILE_ZERO3 = "zero_pp_rank_{}_mp_rank_00_model_states.pt"  # ZeRO-3: one per rank
EAGER_BYTES = 64 << 10  # tensors up to this size are read with the skeleton (scalars, small states)
MOMENTS = ("exp_avg", "exp_avg_sq")


def safe_globals() -> list:
    """Types DeepSpeed puts in its checkpoint dicts, allowed for ``weights_only`` loading (loading
    never executes code from a file)."""
    from state_providers.serialize import allowed_classes

    return list(allowed_classes().values())


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


def _reason(err: BaseException, path: str) -> str:
    """An exception as one readable clause: its type when its text is empty (a truncated
    pickle raises a bare ``EOFError``), without repeating ``path``."""
    text = str(err).strip()
    if text.startswith(path):
        text = text[len(path) :].lstrip(": ")
    return f"{type(err).__name__}: {text}" if text else f"{type(err).__name__} (the file ends early or is corrupt)"


def is_snapshot_file(path: str) -> bool:
    """Whether ``path`` is in this project's snapshot format (by its magic bytes)."""
    from io_engine.format import MAGIC

    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a snapshot file that was not read: where its bytes are.

    Attributes: ``path`` of the file, ``key`` of its item, ``dtype`` (torch dtype), ``shape``,
    ``offset`` and ``nbytes`` (bytes in the file).
    """

    path: str
    key: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int
    nbytes: int

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class SavedFile:
    """One file of a checkpoint, opened for reading only what is asked.

    ``tree`` is the file's state dict. In this project's format every tensor above
    :data:`EAGER_BYTES` is a :class:`TensorRef` (its bytes are read by :meth:`read_into`); in
    DeepSpeed's format tensors are memory-mapped (``torch.load(mmap=True, weights_only=True)``,
    DeepSpeed's types allow-listed), so only the pages that are copied are read.

    Raises:
        CheckpointIncompleteError: the file is missing, truncated or its footer is damaged.
    """

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise CheckpointIncompleteError(f"missing file {path}")
        self.ours = is_snapshot_file(path)
        self._reader = None
        if self.ours:
            from io_engine import FileReader
            from io_engine.errors import IOEngineError
            from state_providers.serialize import loads

            try:
                self._reader = FileReader(path)
            except IOEngineError as err:
                raise CheckpointIncompleteError(f"damaged file {path}: {_reason(err, path)}") from None
            metas = {m.key: m for m in self._reader.layout.items}
            eager = [k for k, m in metas.items() if m.kind == "object" or m.nbytes <= EAGER_BYTES]
            views = dict(zip(eager, self._read_verified([(k, 0, metas[k].nbytes) for k in eager])))
            if "__skeleton__" not in views:
                raise CheckpointIncompleteError(f"damaged file {path}: no '__skeleton__' item (not a state file)")

            def tensor_of(i: int):
                m = metas[f"t/{i}"]
                dtype = getattr(torch, m.dtype)
                if m.key in views:
                    if m.nbytes == 0:
                        return torch.empty(tuple(m.shape), dtype=dtype)
                    return torch.frombuffer(bytearray(views[m.key]), dtype=dtype).reshape(tuple(m.shape))
                return TensorRef(path, m.key, dtype, tuple(m.shape), m.offset, m.nbytes)

            try:
                self.tree = loads(bytes(views["__skeleton__"]), tensor_of, key="__skeleton__")
            except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as err:
                raise CheckpointIncompleteError(
                    f"damaged file {path}: its skeleton does not fit its items ({_reason(err, path)})"
                ) from None
        else:
            # DeepSpeed's default engine writes torch's legacy (non-zip) format, which cannot be
            # memory-mapped: such a file is read whole (only the files this rank needs are opened)
            try:
                with torch.serialization.safe_globals(safe_globals()):
                    self.tree = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
            except (RuntimeError, zipfile.BadZipFile, EOFError, ValueError, OSError) as err:
                raise CheckpointIncompleteError(f"damaged file {path}: {_reason(err, path)}") from None
            except Exception as err:  # noqa: BLE001 - the unpickler raises anything on a damaged file
                raise CheckpointIncompleteError(f"damaged file {path}: {type(err).__name__}: {err}") from None

    @torch.no_grad()
    def read_into(self, requests: Sequence[Tuple[Any, int, torch.Tensor]]) -> int:
        """Fill each ``dest`` (a 1-D tensor) with ``dest.numel()`` elements of ``source`` (a
        tensor of :attr:`tree` or a :class:`TensorRef`) from element ``offset`` on. Returns the
        bytes read. From this project's files all ranges are read in one io_uring batch.
        """
        refs = [(s, off, d) for s, off, d in requests if isinstance(s, TensorRef)]
        done = 0
        if refs:
            ranges = []
            for s, off, d in refs:
                es = torch.empty((), dtype=s.dtype).element_size()
                if off < 0 or (off + d.numel()) * es > s.nbytes:
                    raise CheckpointIncompleteError(
                        f"{self.path}: item {s.key} has {s.nbytes} bytes, a read of "
                        f"elements [{off}, {off + d.numel()}) lies outside it"
                    )
                ranges.append((s.key, off * es, d.numel() * es))
            views = self._read_verified(ranges)
            for (s, _off, d), v in zip(refs, views):
                if len(v):
                    d.copy_(torch.frombuffer(v, dtype=s.dtype))
                done += len(v)
        for s, off, d in requests:
            if isinstance(s, TensorRef):
                continue
            flat = s.reshape(-1)
            if off < 0 or off + d.numel() > flat.numel():
                raise CheckpointIncompleteError(
                    f"{self.path}: a tensor of {flat.numel()} elements, a read of "
                    f"elements [{off}, {off + d.numel()}) lies outside it"
                )
            d.copy_(flat[off : off + d.numel()])
            done += d.numel() * d.element_size()
        return done

    def _read_verified(self, ranges: List[Tuple[str, int, int]]) -> list:
        """``(key, start, length)`` byte ranges of items, every byte checked against its checksum.

        Raises:
            CheckpointCorruptError: naming the file, the item and the byte range that differ.
            CheckpointIncompleteError: the read fails or a range lies outside its item.
        """
        from io_engine.errors import ChecksumMismatchError, IOEngineError

        try:
            return self._reader.read_item_ranges(ranges)
        except ChecksumMismatchError as err:
            raise CheckpointCorruptError(str(err)) from None
        except (IOEngineError, KeyError) as err:
            raise CheckpointIncompleteError(f"damaged file {self.path}: {_reason(err, self.path)}") from None

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None


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


class SavedCheckpoint:
    """A checkpoint directory at one tag, checked complete, with its saved layout.

    Attributes:
        dir: ``load_dir/tag``.  world_size: the saving data-parallel world size.  stage: ZeRO
        stage.  step: ``global_steps`` at the save.  model_state: rank 0's model-state dict
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
        self.model_file = SavedFile(first)
        self.model_state = self.model_file.tree
        try:
            self.world_size = int(self.model_state["dp_world_size"])
            self.ds_config = dict(self.model_state.get("ds_config") or {})
            self.stage = int((self.ds_config.get("zero_optimization") or {}).get("stage", 0))
            self.step = int(self.model_state.get("global_steps", 0))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointIncompleteError(f"{first}: not a DeepSpeed model-state file ({err!r})") from None
        if self.stage not in (1, 2, 3):
            raise CheckpointIncompleteError(
                f"{self.dir}: saved at ZeRO stage {self.stage}; only ZeRO-1/2/3 "
                "partitions can be loaded onto another world size"
            )
        self.files = self.expected_files()
        self.check_complete()
        self._optim: Dict[int, SavedFile] = {}

    def expected_files(self) -> List[str]:
        """Every file the saving world wrote (paths)."""
        names = [OPTIM_FILE.format(r) for r in range(self.world_size)]
        names += [MODEL_FILE_ZERO3.format(r) for r in range(self.world_size)] if self.stage == 3 else [MODEL_FILE]
        return [os.path.join(self.dir, n) for n in names]

    def check_complete(self) -> None:
        """Every file of the saving world present and complete (this project's files: header,
        footer and size; DeepSpeed's: the zip directory), before any is loaded.

        Raises:
            CheckpointIncompleteError: listing every missing or damaged file.
        """
        from io_engine.errors import IOEngineError
        from io_engine.format import read_footer

        problems = []
        for path in self.files:
            name = os.path.basename(path)
            if not os.path.isfile(path):
                problems.append(f"{name}: missing")
                continue
            try:
                if is_snapshot_file(path):
                    read_footer(path)
                elif zipfile.is_zipfile(path):
                    with zipfile.ZipFile(path) as z:
                        z.namelist()
                elif os.path.getsize(path) == 0:
                    problems.append(f"{name}: empty")
                # torch's legacy format has no directory to check: a damaged file is found when it
                # is read, and every rank agrees on that before anything is installed
            except (IOEngineError, zipfile.BadZipFile, OSError) as err:
                problems.append(f"{name}: damaged ({err})")
        if problems:
            raise CheckpointIncompleteError(
                f"checkpoint {self.dir} (saved by {self.world_size} ranks at ZeRO stage {self.stage}) is incomplete: "
                + "; ".join(problems)
            )

    def optim(self, rank: int) -> SavedFile:
        """The optimizer-state file of saving rank ``rank`` (opened once)."""
        if rank not in self._optim:
            self._optim[rank] = SavedFile(os.path.join(self.dir, OPTIM_FILE.format(rank)))
        return self._optim[rank]

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
        self._check_sizes(layout)
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
        saved = self.param_shapes()
        for gi, params in enumerate(live.groups):
            for p in params:
                if p.key not in saved:
                    raise LayoutMismatchError(
                        f"parameter group {gi}: parameter {p.key} {list(p.shape)} of the model "
                        f"is not in the checkpoint {self.dir}"
                    )
                if saved[p.key] != tuple(p.shape):
                    raise LayoutMismatchError(
                        f"parameter group {gi}: {p.key} is {list(saved[p.key])} in the checkpoint "
                        f"and {list(p.shape)} in the model"
                    )
        live_keys = {p.key for g in live.groups for p in g}
        extra = [n for n in saved if n not in live_keys]
        if extra:
            raise LayoutMismatchError(
                f"checkpoint parameter {extra[0]} {list(saved[extra[0]])} is not a trainable parameter of the model"
            )
        dtype = self.working_dtype()
        groups = tuple(tuple(ParamMeta(p.key, p.shape, dtype) for p in g) for g in live.groups)
        z = self.ds_config.get("zero_optimization") or {}
        if self.stage == 3:
            layout = ZeroLayout(
                self.world_size, groups, stage=3, sub_group_size=int(z.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE))
            )
        else:
            layout = ZeroLayout(
                self.world_size,
                groups,
                bool(z.get("round_robin_gradients", False)),
                bool(z.get("parameter_alignment", False)),
                self.stage,
            )
        self._check_sizes(layout)
        return layout

    def _check_sizes(self, layout: ZeroLayout) -> None:
        for r in range(self.world_size):
            parts = partitions_of(self.optim(r).tree, self.stage)
            if len(parts.tensors) != layout.num_partitions:
                raise LayoutMismatchError(
                    f"{OPTIM_FILE.format(r)} holds {len(parts.tensors)} partitions, the model's "
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
                            f"{OPTIM_FILE.format(r)}: partition {b} ({kind}) has {numel_of(t)} "
                            f"elements; the model's layout needs {ends[b]} to {n}"
                        )
            if self.optim(r).ours:
                self._check_footer_fragments(r, layout)

    def _check_footer_fragments(self, rank: int, layout: ZeroLayout) -> None:
        """This project's snapshots record each partition's fragments; they must be the layout's."""
        for bad in fragment_mismatches(self.optim(rank)._reader.layout.items, layout, rank, kinds=("fp32",)):
            raise LayoutMismatchError(
                f"{OPTIM_FILE.format(rank)}: partition {bad.partition} holds fragments "
                f"other than the rebuilt layout's (first {bad.got} vs {bad.want})"
            )

    def close(self) -> None:
        for f in self._optim.values():
            f.close()
        self._optim.clear()
        self.model_file.close()
