"""One file of a checkpoint opened for reading: this project's snapshot format (every byte read
checked against its checksum, large tensors left unread as :class:`TensorRef` until asked for) or
DeepSpeed's ``torch.save`` format (memory-mapped where it can be)."""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import torch

from ..errors import CheckpointCorruptError, CheckpointIncompleteError

EAGER_BYTES = 64 << 10  # tensors up to this size are read with the skeleton (scalars, small states)


def safe_globals() -> list:
    """Types DeepSpeed puts in its checkpoint dicts, allowed for ``weights_only`` loading (loading
    never executes code from a file)."""
    from state_providers.serialize import allowed_classes

    return list(allowed_classes().values())


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
            try:
                self._open_ours(path)
            except BaseException:
                self.close()  # no file or queue left open by a refused file
                raise
        else:
            self._open_torch(path)

    def _open_ours(self, path: str) -> None:
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
            if not isinstance(dtype, torch.dtype) or m.shape is None:
                raise ValueError(f"item {m.key} is not a tensor ({m.dtype}, shape {m.shape})")
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

    def _open_torch(self, path: str) -> None:
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
