"""``verify``: whether a checkpoint directory is complete and intact, every problem collected (file,
item, parameter), not only the first; and the same checks required by ``inspect`` and ``export``.

1. every file of the saving world present, complete and of its rank and world (``SavedCheckpoint``);
2. every item of this project's files read with its checksums checked (a flipped byte anywhere is
   found) and its skeleton fitted to its footer; DeepSpeed's ``torch.save`` files have no
   checksums, so each is loaded with ``torch.load(weights_only=True)``;
3. the saved layout (rebuilt from ``param_shapes``) tiles every parameter exactly once over the
   saving ranks' fragments, and every rank's partitions (fp32 master and moments) fit them; in this
   project's files the VPS attributes each partition records must be the layout's;
4. every rank's model-state file (ZeRO-3) was saved at the same step by the same world.

Peak memory: one of DeepSpeed's files (read whole) or :data:`VERIFY_BATCH_BYTES` of this project's.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ..errors import CheckpointCorruptError, CheckpointIncompleteError, LayoutMismatchError
from ..log import plural
from ..vps.layout import ZeroLayout
from .footer import fragment_mismatches
from .saved import SavedCheckpoint, partitions_of, resolve_tag
from .saved_file import SavedFile, is_snapshot_file
from .saved_layout import coverage_problems
from .saved_pp import band_layout_from_metadata
from .saved_tp import check_shards

VERIFY_BATCH_BYTES = 256 << 20  # bytes of items read (and checksummed) at a time


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
        layout = band_layout_from_metadata(saved)  # TP 1: param_shapes' ZeRO layout
    except (CheckpointIncompleteError, LayoutMismatchError, ValueError) as err:  # no or impossible metadata
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
    world = plural(saved.world_size, "rank") if saved.mp == 1 else saved.degrees()
    rep.notes.append(
        f"checkpoint {saved.dir}: {world}, ZeRO-{saved.stage}, step {saved.step}, "
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
        rank, tp_rank = _rank_of(name)
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
                    _check_partitions(saved, layout.zero(tp_rank), rank, f, footer, rep)
            elif rank or tp_rank:
                for key, want in (("dp_world_size", saved.world_size), ("global_steps", saved.step)):
                    got = f.tree.get(key)
                    if got is None or int(got) != want:
                        rep.problems.append(f"{name}: {key} is {got}, rank 0's model-state file says {want}")
                if tp_rank and not rank and layout is not None:
                    try:
                        check_shards(saved, layout, tp_rank)
                    except LayoutMismatchError as err:
                        rep.problems.append(f"{name}: {err}")
        finally:
            if f is not saved.model_file:
                f.close()
    cover = []
    bands = layout.num_bands if layout is not None else 0
    for t in range(bands):  # each band's (TP rank's shards, stage's parameters), tiled by its DP ranks
        cover += [(f"{layout.band_name} {t}: " if bands > 1 else "") + q for q in coverage_problems(layout.zero(t))]
    rep.problems.extend(cover)
    if layout is not None and not cover:
        nparams = len(layout.params)
        numel = sum(p.numel for p in layout.params)
        held = (
            ""
            if bands == 1
            else f" of each of the {bands} {layout.band_name}s' " + ("shards" if saved.tp > 1 else "parameters")
        )
        rep.notes.append(
            f"coverage: {nparams} parameters, {numel:,} elements, every element{held} held exactly once by "
            f"the fragments of {plural(saved.world_size, 'rank')}"
        )
    if ours:
        rep.notes.append(f"{items} items checksummed (CRC-32C; CRC-32 in files of format versions 1 and 2)")
    else:
        rep.notes.append("checksums not available: DeepSpeed's torch.save format has none")


def _rank_of(name: str) -> Tuple[int, int]:
    """``(data-parallel rank, TP rank)`` of ``[bf16_]zero_pp_rank_<r>_mp_rank_<t>_...`` or
    ``mp_rank_<t>_model_states.pt`` (data-parallel rank 0)."""
    bare = name.removeprefix("bf16_")
    dp = int(bare[len("zero_pp_rank_") :].split("_", 1)[0]) if bare.startswith("zero_pp_rank_") else 0
    tp = int(bare.rsplit("mp_rank_", 1)[1].split("_", 1)[0]) if "mp_rank_" in bare else 0
    return dp, tp


def check_items(path: str, problems: List[str]) -> list:
    """Every item of one of this project's files, read with CRC verification, in batches of
    :data:`VERIFY_BATCH_BYTES`. Returns the footer's items (``io_engine.format.ItemMeta``; empty
    when the footer is unreadable); problems go to ``problems`` (one per damaged item, naming the
    file, the item and the byte range)."""
    from io_engine import FileReader
    from io_engine.errors import ChecksumMismatchError, IOEngineError

    name = os.path.basename(path)
    try:
        reader = FileReader(path)
    except (IOEngineError, OSError) as err:
        problems.append(f"{name}: damaged ({err})")
        return []
    with reader:
        items = list(reader.layout.items)
        batches, cur, size = [], [], 0
        for m in items:
            if cur and size + m.nbytes > VERIFY_BATCH_BYTES:
                batches.append(cur)
                cur, size = [], 0
            cur.append(m)
            size += m.nbytes
        if cur:
            batches.append(cur)
        for batch in batches:
            try:
                reader.read_items([m.key for m in batch], verify=True)
                continue
            except ChecksumMismatchError:
                pass
            except IOEngineError as err:
                problems.append(f"{name}: unreadable ({err})")
                return items
            for m in batch:  # find every damaged item of the batch, not only the first
                try:
                    reader.read_item(m.key, verify=True)
                except ChecksumMismatchError as err:
                    what = (m.attrs or {}).get("path")
                    where = f"offset {m.offset}" if err.offset is None else f"bytes from offset {err.offset}"
                    problems.append(
                        f"{name}: item {m.key}{f' ({what})' if what else ''}, {m.kind} of "
                        f"{m.nbytes} bytes at offset {m.offset}: checksum mismatch in the {where} (footer "
                        f"{err.expected}, data {err.actual})"
                    )
    return items


def refuse_damaged(saved: SavedCheckpoint) -> None:
    """Everything ``verify`` checks, on an open checkpoint: every checksum of this project's files,
    every file's structure (the skeleton fits the footer: keys, dtypes, shapes), every rank's
    partitions and recorded fragments against the saved layout, and the coverage of every
    parameter. What ``inspect`` and ``export`` require before they describe or consolidate.

    Raises:
        CheckpointCorruptError: a checksum mismatch (every damaged file, item and byte range named).
        CheckpointIncompleteError: any other problem ``verify`` reports.
    """
    rep = VerifyReport(saved.dir)
    _verify_saved(saved, rep)
    if rep.problems:
        corrupt = any("checksum mismatch" in p for p in rep.problems)
        cls = CheckpointCorruptError if corrupt else CheckpointIncompleteError
        raise cls(f"checkpoint {saved.dir} is damaged: " + "; ".join(rep.problems))
