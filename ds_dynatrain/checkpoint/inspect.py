"""What a checkpoint directory holds, and whether it is complete and intact (``dynatrain inspect``
and ``dynatrain verify``), without a model, a process group or a GPU.

``inspect`` describes the checkpoint from rank 0's model-state file and the metadata of every
optimizer file: saving world size, ZeRO stage, step, the parameters and the bytes each rank wrote.
By default it first checks every checksum of this project's files (what it reports must come from
intact files), and refuses a damaged checkpoint; ``checksums=False`` reads only the metadata it
reports (still verified, item by item).

``verify`` reads everything, one file at a time (peak memory: one of DeepSpeed's files, which
``torch.load`` reads whole; this project's files are read in batches, ``integrity.VERIFY_BATCH_BYTES``):

1. every file of the saving world present and complete (``SavedCheckpoint``);
2. every item of this project's files read with its CRC-32 checked against the footer (a flipped
   byte anywhere in a tensor or object is found); DeepSpeed's ``torch.save`` files have no
   checksums, so each is loaded with ``torch.load(weights_only=True)`` and the report says the
   checksums are not available;
3. the saved layout (rebuilt from ``param_shapes``) tiles every parameter exactly once over the
   saving ranks' fragments, and every rank's partitions (fp32 master and moments) are long enough
   for their fragments and no longer than the layout's partitions; in this project's files the
   fragments each partition records (``vps`` attributes) must be the layout's;
4. every rank's model-state file (ZeRO-3) was saved at the same step by the same world.

Every problem is collected and reported (file, item, parameter), not only the first.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import CheckpointIncompleteError
from ..vps.layout import ZeroLayout
from .consolidate import coverage_problems, plan_entries, saved_layout
from .footer import fragment_mismatches
from .integrity import check_items, refuse_damaged
from .saved import (
    MODEL_FILE,
    MODEL_FILE_ZERO3,
    OPTIM_FILE,
    SavedCheckpoint,
    SavedFile,
    is_snapshot_file,
    partitions_of,
    resolve_tag,
)

FORMAT_OURS = "dynatrain"  # this project's snapshot format
FORMAT_DEEPSPEED = "deepspeed"  # DeepSpeed's torch.save format


def _files_of_rank(saved: SavedCheckpoint, rank: int) -> List[str]:
    names = [OPTIM_FILE.format(rank)]
    if saved.stage == 3:
        names.append(MODEL_FILE_ZERO3.format(rank))
    elif rank == 0:
        names.append(MODEL_FILE)
    return [os.path.join(saved.dir, n) for n in names]


def inspect_report(load_dir: str, tag: Optional[str] = None, checksums: bool = True) -> dict:
    """What the checkpoint ``load_dir/tag`` (``tag`` None: ``latest``) holds, as a JSON-ready dict:

    ``dir``, ``tag``, ``format`` (``"dynatrain"``, ``"deepspeed"`` or ``"mixed"``),
    ``world_size``, ``zero_stage``, ``step``, ``global_samples``, ``working_dtype``,
    ``ds_version``; ``parameters``: ``[{"name", "shape", "numel", "trainable"}]`` (trainable
    ones in the optimizer's order, then frozen ones), ``num_parameters`` (elements, all of them),
    ``num_trainable``; ``tied``: ``{alias: name}``; ``buffers``: names; ``ranks``:
    ``[{"rank", "bytes", "files"}]`` (file sizes in bytes; ZeRO-1/2's model-state file counts
    for rank 0); ``total_bytes``.

    With ``checksums`` every item of this project's files is read and its checksum checked
    first (as ``verify`` does); without, only what the report is made of is read.

    Raises:
        CheckpointCorruptError: a checksum mismatch, naming the file, item and byte range.
        CheckpointIncompleteError: missing or damaged files.
    """
    import torch

    saved = SavedCheckpoint(load_dir, tag)
    try:
        if checksums:
            refuse_damaged(saved)
        ms = saved.model_state
        layout = saved_layout(saved)
        params = [
            {"name": p.key, "shape": list(p.shape), "numel": p.numel, "trainable": True}
            for g in layout.groups
            for p in g
        ]
        buffers = set(ms.get("buffer_names") or [])
        # frozen parameters as export finds them (ZeRO-1 files have no frozen_param_shapes)
        for e in plan_entries(saved, layout, torch.float32):
            if e.source == "zero3_frozen" or (e.source == "module" and e.name not in buffers):
                params.append({"name": e.name, "shape": list(e.shape), "numel": e.numel, "trainable": False})
        formats = {is_snapshot_file(p) for p in saved.files}
        ranks = []
        for r in range(saved.world_size):
            files = _files_of_rank(saved, r)
            ranks.append(
                {
                    "rank": r,
                    "bytes": sum(os.path.getsize(f) for f in files),
                    "files": [os.path.basename(f) for f in files],
                }
            )
        return {
            "dir": saved.dir,
            "tag": saved.tag,
            "format": "mixed" if len(formats) > 1 else (FORMAT_OURS if formats.pop() else FORMAT_DEEPSPEED),
            "world_size": saved.world_size,
            "zero_stage": saved.stage,
            "step": saved.step,
            "global_samples": int(ms.get("global_samples", 0) or 0),
            "working_dtype": saved.working_dtype(),
            "ds_version": str(ms.get("ds_version", "")),
            "parameters": params,
            "num_parameters": sum(p["numel"] for p in params),
            "num_trainable": sum(p["numel"] for p in params if p["trainable"]),
            "tied": {str(a): str(s) for a, s in (ms.get("shared_params") or {}).items()},
            "buffers": [str(b) for b in (ms.get("buffer_names") or [])],
            "ranks": ranks,
            "total_bytes": sum(r["bytes"] for r in ranks),
        }
    finally:
        saved.close()


# --- verify -----------------------------------------------------------------------------------


@dataclass
class VerifyReport:
    """The result of :func:`verify_checkpoint`. ``problems``: one message per problem, each
    naming the file, item or parameter (empty: complete and intact). ``notes``: what was
    checked. ``ok`` is ``not problems``."""

    dir: str
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_partitions(
    saved: SavedCheckpoint, layout: ZeroLayout, rank: int, f: SavedFile, footer: list, rep: VerifyReport
) -> None:
    """Rank ``rank``'s partitions against the saved layout (count, lengths, and the fragments the
    ``footer`` items of this project's file record)."""
    name = os.path.basename(f.path)
    try:
        parts = partitions_of(f.tree, saved.stage)
    except CheckpointIncompleteError as err:
        rep.problems.append(f"{name}: {err}")
        return
    if len(parts.tensors) != layout.num_partitions:
        rep.problems.append(f"{name}: {len(parts.tensors)} partitions, the saved layout has {layout.num_partitions}")
        return
    ends = [0] * layout.num_partitions
    expected: List[list] = [[] for _ in range(layout.num_partitions)]
    for fr in layout.fragments(rank):
        ends[fr.group] = max(ends[fr.group], fr.local + fr.numel)
        expected[fr.group].append([fr.key, fr.start, fr.numel, fr.local])
    for b, kinds in enumerate(parts.tensors):
        n = layout.partition_numel(b)
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            if kind not in kinds:
                rep.problems.append(f"{name}: partition {b} has no {kind}")
        for kind, t in kinds.items():
            if not ends[b] <= t.numel() <= n:
                first = expected[b][0][0] if expected[b] else "?"
                rep.problems.append(
                    f"{name}: partition {b} ({kind}) has {t.numel()} elements; its fragments "
                    f"({first}, ...) need {ends[b]} and the layout allows at most {n}"
                )
    for bad in fragment_mismatches(footer, layout, rank):
        rep.problems.append(
            f"{name}: item {bad.item} ({bad.kind}, partition {bad.partition}) records fragments "
            f"other than the saved layout's (first {bad.got}, layout {bad.want})"
        )


def verify_checkpoint(load_dir: str, tag: Optional[str] = None) -> VerifyReport:
    """Check the checkpoint ``load_dir/tag`` (``tag`` None: ``latest``) complete and intact: see
    the module docstring. Never raises for a damaged checkpoint: every problem is in the report.

    Raises:
        FileNotFoundError: ``load_dir`` is not a directory (a usage error, not a damaged checkpoint).
    """
    if not os.path.isdir(load_dir):
        raise FileNotFoundError(f"{load_dir}: not a directory")
    try:
        tag = resolve_tag(load_dir, tag)
    except CheckpointIncompleteError as err:
        return VerifyReport(load_dir, [str(err)])
    rep = VerifyReport(os.path.join(load_dir, tag))
    try:
        saved = SavedCheckpoint(load_dir, tag)
    except CheckpointIncompleteError as err:
        # the saving world is unknown (or files are missing): check what is there, file by file
        rep.problems.append(str(err))
        for path in sorted(glob.glob(os.path.join(rep.dir, "*.pt"))):
            if os.path.basename(path) in str(err):
                continue  # already named
            if is_snapshot_file(path):
                check_items(path, rep.problems)
            else:
                try:
                    SavedFile(path).close()
                except CheckpointIncompleteError as e:
                    rep.problems.append(str(e))
        return rep
    try:
        _verify_saved(saved, rep)
    finally:
        saved.close()
    return rep


def _verify_saved(saved: SavedCheckpoint, rep: VerifyReport) -> None:
    try:
        layout: Optional[ZeroLayout] = saved_layout(saved)
    except (CheckpointIncompleteError, ValueError) as err:  # no param_shapes, or impossible ones
        rep.problems.append(
            f"{os.path.basename(saved.model_file.path)}: no usable parameter metadata ({err}); "
            "only the checksums were checked"
        )
        layout = None
    ours = [p for p in saved.files if is_snapshot_file(p)]
    fmt = (
        "dynatrain snapshot"
        if len(ours) == len(saved.files)
        else "DeepSpeed torch.save"
        if not ours
        else "mixed dynatrain snapshot and DeepSpeed torch.save"
    )
    rep.notes.append(
        f"checkpoint {saved.dir}: {saved.world_size} ranks, ZeRO-{saved.stage}, step {saved.step}, "
        f"{fmt} format, {len(saved.files)} files"
    )
    items = 0
    for path in saved.files:
        name = os.path.basename(path)
        before = len(rep.problems)
        footer = []
        if path in ours:
            footer = check_items(path, rep.problems)
            items += len(footer)
            if len(rep.problems) == before:
                rep.notes.append(f"{name}: {len(footer)} items, every checksum matches")
        rank = _rank_of(name)
        if len(rep.problems) > before:
            continue  # damaged: its structure cannot be trusted
        try:
            f = saved.model_file if path == saved.model_file.path else SavedFile(path)
        except CheckpointIncompleteError as err:
            rep.problems.append(str(err))
            continue
        if path not in ours:
            rep.notes.append(
                f"{name}: loaded with torch.load(weights_only=True); checksums not available "
                "(DeepSpeed's torch.save format has none)"
            )
        try:
            if not isinstance(f.tree, dict):
                rep.problems.append(f"{name}: holds a {type(f.tree).__name__}, not a DeepSpeed state dict")
            elif name.endswith("optim_states.pt"):
                if layout is not None:
                    _check_partitions(saved, layout, rank, f, footer, rep)
            elif saved.stage == 3 and rank:
                for key, want in (("dp_world_size", saved.world_size), ("global_steps", saved.step)):
                    got = f.tree.get(key)
                    if got is None or int(got) != want:
                        rep.problems.append(f"{name}: {key} is {got}, rank 0's model-state file says {want}")
        finally:
            if f is not saved.model_file:
                f.close()
    cover = coverage_problems(layout) if layout is not None else []
    rep.problems.extend(cover)
    if layout is not None and not cover:
        nparams = sum(len(g) for g in layout.groups)
        numel = sum(p.numel for g in layout.groups for p in g)
        rep.notes.append(
            f"coverage: {nparams} parameters, {numel:,} elements, every element held exactly once by "
            f"the fragments of {saved.world_size} ranks"
        )
    if ours:
        rep.notes.append(f"{items} items checksummed (CRC-32)")
    else:
        rep.notes.append("checksums not available: DeepSpeed's torch.save format has none")


def _rank_of(name: str) -> int:
    """The rank in ``zero_pp_rank_<r>_...``; 0 for ``mp_rank_00_model_states.pt``."""
    if name.startswith("zero_pp_rank_"):
        return int(name[len("zero_pp_rank_") :].split("_", 1)[0])
    return 0
