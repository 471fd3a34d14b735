"""Reading whole snapshot files or just given byte ranges, with io_uring and O_DIRECT.

A restore onto a new layout needs only the byte ranges of the regions this rank will hold, so the
unit of reading is a range ``(offset, length)`` in bytes, not a file. Each range is widened to
whole blocks (``alignment``, 4096 bytes) so it can be read with O_DIRECT into a page-aligned
buffer, split into ``chunk_bytes`` reads, ``queue_depth`` of them in flight; the caller gets a
``memoryview`` of exactly the bytes asked for (a view into that buffer, no extra copy). The
fallbacks are the flusher's (``backend.py``): a thread pool when io_uring is refused, buffered
reads when O_DIRECT is.

Verified reads (:meth:`FileReader.read_items`, :meth:`FileReader.read_item_ranges`) check every
byte they return against the footer: a part of a tensor is widened to the checksum blocks that
cover it (format versions 2 and 3), an object or a version-1 item is read and checked whole; a
mismatch raises :class:`~io_engine.errors.ChecksumMismatchError` naming the file, the item key and the byte
range. The footer itself is always checked. :meth:`FileReader.read_ranges` reads raw bytes.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .backend import FileChannel, IOBackend, IOConfig, Op
from .checksum import crc_update
from .errors import ChecksumMismatchError, StorageReadError
from .format import FileLayout, ItemMeta, align_down, align_up, format_checksum
from .host_cache import alloc_aligned
from .ioqueue import QueueFactory
from .validate import read_footer

Range = Tuple[int, int]
_EMPTY = memoryview(b"")


def _read_spans(
    channel: FileChannel,
    file_size: int,
    ranges: Sequence[Range],
    on_range_done: Optional[Callable[[int, memoryview], None]] = None,
) -> List[memoryview]:
    """Read ``ranges``; ``on_range_done(i, view)`` is called (on this thread, while later reads
    are still in flight) as soon as every byte of range ``i`` has arrived."""
    cfg = channel.backend.config
    align, chunk = cfg.alignment, cfg.chunk_bytes
    spans, total = [], 0
    for r in ranges:
        off, length = int(r[0]), int(r[1])
        if off < 0 or length < 0 or off + length > file_size:
            raise StorageReadError(
                channel.path, f"range [{off}, {off + length}) lies outside the file of {file_size} bytes", offset=off
            )
        lo, hi = (align_down(off, align), align_up(off + length, align)) if length else (off, off)
        spans.append((off, length, lo, hi, total))
        total += hi - lo
    whole = memoryview(alloc_aligned(total)) if total else _EMPTY
    views = [
        whole[pos + off - lo : pos + off - lo + length] if length else _EMPTY for off, length, lo, hi, pos in spans
    ]
    for i, (_off, _len, lo, hi, pos) in enumerate(spans):
        starts = range(lo, hi, chunk)
        if on_range_done is None:
            done = None
        elif not starts:
            on_range_done(i, views[i])
            continue
        else:
            done = _Countdown(len(starts), partial(on_range_done, i, views[i]))
        for s in starts:
            e = min(hi, s + chunk)
            channel.submit(
                Op(False, whole[pos + s - lo : pos + e - lo], s, need=min(e, file_size) - s, on_release=done)
            )
    channel.drain()
    return views


class _Countdown:
    """Calls ``fn`` after ``n`` calls (single-threaded: completions are reaped on one thread)."""

    __slots__ = ("n", "fn")

    def __init__(self, n: int, fn: Callable[[], None]):
        self.n, self.fn = n, fn

    def __call__(self) -> None:
        self.n -= 1
        if self.n == 0:
            self.fn()


def read_ranges(
    path: str, ranges: Iterable[Range], *, config: Optional[IOConfig] = None, backend: Optional[IOBackend] = None
) -> List[memoryview]:
    """Read byte ranges ``(offset, length)`` of any file; returns one read-write ``memoryview``
    (format ``'B'``) per range, of exactly ``length`` bytes, in the order given.

    Raises :class:`StorageReadError` when a range lies outside the file or the read fails.
    """
    channel = FileChannel(backend or IOBackend(config), path, write=False)
    try:
        return _read_spans(channel, os.fstat(channel.fd).st_size, list(ranges))
    finally:
        channel.close()


@dataclass(frozen=True)
class _Span:
    """A verified read: file bytes ``[lo, hi)`` are read, ``checks`` are ``(begin, end,
    checksum)`` relative to ``lo``, and the caller gets ``[start, start + length)`` (file offsets)."""

    key: str
    lo: int
    hi: int
    start: int
    length: int
    checks: List[Tuple[int, int, str]]


class FileReader:
    """One snapshot file opened for reading. The footer is read and validated on construction
    (raising the format errors of ``read_footer``); payloads are read on demand.

    ``layout`` is the file's :class:`FileLayout`. Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        path: str,
        *,
        config: Optional[IOConfig] = None,
        backend: Optional[IOBackend] = None,
        queue_factory: Optional[QueueFactory] = None,
        opener=None,
    ):
        self.path = path
        self.backend = backend or IOBackend(config, queue_factory=queue_factory, opener=opener)
        self.layout: FileLayout = read_footer(path)
        self._by_key: Dict[str, ItemMeta] = {it.key: it for it in self.layout.items}
        self._channel: Optional[FileChannel] = None

    def _ch(self) -> FileChannel:
        if self._channel is None:
            self._channel = FileChannel(self.backend, self.path, write=False)
        return self._channel

    @property
    def keys(self) -> Tuple[str, ...]:
        return self.layout.keys

    def meta(self, key: str) -> ItemMeta:
        """Footer entry of ``key`` (``KeyError`` if absent)."""
        return self._by_key[key]

    @property
    def engine(self) -> str:
        return self._ch().engine

    @property
    def direct(self) -> bool:
        return self._ch().direct

    def read_ranges(self, ranges: Iterable[Range]) -> List[memoryview]:
        """Exactly the requested bytes of each ``(offset, length)``; not checksummed.
        Raises :class:`StorageReadError`."""
        return _read_spans(self._ch(), self.layout.file_size, list(ranges))

    def read_items(self, keys: Optional[Iterable[str]] = None, *, verify: bool = True) -> Dict[str, memoryview]:
        """Payloads of ``keys`` (default: all, in file order) as ``key -> memoryview``.

        With ``verify`` every byte read is checked against the footer (a version-2 or 3 tensor's
        blocks, its zero padding included; an object's or a version-1 item's whole CRC): a
        mismatch raises :class:`ChecksumMismatchError` naming the file, the key and the byte
        range. ``KeyError`` for unknown keys.
        """
        metas = list(self.layout.items) if keys is None else [self._by_key[k] for k in keys]
        if not verify:
            return {m.key: v for m, v in zip(metas, self.read_ranges([(m.offset, m.nbytes) for m in metas]))}
        views = self.read_item_ranges([(m.key, 0, m.nbytes) for m in metas])
        return {m.key: v for m, v in zip(metas, views)}

    def read_item_ranges(self, requests: Iterable[Tuple[str, int, int]]) -> List[memoryview]:
        """Bytes ``[start, start + length)`` of item ``key``'s payload for each ``(key, start,
        length)``, verified: each is widened to the checksum blocks that cover it (versions 2, 3
        tensors) or to the whole item (objects, version-1 files), read in one batch, and every
        block checked before the exact views are returned.

        Raises:
            ChecksumMismatchError: naming the file, the key and the byte range that differ.
            StorageReadError: a range lies outside its item, or the read fails.
            KeyError: an unknown key.
        """
        spans = [self._span(self._by_key[k], int(start), int(length)) for k, start, length in requests]
        algo = self.layout.algo
        # CRC each block on a helper thread as soon as its span has arrived (both algorithms
        # release the GIL), so verification overlaps the reads still in flight.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_dynatrain-crc") as pool:
            crcs: Dict[int, list] = {}

            def on_done(i: int, view: memoryview) -> None:
                crcs[i] = [pool.submit(crc_update, algo, view[a:b]) for a, b, _want in spans[i].checks]

            views = _read_spans(self._ch(), self.layout.file_size, [(s.lo, s.hi - s.lo) for s in spans], on_done)
            for i, sp in enumerate(spans):
                for (a, b, want), fut in zip(sp.checks, crcs.get(i, [])):
                    actual = format_checksum(fut.result(), algo)
                    if actual != want:
                        raise ChecksumMismatchError(self.path, sp.key, want, actual, sp.lo + a, b - a)
        return [views[i][sp.start - sp.lo : sp.start - sp.lo + sp.length] for i, sp in enumerate(spans)]

    def _span(self, m: ItemMeta, start: int, length: int) -> "_Span":
        """What to read for bytes ``[start, start + length)`` of ``m`` and which checks apply."""
        if start < 0 or length < 0 or start + length > m.nbytes:
            raise StorageReadError(
                self.path, f"bytes [{start}, {start + length}) lie outside item {m.key!r} of {m.nbytes} bytes"
            )
        if m.blocks is None:  # an object, or a version-1 file: the whole item is under one CRC
            return _Span(m.key, m.offset, m.offset + m.nbytes, m.offset + start, length, [(0, m.nbytes, m.checksum)])
        if length == 0:
            return _Span(m.key, m.offset, m.offset, m.offset, 0, [])
        bb, extent = self.layout.block_bytes, self.layout.extent(m)
        first, last = start // bb, (start + length - 1) // bb
        lo, hi = m.offset + first * bb, m.offset + min(extent, (last + 1) * bb)
        checks = [
            ((b - first) * bb, min(extent - first * bb, (b - first + 1) * bb), m.blocks[b])
            for b in range(first, last + 1)
        ]
        return _Span(m.key, lo, hi, m.offset + start, length, checks)

    def read_item(self, key: str, *, verify: bool = True) -> memoryview:
        """Payload of one item (see :meth:`read_items`)."""
        return self.read_items([key], verify=verify)[key]

    def close(self) -> None:
        if self._channel is not None:
            ch, self._channel = self._channel, None
            ch.close()

    def __enter__(self) -> "FileReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
