"""Real text as byte-level training samples (vocabulary of 256, no tokenizer download)."""

from __future__ import annotations

import os
import sysconfig
from typing import List, Optional

import torch
from torch.utils.data import Dataset


def stdlib_sources() -> List[str]:
    """The ``.py`` files of the running interpreter's standard library, sorted (present everywhere)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "test", "tests", "__pycache__"))
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return out


def _looks_like_text(path: str) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(4096)


def text_files(path: str) -> List[str]:
    """A text file, or the text files under a folder (sorted; hidden folders, ``__pycache__`` and
    files with NUL bytes in their first 4 KiB, i.e. binaries, are skipped)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--data {path!r}: no such file or folder")
    out = []
    for d, dirs, files in os.walk(path):
        dirs[:] = sorted(x for x in dirs if not x.startswith(".") and x != "__pycache__")
        out += [os.path.join(d, f) for f in sorted(files) if _looks_like_text(os.path.join(d, f))]
    return out


class ByteTextDataset(Dataset):
    """Non-overlapping windows of ``seq_len`` bytes of the concatenated files.

    Each sample is a ``torch.long`` tensor of shape ``(seq_len,)`` with values in ``[0, 256)``.

    Args:
        path: a text file or folder; None = the Python standard library's sources.
        seq_len: tokens (bytes) per sample.
        max_bytes: read at most this many bytes (keeps start-up short).

    Raises:
        ValueError: fewer than ``seq_len`` bytes of text.
    """

    def __init__(self, path: Optional[str] = None, seq_len: int = 128, max_bytes: int = 8 << 20):
        files = stdlib_sources() if path is None else text_files(path)
        chunks, total = [], 0
        for f in files:
            with open(f, "rb") as fh:
                b = fh.read(max_bytes - total)
            chunks.append(b)
            total += len(b)
            if total >= max_bytes:
                break
        data = b"".join(chunks)
        n = len(data) // seq_len
        if n == 0:
            raise ValueError(f"need at least {seq_len} bytes of text, found {len(data)}")
        self.tokens = torch.frombuffer(bytearray(data[: n * seq_len]), dtype=torch.uint8).view(n, seq_len)
        self.source = "Python standard library" if path is None else path

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i].long()
