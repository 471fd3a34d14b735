"""Reading a snapshot file's header, trailer and footer back, and refusing every way they can be
wrong (see ``format.py`` for the layout), before any payload is read."""

from __future__ import annotations

import json
import os
import zlib
from types import MappingProxyType

from .errors import (
    BadMagicError,
    CorruptFooterError,
    CorruptHeaderError,
    FileSizeMismatchError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from .format import (
    _HEADER,
    _HEADER_CRC,
    _MAX_FOOTER,
    _TRAILER,
    BLOCK_BYTES,
    HEADER_SIZE,
    KIND_OBJECT,
    KIND_TENSOR,
    MAGIC,
    READABLE_VERSIONS,
    TRAILER_SIZE,
    FileLayout,
    ItemMeta,
    align_up,
    block_count,
    blocks_checksum,
    checksum_algo,
    parse_checksum,
)


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return out


def _parse_footer(
    path: str, raw: bytes, header_alignment: int, header_version: int, size: int, footer_offset: int, footer_len: int
) -> FileLayout:
    try:
        doc = json.loads(raw.decode("ascii"))
        if not isinstance(doc, dict) or doc.get("format") != "ds_dynatrain.snapshot":
            raise ValueError("not a ds_dynatrain.snapshot footer")
        items = tuple(ItemMeta.from_dict(d) for d in doc["items"])
        layout = FileLayout(
            items=items,
            alignment=doc["alignment"],
            data_offset=doc["data_offset"],
            objects_offset=doc["objects_offset"],
            footer_offset=footer_offset,
            footer_length=footer_len,
            file_size=size,
            file_attrs=MappingProxyType(dict(doc["file_attrs"])),
            version=doc["version"],
            block_bytes=doc.get("block_bytes", 0),
        )
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError) as e:
        raise CorruptFooterError(path, f"footer metadata does not parse: {e}") from None
    if layout.alignment != header_alignment or layout.version != header_version:
        raise CorruptFooterError(path, "footer alignment/version disagree with the header")
    if layout.data_offset != align_up(HEADER_SIZE, layout.alignment):
        raise CorruptFooterError(path, f"footer data offset {layout.data_offset} is not the end of the header block")
    if not (layout.data_offset <= layout.objects_offset <= footer_offset):
        raise CorruptFooterError(path, "footer region offsets are out of order")
    _check_blocks(path, layout)
    _check_tiling(path, layout)
    return layout


def _check_blocks(path: str, layout: FileLayout) -> None:
    """Versions 2 and 3: a block size that tiles the alignment, a block list of the right length
    on every tensor and on no object. Version 1: no blocks anywhere. Every version: each checksum
    names the version's algorithm."""
    for it in layout.items:
        for c in (it.checksum, *(it.blocks or ())):
            if checksum_algo(c) != layout.algo:
                raise CorruptFooterError(
                    path, f"item {it.key!r}: checksum {c!r} in a version-{layout.version} file ({layout.algo})"
                )
    if layout.version == 1:
        if layout.block_bytes or any(it.blocks is not None for it in layout.items):
            raise CorruptFooterError(path, "a version-1 footer with block checksums")
        return
    b = layout.block_bytes
    if b != BLOCK_BYTES or isinstance(b, bool):
        raise CorruptFooterError(path, f"block size {b!r}, version {layout.version} blocks are {BLOCK_BYTES} bytes")
    for it in layout.items:
        want = block_count(layout.extent(it), b) if it.kind == KIND_TENSOR else None
        got = None if it.blocks is None else len(it.blocks)
        if got != want:
            raise CorruptFooterError(path, f"item {it.key!r} lists {got} block checksums, its extent needs {want}")
        if it.blocks is not None and parse_checksum(it.checksum) != blocks_checksum(
            map(parse_checksum, it.blocks), layout.algo
        ):
            raise CorruptFooterError(path, f"item {it.key!r}: its checksum is not that of its block list")


def _check_tiling(path: str, layout: FileLayout) -> None:
    """Every item inside its region, tensors aligned, no two items overlapping, keys unique."""
    keys = set()
    spans = []
    for it in layout.items:
        if it.key in keys:
            raise CorruptFooterError(path, f"duplicate item key {it.key!r} in footer")
        keys.add(it.key)
        lo, hi = (
            (layout.data_offset, layout.objects_offset)
            if it.kind == KIND_TENSOR
            else (layout.objects_offset, layout.footer_offset)
        )
        if it.offset < lo or it.offset + layout.extent(it) > hi:
            raise CorruptFooterError(
                path, f"item {it.key!r} [{it.offset}, {it.offset + it.nbytes}) lies outside its region [{lo}, {hi})"
            )
        if it.kind == KIND_TENSOR and it.offset % layout.alignment:
            raise CorruptFooterError(path, f"tensor item {it.key!r} offset {it.offset} is not aligned")
        if it.nbytes:
            spans.append((it.offset, it.offset + it.nbytes, it.key))
    spans.sort()
    for (_a0, a1, ak), (b0, _b1, bk) in zip(spans, spans[1:]):
        if b0 < a1:
            raise CorruptFooterError(path, f"items {ak!r} and {bk!r} overlap")
    if layout.version >= 2:
        _check_covered(path, layout)


def _check_covered(path: str, layout: FileLayout) -> None:
    """Versions 2 and 3: the tensors' stored extents tile ``[data_offset, objects_offset)`` and the
    objects tile ``[objects_offset, footer_offset)`` with no gap, so every byte of the file is under
    a checksum (the header's, an item's or the footer's)."""
    for kind, lo, hi in (
        (KIND_TENSOR, layout.data_offset, layout.objects_offset),
        (KIND_OBJECT, layout.objects_offset, layout.footer_offset),
    ):
        cursor = lo
        for it in sorted((i for i in layout.items if i.kind == kind), key=lambda i: (i.offset, layout.extent(i))):
            if it.offset != cursor:
                raise CorruptFooterError(path, f"bytes [{cursor}, {it.offset}) before item {it.key!r} are in no item")
            cursor += layout.extent(it)
        if cursor != hi:
            raise CorruptFooterError(path, f"bytes [{cursor}, {hi}) of the {kind} region belong to no item")


def read_footer(path: str) -> FileLayout:
    """Read and validate the header, trailer and footer of the snapshot file at ``path``.

    Returns the file's :class:`FileLayout` (items with their checksums). Payloads are not read
    or verified here (see ``reader.FileReader``).

    Raises, all naming ``path``: :class:`TruncatedFileError` (shorter than its header says or
    than a header), :class:`FileSizeMismatchError` (longer), :class:`BadMagicError`,
    :class:`UnsupportedVersionError`, :class:`CorruptHeaderError`, :class:`CorruptFooterError`;
    ``OSError`` when the file cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        head = _pread_exact(fd, HEADER_SIZE, 0)
        if len(head) < _HEADER.size + _HEADER_CRC.size:
            if head[: len(MAGIC)] != MAGIC[: len(head)]:
                raise BadMagicError(path, f"header magic is {head[:8]!r}, expected {MAGIC!r}")
            raise TruncatedFileError(path, f"file is {size} bytes, shorter than the header")
        magic, version, header_size, alignment, file_size = _HEADER.unpack_from(head)
        if magic != MAGIC:
            raise BadMagicError(path, f"header magic is {magic!r}, expected {MAGIC!r}")
        (crc,) = _HEADER_CRC.unpack_from(head, _HEADER.size)
        if crc != zlib.crc32(head[: _HEADER.size]):
            raise CorruptHeaderError(path, "header checksum mismatch")
        if version not in READABLE_VERSIONS:
            raise UnsupportedVersionError(
                path, f"format version {version}, this code reads versions {', '.join(map(str, READABLE_VERSIONS))}"
            )
        if header_size != HEADER_SIZE or alignment <= 0 or alignment & (alignment - 1) or alignment > BLOCK_BYTES:
            raise CorruptHeaderError(path, f"impossible header (size {header_size}, alignment {alignment})")
        pad_end = min(align_up(HEADER_SIZE, alignment), size)
        pad = _pread_exact(fd, pad_end - len(head), len(head)) if pad_end > len(head) else b""
        if any(head[_HEADER.size + _HEADER_CRC.size :]) or any(pad):
            raise CorruptHeaderError(path, "the header's zero padding holds other bytes")
        if size < file_size:
            raise TruncatedFileError(path, f"file is {size} bytes, its header records {file_size}")
        if size > file_size:
            raise FileSizeMismatchError(path, f"file is {size} bytes, its header records {file_size}")
        if size < HEADER_SIZE + TRAILER_SIZE:
            raise CorruptHeaderError(path, f"recorded file size {file_size} cannot hold a trailer")
        footer_len, footer_crc, t_version, t_magic = _TRAILER.unpack(
            _pread_exact(fd, TRAILER_SIZE, size - TRAILER_SIZE)
        )
        if t_magic != MAGIC:
            raise BadMagicError(path, f"trailer magic is {t_magic!r}, expected {MAGIC!r}")
        footer_offset = size - TRAILER_SIZE - footer_len
        if t_version != version or footer_len > _MAX_FOOTER or footer_offset < HEADER_SIZE:
            raise CorruptFooterError(path, f"trailer is corrupt (footer length {footer_len}, version {t_version})")
        raw = _pread_exact(fd, footer_len, footer_offset)
        if zlib.crc32(raw) != footer_crc:
            raise CorruptFooterError(path, "footer checksum mismatch")
    finally:
        os.close(fd)
    return _parse_footer(path, raw, alignment, version, size, footer_offset, footer_len)
