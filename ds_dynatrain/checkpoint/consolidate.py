"""Consolidated full weights of a ZeRO checkpoint, written as one safetensors file
(``dynatrain export``), and the saved layout's coverage check ``dynatrain verify`` shares.

What goes in the file is what DeepSpeed's ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
returns (deepspeed 0.19.8), under the names of the model's state dict (the keys of the saved
``module``, in its order):

* every trainable parameter whole, from the fp32 master fragments of all saving ranks (the saved
  layout says which rank holds which elements where);
* the buffers of ``buffer_names`` (persistent buffers), from rank 0's model-state ``module``;
* the frozen parameters: at ZeRO-1/2 from rank 0's ``module`` (whole there; at ZeRO-1 DeepSpeed
  records no ``frozen_param_shapes`` and ``zero_to_fp32`` leaves them out, here they are the
  ``module`` entries that are neither trainable, buffers nor tied names), at ZeRO-3 from the
  ``frozen_param_fragments`` of every rank's model-state file (one partition per rank);
* a tied parameter under both names: DeepSpeed's optimizer holds it once, ``shared_params`` maps
  the other name to it (``zero_to_fp32`` gives the alias the same tensor; here its bytes are
  written twice, since a safetensors file cannot alias).

Floating-point tensors are written in the requested dtype (fp32 or bf16; bf16 rounds to nearest
even, as ``Tensor.to``), integer and bool buffers keep theirs.

Why the bytes are not gathered tensor by tensor: a trainable parameter is spread over several
ranks (every rank at ZeRO-3), and DeepSpeed's own files are torch's legacy format, which
``torch.load`` reads whole. Gathering tensor by tensor would need every rank's file in memory at
once. The safetensors header is a pure function of names, dtypes and shapes (all in the
model-state file), so every tensor's place in the output is known before any weight is read; the
optimizer files are then read one at a time and each fragment is written straight to its place
(``pwrite``), in chunks of :data:`CHUNK_ELEMENTS`. Peak memory: one chunk with this project's
format (its reader fetches just the chunk's bytes); one optimizer file plus the model-state file
(which holds the whole module at ZeRO-1/2) with DeepSpeed's. The ``safetensors`` library itself
cannot write incrementally, so the format (https://github.com/huggingface/safetensors: an 8-byte
little-endian header length, a JSON header of ``dtype``/``shape``/``data_offsets``, then the raw
bytes in header order) is written here. The file appears under its name only when complete (written to a
temporary name, synced, renamed).

Geometry is in elements, as in :mod:`ds_dynatrain.vps.layout`; bytes appear only in the writer.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from ..errors import CheckpointIncompleteError, LayoutMismatchError
from .model_config import write_config_json
from .saved import MODEL_FILE_ZERO3, SavedCheckpoint, SavedFile, partitions_of
from .saved_layout import coverage_problems, saved_layout
from .saved_pp import band_layout_from_metadata
from .saved_tp import full_runs
from .verify import refuse_damaged

CHUNK_ELEMENTS = 1 << 24  # elements read and written at a time (64 MiB of fp32)

# torch dtype -> safetensors dtype name (the format's spelling)
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ExportEntry:
    """One tensor of the output: ``name``, ``dtype`` and ``shape`` as written; ``source`` is
    ``"trainable"`` (fp32 master fragments), ``"module"`` (rank 0's model-state ``module``),
    ``"zero3_frozen"`` (every rank's ``frozen_param_fragments``) or ``"alias"`` (a tied name: the
    bytes of ``of``). ``begin``/``end``: its bytes in the data region (see :func:`place`)."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    source: str
    of: Optional[str] = None
    begin: int = 0
    end: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _out_dtype(src: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    return dtype if src.is_floating_point else src


def plan_entries(saved: SavedCheckpoint, layout, dtype: torch.dtype) -> List[ExportEntry]:
    """The tensors of the export of ``saved`` in ``dtype`` (floating-point ones), in the order of
    the model's state dict (the saved ``module``'s keys), names not in it last. ``layout``: the
    saved layout (a :class:`ZeroLayout`, a :class:`TensorParallelLayout` or a
    :class:`PipelineLayout`, whose ``groups`` give the trainable parameters' whole shapes).

    Raises:
        CheckpointIncompleteError: a frozen parameter at ZeRO-3 without saved fragments.
    """
    ms = saved.model_state
    module = ms.get("module") or {}
    trainable = {p.key: p for g in layout.groups for p in g}
    shared = {str(a): str(s) for a, s in (ms.get("shared_params") or {}).items()}
    buffers = set(ms.get("buffer_names") or [])
    entries: Dict[str, ExportEntry] = {}
    for name, p in trainable.items():
        entries[name] = ExportEntry(name, dtype, tuple(p.shape), "trainable")
    for name in buffers:
        if name in module and name not in trainable:
            t = module[name]
            entries[name] = ExportEntry(name, _out_dtype(t.dtype, dtype), tuple(t.shape), "module")
    if saved.stage == 3:
        for name, shape in (ms.get("frozen_param_shapes") or {}).items():
            if name in entries:
                continue
            frag = (ms.get("frozen_param_fragments") or {}).get(name)
            if frag is None:
                raise CheckpointIncompleteError(
                    f"{saved.model_file.path}: frozen parameter {name} has no saved fragments"
                )
            entries[name] = ExportEntry(
                name, _out_dtype(frag.dtype, dtype), tuple(int(d) for d in shape), "zero3_frozen"
            )
    else:
        # ZeRO-1/2 hold every parameter whole in ``module``: the frozen ones are those the
        # optimizer does not hold (ZeRO-1 files have no frozen_param_shapes)
        for name, t in module.items():
            if name not in entries and name not in shared and name not in buffers:
                entries[name] = ExportEntry(name, _out_dtype(t.dtype, dtype), tuple(t.shape), "module")
    for alias, src in shared.items():
        if src in entries and alias not in entries:
            e = entries[src]
            entries[alias] = ExportEntry(alias, e.dtype, e.shape, "alias", of=src)
    order = [n for n in module if n in entries] + [n for n in entries if n not in module]
    return [entries[n] for n in order]


def place(entries: List[ExportEntry], metadata: Dict[str, str]) -> Tuple[bytes, List[ExportEntry]]:
    """The safetensors header of ``entries`` (8-byte little-endian length, then the JSON, padded
    with spaces to a multiple of 8 bytes, as the ``safetensors`` library writes it) and the
    entries with their byte ranges in the data region (back to back, in order).

    Raises:
        ValueError: a dtype safetensors has no name for, or a name given twice.
    """
    doc: Dict[str, object] = {"__metadata__": dict(metadata)}
    cursor, placed = 0, []
    for e in entries:
        if e.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {e.name}: dtype {e.dtype} has no safetensors name")
        if e.name in doc:
            raise ValueError(f"tensor {e.name} given twice")
        e = replace(e, begin=cursor, end=cursor + e.numel * e.element_size)
        cursor = e.end
        placed.append(e)
        doc[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    raw = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, placed


class SafetensorsWriter:
    """Writes a safetensors file whose header is known up front, in any order: each call of
    :meth:`write` puts elements of one tensor at their place. Written to ``path + ".tmp"``;
    :meth:`commit` checks every tensor was written whole, syncs and renames.

    Raises (:meth:`write`): ``ValueError`` for a write outside the tensor; ``OSError`` from the
    file system.
    """

    def __init__(self, path: str, entries: List[ExportEntry], metadata: Dict[str, str]):
        if sys.byteorder != "little":  # pragma: no cover - the format is little-endian
            raise RuntimeError("safetensors export needs a little-endian host")
        self.path, self.tmp = path, path + ".tmp"
        header, placed = place(entries, metadata)
        self.entries = {e.name: e for e in placed}
        self.written = dict.fromkeys(self.entries, 0)  # elements written so far, per tensor
        self.data_start = len(header)
        self.size = self.data_start + (placed[-1].end if placed else 0)
        self.bytes_written = 0
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            self._pwrite(header, 0)
            os.ftruncate(self.fd, self.size)
        except BaseException:
            self.abort()
            raise

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def write(self, name: str, start: int, values: torch.Tensor) -> None:
        """Elements ``[start, start + values.numel())`` of tensor ``name`` (row-major), cast to its
        output dtype."""
        e = self.entries[name]
        n = values.numel()
        if start < 0 or start + n > e.numel:
            raise ValueError(f"tensor {name}: elements [{start}, {start + n}) lie outside its {e.numel}")
        if n == 0:
            return
        data = values.reshape(-1).to(e.dtype).contiguous().view(torch.uint8).numpy()
        self._pwrite(data, self.data_start + e.begin + start * e.element_size)
        self.written[name] += n
        self.bytes_written += data.nbytes

    def commit(self) -> None:
        """Check every tensor was written whole (element counts; the layout's tiling was checked
        before), sync, rename to ``path``.

        Raises:
            CheckpointIncompleteError: a tensor with elements missing or written twice.
        """
        wrong = [e for e in self.entries.values() if self.written[e.name] != e.numel]
        if wrong:
            self.abort()
            e = wrong[0]
            raise CheckpointIncompleteError(
                f"tensor {e.name}: {self.written[e.name]} of its {e.numel} elements were "
                f"written ({len(wrong)} tensors incomplete); nothing was exported"
            )
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Close and remove the temporary file (safe to call twice)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


# --- reading the sources -------------------------------------------------------------------------


def _chunks(numel: int) -> Iterable[Tuple[int, int]]:
    for c in range(0, numel, CHUNK_ELEMENTS):
        yield c, min(CHUNK_ELEMENTS, numel - c)


def _copy_whole(f: SavedFile, src, writer: SafetensorsWriter, names: List[str]) -> None:
    """A whole tensor of ``f.tree`` (a tensor or a ``migrate.TensorRef``) to ``names``, chunk by chunk."""
    numel = src.numel()
    for c, n in _chunks(numel):
        buf = torch.empty(n, dtype=src.dtype)
        f.read_into([(src, c, buf)])
        for name in names:
            writer.write(name, c, buf)


def _write_trainable(saved: SavedCheckpoint, layout, writer: SafetensorsWriter, targets: Dict[str, List[str]]) -> None:
    """Every rank's fp32 master fragments, one optimizer file at a time, band by band (``layout``:
    a TP or pipeline layout); a TP shard's elements go to their place in the whole parameter
    (:func:`~ds_dynatrain.checkpoint.saved_tp.full_runs`), a parameter several bands hold whole
    (not cut by AutoTP; tied across stages) is written from the lowest band's copy."""
    metas = {p.key: p for p in layout.params}
    replicated, first = layout.replicated(), layout.first_holders()
    writer_band = {p.key: int(first[i]) if replicated[i] else None for i, p in enumerate(layout.params)}
    for t in range(layout.num_bands):
        zl = layout.zero(t)
        for r in range(saved.world_size):
            path = os.path.join(saved.dir, saved.optim_name(r, t))
            f = SavedFile(path)
            try:
                parts = partitions_of(f.tree, saved.stage)
                if len(parts.tensors) != zl.num_partitions:
                    raise LayoutMismatchError(
                        f"{path}: {len(parts.tensors)} partitions, the saved layout has {zl.num_partitions}"
                    )
                for fr in zl.fragments(r):
                    if writer_band[fr.key] not in (None, t):
                        continue
                    src = parts.tensors[fr.group].get("fp32")
                    if src is None:
                        raise CheckpointIncompleteError(f"{path}: partition {fr.group} has no fp32 master")
                    for c, n in _chunks(fr.numel):
                        buf = torch.empty(n, dtype=torch.float32)
                        f.read_into([(src, fr.local + c, buf)])  # raises when the partition is too short
                        for off, start, m in full_runs(layout, metas[fr.key], t, fr.start + c, n):
                            for name in targets[fr.key]:
                                writer.write(name, start, buf[off : off + m])
            finally:
                f.close()


def _write_zero3_frozen(
    saved: SavedCheckpoint, entries: List[ExportEntry], writer: SafetensorsWriter, targets: Dict[str, List[str]]
) -> None:
    """ZeRO-3 frozen parameters: rank ``r``'s model-state file holds elements
    ``[r * P, min((r + 1) * P, numel))`` of each, ``P = ceil(numel / world_size)`` (padded)."""
    frozen = [e for e in entries if e.source == "zero3_frozen"]
    if not frozen:
        return
    ws = saved.world_size
    for r in range(ws):
        f = saved.model_file if r == 0 else SavedFile(os.path.join(saved.dir, MODEL_FILE_ZERO3.format(r)))
        try:
            frags = f.tree.get("frozen_param_fragments") or {}
            for e in frozen:
                piece = -(-e.numel // ws)
                lo, hi = r * piece, min((r + 1) * piece, e.numel)
                if lo >= hi:
                    continue
                src = frags.get(e.name)
                if src is None:
                    raise CheckpointIncompleteError(f"{f.path}: no fragment of frozen parameter {e.name}")
                for c, n in _chunks(hi - lo):
                    buf = torch.empty(n, dtype=src.dtype)
                    f.read_into([(src, c, buf)])
                    for name in targets[e.name]:
                        writer.write(name, lo + c, buf)
        finally:
            if r:
                f.close()


@dataclass
class ExportStats:
    """What an export wrote: ``path``, ``tensors``, ``elements``, ``bytes`` (the file's size),
    ``dtype`` (name), ``seconds`` (wall), the saved (data-parallel) ``world_size``, ``stage``,
    ``step``, AutoTP degree ``tp`` and pipeline degree ``pp``;
    ``config``: the ``config.json`` written beside it (None: the checkpoint holds no model config)."""

    path: str
    tensors: int
    elements: int
    bytes: int
    dtype: str
    seconds: float
    world_size: int
    stage: int
    step: int
    config: Optional[str] = None
    tp: int = 1
    pp: int = 1


def export_safetensors(
    load_dir: str, out_path: str, dtype: torch.dtype = torch.float32, tag: Optional[str] = None
) -> ExportStats:
    """Write the consolidated weights of the checkpoint ``load_dir/tag`` (``tag`` None: the one
    ``latest`` names) to the safetensors file ``out_path``; floating-point tensors in ``dtype``.
    When the checkpoint holds the model's Hugging Face config, it is written as ``config.json``
    in the same directory (replacing one there), so that the directory loads with
    ``from_pretrained``.

    Raises:
        CheckpointCorruptError: a checksum mismatch anywhere in this project's files (checked
            before anything is written).
        CheckpointIncompleteError: missing, truncated or damaged files, a partition too short for
            its fragments (nothing is left at ``out_path``).
        LayoutMismatchError: partitions that do not fit the saved layout.
        OSError: the output cannot be written.
    """
    t0 = time.perf_counter()
    saved = SavedCheckpoint(load_dir, tag)
    writer = None
    try:
        refuse_damaged(saved)  # every byte checked first, the ones export does not use included
        layout = band_layout_from_metadata(saved)  # TP 1: the ZeRO layout of param_shapes
        problems = [q for t in range(layout.num_bands) for q in coverage_problems(layout.zero(t))]
        if problems:
            raise LayoutMismatchError(f"{saved.dir}: the saved layout does not cover the parameters: {problems[0]}")
        entries = plan_entries(saved, layout, dtype)
        targets: Dict[str, List[str]] = defaultdict(list)  # source name -> names its bytes go to
        for e in entries:
            targets[e.of or e.name].append(e.name)
        meta = {
            "format": "pt",
            "producer": "ds_dynatrain",
            "step": str(saved.step),
            "saved_world_size": str(saved.world_size),
            "saved_tensor_parallel": str(saved.tp),
            "saved_pipeline_parallel": str(saved.pp),
            "zero_stage": str(saved.stage),
        }
        writer = SafetensorsWriter(out_path, entries, meta)
        module = saved.model_state.get("module") or {}
        for e in entries:
            if e.source == "module":
                _copy_whole(saved.model_file, module[e.name], writer, targets[e.name])
        _write_zero3_frozen(saved, entries, writer, targets)
        _write_trainable(saved, layout, writer, targets)
        writer.commit()
        size = writer.size
        config = write_config_json(saved.model_state, os.path.dirname(os.path.abspath(out_path)))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        saved.close()
    return ExportStats(
        out_path,
        len(entries),
        sum(e.numel for e in entries),
        size,
        str(dtype).replace("torch.", ""),
        time.perf_counter() - t0,
        saved.world_size,
        saved.stage,
        saved.step,
        config,
        saved.tp,
        saved.pp,
    )


__all__ = [
    "CHUNK_ELEMENTS",
    "EXPORT_DTYPES",
    "ExportEntry",
    "ExportStats",
    "SafetensorsWriter",
    "coverage_problems",
    "export_safetensors",
    "place",
    "plan_entries",
    "saved_layout",
]
