"""Every checksum of a saved checkpoint's files checked: what ``verify`` reports item by item, and
what ``inspect`` and ``export`` require before they describe or consolidate anything."""

from __future__ import annotations

import os
from typing import List

from ..errors import CheckpointCorruptError
from .saved import SavedCheckpoint
from .saved_file import is_snapshot_file

VERIFY_BATCH_BYTES = 256 << 20  # bytes of items read (and checksummed) at a time


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
    """Read every item of every file of this project's format in ``saved`` with its checksums
    checked (DeepSpeed's ``torch.save`` files have none and are skipped).

    Raises:
        CheckpointCorruptError: naming every damaged file, item and byte range.
    """
    problems: List[str] = []
    for path in saved.files:
        if is_snapshot_file(path):
            check_items(path, problems)
    if problems:
        raise CheckpointCorruptError(f"checkpoint {saved.dir} is damaged: " + "; ".join(problems))
