"""Writing and reading one snapshot file: the facade over format, host cache, flusher and reader.

``write_snapshot_file(path, items)`` plans the layout (``format.plan_layout``) and writes each
tensor payload in one of two ways (CRC-32C in hardware where it loads, format version 3, else
``zlib.crc32``, version 2; :mod:`io_engine.checksum`, with the GIL released):

* **From its own memory**, when it is at least one block (4096 bytes) long and its address is a
  multiple of what the file asks of a buffer's address (:mod:`io_engine.dio_align`: with O_DIRECT
  the file system's memory alignment as ``statx`` reports it, 512 bytes on common disks, else the
  block; 1 with buffered I/O). So a module parameter at any 512-byte offset of DeepSpeed's flat
  buffer qualifies as well as a tensor of its own (torch's CPU allocator places tensors of 2 MiB
  or more on a page under ``THP_MEM_ALLOC_ENABLE=1``, which ``dynatrain launch`` sets). Its whole
  blocks are handed to the flusher as they are and checksummed from the source while their writes
  are in flight; only its last partial block goes through the host cache. No copy: with O_DIRECT the device reads the
  memory itself, and the copy is what a snapshot would cost the CPUs training runs on (a
  ``memmove`` competing with the training ranks for memory bandwidth). The source must stay
  unchanged until those writes completed, so ``on_captured`` waits for them (the flush of that
  tensor, not only a copy of it); a source changed earlier gives a file whose checksums do not
  match its bytes, which every reader refuses (never a silent wrong value).
* **Through the host cache** otherwise (or with ``from_source=False``): copied into aligned
  buffers in one ``memmove`` per buffer and checksummed block by block from the copy right after,
  which is what the file holds, so checksum and payload agree even if the source changes later;
  each filled buffer goes to the flusher and comes back when its write completed. Objects and the
  footer are packed through the same buffers (:func:`~io_engine.checksum.copy_with_crc`).

Order of work in the file:

0. the file's whole size reserved where it is written with O_DIRECT (:mod:`io_engine.preallocate`),
   so the payload writes run side by side under the shared inode lock;
1. header block and tensor payloads, then objects (packed, through the same buffers);
2. a barrier: every write so far has completed;
3. footer (JSON) and trailer, then ``ftruncate`` to the logical size and ``fsync``.

A failure anywhere removes the partial file and raises; a footer is never written after a
failed payload write. Publication (rename into a snapshot directory, ``latest``) is ``commit.py``'s.

The io engine stays free of torch: items are byte views (``bytes``, ``memoryview``, ``mmap``,
numpy arrays, or ``tensor.numpy()`` from the caller); dtype and shape are taken from numpy arrays
or given explicitly (e.g. ``"bfloat16"``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from .backend import IOBackend, IOConfig
from .checksum import copy_bytes, copy_with_crc, crc_update, default_algo
from .errors import InvalidItemError, IOEngineError
from .flusher import Flusher, WriteReport, WriteSession, as_byte_view
from .format import (
    BLOCK_BYTES,
    KIND_OBJECT,
    KIND_TENSOR,
    FileLayout,
    ItemMeta,
    ItemSpec,
    align_up,
    block_count,
    blocks_checksum,
    encode_footer,
    encode_header,
    encode_trailer,
    format_checksum,
    plan_layout,
    version_of,
)
from .host_cache import HostBuffer, HostCache, buffer_address
from .reader import FileReader


@dataclass(frozen=True)
class WriteItem:
    """One payload to store. ``data``: a C-contiguous buffer (bytes, memoryview, numpy array...);
    ``kind``: ``"tensor"`` or ``"object"``; ``attrs``: JSON-serializable dict stored in the footer;
    ``dtype``/``shape``: override what is inferred from ``data`` (numpy arrays carry their own)."""

    key: str
    data: Any
    kind: str = KIND_TENSOR
    attrs: Mapping[str, Any] = field(default_factory=dict)
    dtype: Optional[str] = None
    shape: Optional[Tuple[int, ...]] = None


ItemLike = Union[WriteItem, Tuple]


def _to_item(x: ItemLike) -> WriteItem:
    if isinstance(x, WriteItem):
        return x
    if isinstance(x, tuple) and 2 <= len(x) <= 4:
        return WriteItem(*x)
    raise InvalidItemError(f"expected WriteItem or (key, data[, kind[, attrs]]), got {type(x).__name__}")


def _describe(item: WriteItem) -> Tuple[ItemSpec, memoryview]:
    """The item's spec (dtype, shape, size) and its payload as a flat byte view (no copy)."""
    data, dtype, shape = item.data, item.dtype, item.shape
    try:
        if type(data).__module__ == "numpy" and hasattr(data, "flags"):
            if not data.flags.c_contiguous:
                raise InvalidItemError(f"item {item.key!r}: numpy array is not C-contiguous")
            dtype = dtype or data.dtype.name
            shape = data.shape if shape is None else shape
            view = memoryview(data.reshape(-1).view("uint8"))
        else:
            raw = memoryview(data)
            if not raw.c_contiguous:
                raise InvalidItemError(f"item {item.key!r}: buffer is not C-contiguous")
            if dtype is None and item.kind == KIND_TENSOR:
                dtype = "uint8" if raw.format in ("B", "b", "c") else _numpy_name(raw.format)
            if shape is None and item.kind == KIND_TENSOR:
                shape = raw.shape
            view = as_byte_view(raw)
    except TypeError as e:
        raise InvalidItemError(f"item {item.key!r}: data is not a buffer: {e}") from None
    if item.kind == KIND_OBJECT:
        dtype = dtype or "bytes"
    spec = ItemSpec(key=item.key, nbytes=len(view), kind=item.kind, dtype=dtype, shape=shape, attrs=item.attrs)
    return spec, view


def _numpy_name(fmt: str) -> str:
    import numpy as np

    try:
        return np.dtype(fmt).name
    except TypeError:
        return "uint8"


class _Blocks:
    """Block checksums of one tensor item's stored extent, fed in order: finished blocks, the
    running checksum of the current one and how many of its bytes have arrived."""

    __slots__ = ("algo", "done", "crc", "fill")

    def __init__(self, algo: str):
        self.algo = algo
        self.done: List[int] = []
        self.crc = 0
        self.fill = 0

    def copy(self, dst: memoryview, src: Optional[memoryview]) -> None:
        """Copy ``src`` into ``dst`` (one pass, :func:`~io_engine.checksum.copy_with_crc`), or
        checksum ``dst`` as it is when ``src`` is None, block by block."""
        pos = 0
        while pos < len(dst):
            take = min(BLOCK_BYTES - self.fill, len(dst) - pos)
            piece = dst[pos : pos + take]
            if src is None:
                self.crc = crc_update(self.algo, piece, self.crc)
            else:
                self.crc = copy_with_crc(self.algo, piece, src[pos : pos + take], self.crc)
            self.fill += take
            pos += take
            if self.fill == BLOCK_BYTES:
                self.done.append(self.crc)
                self.crc, self.fill = 0, 0

    def result(self) -> List[int]:
        return self.done + ([self.crc] if self.fill else [])


@dataclass(frozen=True)
class WriteResult:
    """``layout``: the written file's layout, checksums included; ``report``: the flusher's;
    ``from_source_bytes``: payload bytes written straight from the items' own memory (no copy
    through the host cache)."""

    layout: FileLayout
    report: WriteReport
    from_source_bytes: int = 0


class SnapshotFileWriter:
    """Writes snapshot files through one host cache and one flusher, both reused across files so
    host memory stays flat. Owns (and closes) whatever it created itself.

    ``host_cache``: buffers to copy through (default: ``cache_bytes`` in buffers of
    ``config.chunk_bytes``); ``flusher``: how to write (default: ``Flusher(config)``);
    ``acquire_timeout_s``: longest wait for a free buffer (default ``config.timeout_s``);
    ``checksum``: the payload checksum, ``"crc32c"`` (format version 3) or ``"crc32"`` (version
    2); default :func:`~io_engine.checksum.default_algo` (CRC-32C where the hardware one loads);
    ``from_source``: write a tensor whose address is a multiple of the file's memory alignment
    (:attr:`~io_engine.flusher.WriteSession.memory_alignment`) straight from its memory (default
    True; False copies every payload through the host cache). See the module docstring.

    One :meth:`write` at a time (call it from one thread, e.g. the snapshot engine's flush
    thread); the host cache itself may be shared with other threads.
    """

    def __init__(
        self,
        *,
        host_cache: Optional[HostCache] = None,
        flusher: Optional[Flusher] = None,
        config: Optional[IOConfig] = None,
        cache_bytes: int = 64 << 20,
        acquire_timeout_s: Optional[float] = None,
        checksum: Optional[str] = None,
        from_source: bool = True,
    ):
        self.algo = checksum or default_algo()
        self.from_source = from_source
        self._sources_in_flight = 0
        self.version = version_of(self.algo)  # ValueError for an unknown algorithm, before anything is made
        self.flusher = flusher or Flusher(config)
        cfg = self.flusher.config
        self._own_cache = host_cache is None
        self.cache = host_cache or HostCache(
            max(cache_bytes, cfg.chunk_bytes), cfg.chunk_bytes, alignment=cfg.alignment
        )
        if self.cache.buffer_bytes % cfg.alignment:
            raise ValueError(
                f"host cache buffers ({self.cache.buffer_bytes} bytes) are not a "
                f"multiple of the alignment {cfg.alignment}"
            )
        self._align = cfg.alignment
        self._zeros = bytes(cfg.alignment)
        self._timeout = acquire_timeout_s or cfg.timeout_s

    def _acquire(self, session: WriteSession) -> HostBuffer:
        while True:
            buf = self.cache.try_acquire()
            if buf is not None:
                return buf
            if session.in_flight:
                session.reap_one()  # our own writes give buffers back
            else:
                return self.cache.acquire(timeout=self._timeout)

    def _submit(
        self,
        session: WriteSession,
        buf: HostBuffer,
        nbytes: int,
        offset: int,
        on_release: Optional[Callable[[], None]] = None,
    ) -> None:
        padded = align_up(nbytes, self._align)
        if padded > nbytes:
            buf.view[nbytes:padded] = self._zeros[: padded - nbytes]
        session.write(buf.view[:padded], offset, on_release=on_release or partial(self.cache.release, buf))

    def _put_aligned(self, session: WriteSession, src: memoryview, offset: int, blocks: Optional[_Blocks]) -> None:
        """Copy ``src`` through the cache to ``offset`` (aligned), zero padded to the alignment;
        with ``blocks``, the copy and its padding are checksummed from the buffer right after the
        copy (one ``memmove`` per buffer, one CRC call per block: few GIL hand-overs)."""
        pos, size = 0, self.cache.buffer_bytes
        while pos < len(src):
            take = min(size, len(src) - pos)
            buf = self._acquire(session)
            padded = align_up(take, self._align)
            try:
                piece = src[pos : pos + take]
                buf.view[take:padded] = self._zeros[: padded - take]
                copy_bytes(buf.view[:take], piece)
                if blocks is not None:  # checksummed from the copy, one GIL hand-over per block
                    blocks.copy(buf.view[:padded], None)
            except BaseException:
                self.cache.release(buf)
                raise
            self._submit(session, buf, take, offset + pos)
            pos += take

    def _put_from_source(self, session: WriteSession, src: memoryview, offset: int, blocks: _Blocks) -> int:
        """Write ``src`` (aligned) to ``offset`` straight from its own memory, no copy: its
        aligned bulk in pieces of a cache buffer, each checksummed from the source while its write
        is in flight; the last partial block (under the alignment) goes through the cache. The
        source must not change until :meth:`_wait_sources` returned. Returns the bytes written from
        the source."""
        bulk = len(src) - len(src) % self._align
        step = self.cache.buffer_bytes
        for pos in range(0, bulk, step):
            piece = src[pos : min(bulk, pos + step)]
            self._sources_in_flight += 1
            session.write(piece, offset + pos, on_release=self._source_written)
            blocks.copy(piece, None)
        if bulk < len(src):
            self._put_aligned(session, src[bulk:], offset + bulk, blocks)
        return bulk

    def _source_written(self) -> None:
        self._sources_in_flight -= 1  # completions are reaped on the writing thread

    def _wait_sources(self, session: WriteSession) -> None:
        """Wait until every write from a source's own memory completed (raises its failure).

        Raises :class:`IOEngineError` rather than wait forever if the session has nothing in
        flight while such writes are unaccounted for (a flusher that lost a release)."""
        while self._sources_in_flight > 0:
            if not session.in_flight:  # a reap re-issues retried writes before it returns
                raise IOEngineError(
                    f"{session.path}: internal error: {self._sources_in_flight} writes from memory never completed"
                )
            session.reap_one()

    def write(
        self,
        path: str,
        items: Iterable[ItemLike],
        *,
        file_attrs: Optional[Mapping[str, Any]] = None,
        on_captured: Optional[Callable[[], None]] = None,
    ) -> WriteResult:
        """Write ``items`` (``WriteItem`` or ``(key, data[, kind[, attrs]])``) as a new snapshot
        file at ``path`` (replacing any file there), durable (fsynced) on return.

        ``on_captured`` is called once no tensor payload is read from its source any more: each
        was copied into the host cache, or (aligned sources) its writes straight from the source
        completed. The sources may change from then on; writes from the cache may still be in
        flight. It is called on failure too, once every write in flight completed, so a waiter
        never blocks on a write that gave up; only after a storage timeout
        (:class:`~io_engine.errors.IOTimeoutError`) may a write given up still read its source
        (the file is removed either way).

        Raises :class:`InvalidItemError` before touching the file for bad items, and
        :class:`~io_engine.errors.StorageWriteError` (file removed) when storage fails.
        """
        described = [_describe(_to_item(x)) for x in items]
        layout = plan_layout(
            [s for s, _ in described], alignment=self._align, file_attrs=file_attrs, version=self.version
        )
        views = {s.key: v for s, v in described}
        session = self.flusher.open(path)
        self._sources_in_flight = 0
        tail = _TailPacker(self, session, layout.objects_offset)
        try:
            session.reserve(layout.file_size)  # aligned writes inside the file: the inode lock shared
            checksums: Dict[str, str] = {}
            crcs: Dict[str, _Blocks] = {}
            header = encode_header(layout.file_size, self._align, layout.version)
            self._put_aligned(session, memoryview(header), 0, None)
            from_source = 0
            for m in layout.items:
                if m.kind == KIND_TENSOR:
                    crcs[m.key] = _Blocks(self.algo)
                    src = views[m.key]
                    if (
                        self.from_source
                        and len(src) >= self._align
                        and buffer_address(src) % session.memory_alignment == 0
                    ):
                        from_source += self._put_from_source(session, src, m.offset, crcs[m.key])
                    else:
                        self._put_aligned(session, src, m.offset, crcs[m.key])
            self._wait_sources(session)  # the sources are no longer read: they may change now
            if on_captured is not None:
                captured, on_captured = on_captured, None
                captured()
            for m in layout.items:
                if m.kind == KIND_OBJECT:
                    checksums[m.key] = format_checksum(tail.put(views[m.key]), self.algo)
            session.drain()  # every payload write completed before the footer
            blocks = {}
            for m in layout.items:
                if m.kind == KIND_TENSOR:
                    got = crcs[m.key].result()
                    if len(got) != block_count(layout.extent(m), layout.block_bytes):
                        raise IOEngineError(f"{path}: internal error: item {m.key!r} has {len(got)} checksum blocks")
                    blocks[m.key] = [format_checksum(c, self.algo) for c in got]
                    checksums[m.key] = format_checksum(blocks_checksum(got, self.algo), self.algo)
            layout = layout.with_checksums(checksums, blocks)
            footer = encode_footer(layout)
            if len(footer) != layout.footer_length:
                raise IOEngineError(
                    f"{path}: internal error: footer is {len(footer)} bytes, planned {layout.footer_length}"
                )
            tail.put(footer)
            tail.put(encode_trailer(footer, layout.version))
            tail.close()
            report = session.finish(layout.file_size)
        except BaseException:
            tail.discard()
            session.abort()  # waits for every write in flight, those from the sources too
            if on_captured is not None:
                on_captured()
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        return WriteResult(layout, report, from_source)

    def close(self) -> None:
        """Close the host cache if this writer created it. Idempotent."""
        if self._own_cache and getattr(self, "cache", None) is not None:
            self.cache.close()

    def __enter__(self) -> "SnapshotFileWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _TailPacker:
    """Packs a byte stream (objects, footer, trailer) into cache buffers from an aligned offset."""

    def __init__(self, writer: SnapshotFileWriter, session: WriteSession, offset: int):
        self._w, self._session, self._offset = writer, session, offset
        self._buf: Optional[HostBuffer] = None
        self._fill = 0

    def put(self, data) -> int:
        """Append ``data``; returns its checksum (the writer's algorithm, computed from the copy
        in the same pass)."""
        src, crc, pos = as_byte_view(data), 0, 0
        size = self._w.cache.buffer_bytes
        while pos < len(src):
            if self._buf is None:
                self._buf, self._fill = self._w._acquire(self._session), 0
            take = min(len(src) - pos, size - self._fill)
            dst = self._buf.view[self._fill : self._fill + take]
            crc = copy_with_crc(self._w.algo, dst, src[pos : pos + take], crc)
            self._fill += take
            pos += take
            if self._fill == size:
                self._flush()
        return crc

    def _flush(self) -> None:
        buf, fill, self._buf = self._buf, self._fill, None
        self._w._submit(self._session, buf, fill, self._offset)
        self._offset += fill

    def close(self) -> None:
        if self._buf is not None:
            if self._fill:
                self._flush()
            else:
                self.discard()

    def discard(self) -> None:
        if self._buf is not None:
            buf, self._buf = self._buf, None
            self._w.cache.release(buf)


def write_snapshot_file(
    path: str,
    items: Iterable[ItemLike],
    *,
    file_attrs: Optional[Mapping[str, Any]] = None,
    host_cache: Optional[HostCache] = None,
    flusher: Optional[Flusher] = None,
    config: Optional[IOConfig] = None,
    checksum: Optional[str] = None,
) -> FileLayout:
    """One-shot :meth:`SnapshotFileWriter.write`; returns the written :class:`FileLayout`.
    For repeated snapshots keep a :class:`SnapshotFileWriter` (its host cache is reused)."""
    with SnapshotFileWriter(host_cache=host_cache, flusher=flusher, config=config, checksum=checksum) as w:
        return w.write(path, items, file_attrs=file_attrs).layout


def read_snapshot_file(
    path: str, *, verify: bool = True, config: Optional[IOConfig] = None, backend: Optional[IOBackend] = None
) -> Dict[str, Tuple[memoryview, ItemMeta]]:
    """Every item of the snapshot file at ``path`` as ``key -> (payload view, footer entry)``.

    Payload views are read-write ``memoryview`` s (format ``'B'``) of exactly ``nbytes`` bytes.
    Raises the format errors of ``read_footer``, :class:`ChecksumMismatchError` (with
    ``verify``) and :class:`StorageReadError`.
    """
    with FileReader(path, config=config, backend=backend) as r:
        views = r.read_items(verify=verify)
        return {k: (v, r.meta(k)) for k, v in views.items()}
