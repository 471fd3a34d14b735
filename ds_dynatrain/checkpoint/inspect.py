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
2. every item of this project's files read with its checksum (CRC-32C; CRC-32 in older files)
   checked against the footer (a flipped byte anywhere in a tensor or object is found);
   DeepSpeed's ``torch.save`` files have no checksums, so each is loaded with
   ``torch.load(weights_only=True)`` and the report says the checksums are not available;
3. the saved layout (rebuilt from ``param_shapes``) tiles every parameter exactly once over the
   saving ranks' fragments, and every rank's partitions (fp32 master and moments) are long enough
   for their fragments and no longer than the layout's partitions; in this project's files the
   fragments each partition records (``vps`` attributes) must be the layout's;
4. every rank's model-state file (ZeRO-3) was saved at the same step by the same world.

Every problem is collected and reported (file, item, parameter), not only the first.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional

from .consolidate import plan_entries
from .saved import MODEL_FILE_TP, MODEL_FILE_ZERO3_TP, SavedCheckpoint, is_snapshot_file
from .saved_pp import band_layout_from_metadata
from .verify import VerifyReport, refuse_damaged, verify_checkpoint  # noqa: F401 - verify's names, here too

LAYER_FILE = re.compile(r"layer_\d+-model_states\.pt")  # PipelineModule.save_state_dict's, one per layer
FORMAT_OURS = "dynatrain"  # this project's snapshot format
FORMAT_DEEPSPEED = "deepspeed"  # DeepSpeed's torch.save format


def _files_of_rank(saved: SavedCheckpoint, rank: int, tp_rank: int = 0) -> List[str]:
    names = [saved.optim_name(rank, tp_rank)]
    if saved.stage == 3:
        names.append(MODEL_FILE_ZERO3_TP.format(rank, tp_rank))
    elif rank == 0:
        names.append(MODEL_FILE_TP.format(tp_rank))
    return [os.path.join(saved.dir, n) for n in names]


def inspect_report(load_dir: str, tag: Optional[str] = None, checksums: bool = True) -> dict:
    """What the checkpoint ``load_dir/tag`` (``tag`` None: ``latest``) holds, as a JSON-ready dict:

    ``dir``, ``tag``, ``format`` (``"dynatrain"``, ``"deepspeed"`` or ``"mixed"``),
    ``world_size`` (every process: TP x DP or PP x DP), ``tensor_parallel`` (AutoTP degree; 1
    without), ``pipeline_parallel`` (stages; 1 without), ``zero_stage``, ``step``,
    ``global_samples``, ``working_dtype``, ``ds_version``;
    ``parameters``: ``[{"name", "shape", "numel", "trainable"}]`` (trainable ones in the
    optimizer's order with their whole shapes, TP shards joined; a pipeline's by name, a tied one
    once; then frozen ones),
    ``num_parameters`` (elements, all of them), ``num_trainable``; ``tied``: ``{alias: name}``;
    ``buffers``: names; ``ranks``:
    ``[{"rank", "bytes", "files"}]`` (global ranks, DP rank x TP + TP rank, or stage x DP + DP
    rank; file sizes in bytes; ZeRO-1/2's model-state file of each TP rank or stage counts for its
    DP rank 0); ``layer_files``: a pipeline's ``layer_XX-model_states.pt`` names; ``total_bytes``
    (the layer files included).

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
        layout = band_layout_from_metadata(saved)  # whole shapes (TP 1: the ZeRO layout of param_shapes)
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
        layers = sorted(n for n in os.listdir(saved.dir) if LAYER_FILE.fullmatch(n))  # a pipeline's module
        ranks = []
        for r in range(saved.world_size * saved.mp):
            files = _files_of_rank(saved, *saved.coords(r))
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
            "world_size": saved.world_size * saved.mp,
            "tensor_parallel": saved.tp,
            "pipeline_parallel": saved.pp,
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
            "layer_files": layers,
            "total_bytes": sum(r["bytes"] for r in ranks)
            + sum(os.path.getsize(os.path.join(saved.dir, n)) for n in layers),
        }
    finally:
        saved.close()
