"""One checkpoint file read whole into the state dict DeepSpeed saved, every byte of this project's
format checked first, and files read ahead so a load can refuse damage before it installs anything.

DeepSpeed's own load reads a rank's files one after the other (the model-state file, installed into
the module, then the optimizer-state file): a damaged optimizer file found second would leave the
module holding the checkpoint's weights beside the old optimizer state. :class:`ReadAhead` reads
every file a rank will load first, keeps what it read, and hands it back whenever DeepSpeed asks for
it (no second read), so a damaged file fails the load before anything changes.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List

import torch

from io_engine.format import MAGIC

from ..errors import CheckpointCorruptError, CheckpointIncompleteError
from .module_master import MARKER, rebuild_working
from .saved import MODEL_FILE, MODEL_FILE_ZERO3
from .saved_file import safe_globals


def read_state_file(path: str, map_location=None) -> Any:
    """The object ``torch.save`` or this project's snapshot engine wrote to ``path``.

    This project's files are read with every item's checksum verified (tensors come back as
    tensors of their saved dtype and shape, moved to ``map_location`` when it is a device or its
    name; a ZeRO-1/2 model-state file's working parameters left to the fp32 master are rebuilt
    from the directory's optimizer-state files, :mod:`.module_master`); DeepSpeed's are loaded
    with ``torch.load(weights_only=True)`` (DeepSpeed's types allow-listed: no code from a file
    runs).

    Raises:
        CheckpointCorruptError: a checksum mismatch (naming the file, the item and the byte range).
        CheckpointIncompleteError: the file is missing, truncated or its metadata is damaged; an
            optimizer-state file a model-state file's working parameters are rebuilt from is.
    """
    from io_engine import read_snapshot_file
    from io_engine.errors import ChecksumMismatchError, IOEngineError
    from state_providers import DictStateProvider

    try:
        with open(path, "rb") as f:
            ours = f.read(len(MAGIC)) == MAGIC
    except OSError as err:
        raise CheckpointIncompleteError(f"cannot read {path}: {err.strerror or err}") from None
    if not ours:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    try:
        raw = read_snapshot_file(path)
    except ChecksumMismatchError as err:
        raise CheckpointCorruptError(str(err)) from None
    except IOEngineError as err:
        raise CheckpointIncompleteError(f"damaged file {path}: {err}") from None
    items = {}
    try:
        for key, (view, meta) in raw.items():
            if meta.kind == "object":
                items[key] = bytes(view)
                continue
            if meta.nbytes == 0:  # torch.frombuffer refuses an empty buffer
                t = torch.empty(tuple(meta.shape), dtype=getattr(torch, meta.dtype))
            else:
                t = torch.frombuffer(view, dtype=torch.uint8).view(getattr(torch, meta.dtype))
                t = t.reshape(tuple(meta.shape))
                if isinstance(map_location, (str, torch.device)):
                    t = t.to(map_location)
            items[key] = t
        state = DictStateProvider.rebuild(items)
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as err:
        raise CheckpointIncompleteError(f"damaged file {path}: its items do not rebuild a state ({err})") from None
    if isinstance(state, dict) and MARKER in state:  # working parameters the snapshot left to the master
        state = rebuild_working(state, path, map_location)
    return state


def files_loaded_by(saved, rank: int) -> List[str]:
    """The files DeepSpeed's own load reads on data-parallel rank ``rank`` of the saving layout
    (``saved``: a :class:`~ds_dynatrain.checkpoint.saved.SavedCheckpoint`): the model-state file
    (ZeRO-1/2: the one of rank 0; ZeRO-3: the rank's own) and the rank's optimizer-state file."""
    model = MODEL_FILE_ZERO3.format(rank) if saved.stage == 3 else MODEL_FILE
    return [os.path.join(saved.dir, model), os.path.join(saved.dir, saved.optim_name(rank))]


class ReadAhead:
    """Files read (and checked) before a load, handed back whenever the load asks for them until
    :meth:`clear`: DeepSpeed's own load reads the model-state file twice (``SDLoaderBase.
    check_ckpt_list``, then ``load``; deepspeed/runtime/state_dict_factory.py), and a ZeRO-1/2
    snapshot's rebuilds its module from every rank's master partitions each time it is read.

    ``read(paths)`` reads every path with :func:`read_state_file` (raising its errors, nothing kept
    on failure); ``take(path)`` returns what was read for ``path`` (the same object each time), or
    None; ``clear()`` forgets everything.
    """

    def __init__(self):
        self._kept: Dict[str, Any] = {}

    def read(self, paths: Iterable[str]) -> None:
        kept = {}
        for p in paths:
            kept[os.path.abspath(p)] = read_state_file(p, map_location="cpu")
        self._kept = kept

    def take(self, path: str) -> Any:
        return self._kept.get(os.path.abspath(path))

    def clear(self) -> None:
        self._kept.clear()
