"""The snapshot file format: one self-describing file per rank.

Layout (all integers little-endian, offsets and lengths in bytes)::

    [0, 64)                 header: magic, format version, header size, alignment, file size,
                            CRC-32 of the preceding header bytes; zero padded (to the first
                            tensor, and a reader checks that padding is zero)
    [align_up(64), ...)     tensor payloads, each starting at a multiple of ``alignment``
                            (4096, the O_DIRECT block), zero padded between them
    [objects_offset, ...)   serialized object payloads, packed back to back
    [footer_offset, ...)    footer: UTF-8/ASCII JSON metadata of every item
    last 24 bytes           trailer: footer length, footer CRC-32, format version, magic

Why this shape:

* Tensors at precomputed aligned offsets let the flusher write each one straight from an aligned
  host buffer with O_DIRECT, and let a reader fetch exactly one tensor (or part of one) with
  aligned reads, without touching the rest of the file.
* Objects are small and of unknown use to the reader, so they are packed, not aligned.
* The footer is last so it can be written after every payload is on storage ("commit last"), and
  it is found from the end of the file without an index at the front.
* The header records the final file size, so truncation is told apart from corruption.
* Metadata is JSON and only JSON: loading a file never executes code from it (no pickle).
  Object payloads are opaque bytes here; deserializing them is the caller's business.

Checksums are written as ``"<algo>:%08x"``: ``crc32`` (``zlib.crc32``) in versions 1 and 2,
``crc32c`` (CRC-32C, :mod:`io_engine.checksum`, in hardware) in version 3, the only difference
between versions 2 and 3; every checksum of a file must name its version's algorithm. The header's
and the trailer's CRCs (of a few dozen bytes and of the footer) are ``zlib.crc32`` in every
version. The fixed width of each spelling lets the planner know the footer's exact length before
any payload is checksummed, so the whole layout, file size included, is a pure function of the
item descriptions (and the version).

Since format version 2 a tensor item is checksummed per *block*: ``blocks`` lists the checksum of
each ``block_bytes`` (1 MiB) piece of its stored extent ``[offset, offset + align_up(nbytes))``,
the zero padding to the next tensor included, so every byte of the tensor region is covered and a
reader that needs only part of a tensor (a resharded load) verifies exactly the blocks it reads.
The item's ``checksum`` is then the checksum of its block list (each value as 4 little-endian
bytes). Objects are small and read whole: their ``checksum`` is that of the payload, as in
version 1. Version 1 files (no blocks) are still read; a part of one of their tensors is verified
by reading and checking the whole item. A writer uses version 3 where the hardware CRC-32C is
available and version 2 otherwise (:func:`io_engine.checksum.default_algo`).

The planner (:func:`plan_layout`) does no I/O. :func:`io_engine.validate.read_footer` reads and validates the
metadata with plain ``pread`` (a few KiB, not worth io_uring); payload I/O lives in
``flusher.py`` / ``reader.py``.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from .checksum import ALGOS, CRC32, CRC32C, crc_update
from .errors import (
    InvalidItemError,
)

MAGIC = b"DSDYNSNP"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
DEFAULT_ALIGNMENT = 4096
BLOCK_BYTES = 1 << 20  # checksum block of a tensor item (format versions 2, 3), a multiple of any alignment used
HEADER_SIZE = 64
KIND_TENSOR = "tensor"
KIND_OBJECT = "object"
KINDS = (KIND_TENSOR, KIND_OBJECT)

_HEADER = struct.Struct("<8sHHIQ")  # magic, version, header size, alignment, file size
_HEADER_CRC = struct.Struct("<I")
_TRAILER = struct.Struct("<QII8s")  # footer length, footer crc32, version, magic
TRAILER_SIZE = _TRAILER.size  # 24
_MAX_FOOTER = 1 << 31

CHECKSUM_ALGO = {1: CRC32, 2: CRC32, 3: CRC32C}  # version -> algorithm of its payload checksums

# Element sizes of dtype names we can check shapes against; other names are accepted unchecked
# (the caller may use names numpy does not know, e.g. "bfloat16" from torch).
_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def align_up(n: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` that is >= ``n`` (bytes)."""
    return -(-n // alignment) * alignment


def align_down(n: int, alignment: int) -> int:
    """Largest multiple of ``alignment`` that is <= ``n`` (bytes)."""
    return n - n % alignment


def version_of(algo: str) -> int:
    """The format version a writer using checksum ``algo`` writes (``ValueError`` if unknown)."""
    if algo == CRC32C:
        return 3
    if algo == CRC32:
        return 2
    raise ValueError(f"unknown checksum algorithm {algo!r}, known: {', '.join(ALGOS)}")


def format_checksum(crc: int, algo: str = CRC32C) -> str:
    """The footer's fixed-width spelling of a checksum value: ``"<algo>:%08x"``."""
    return f"{algo}:{crc & 0xFFFFFFFF:08x}"


def placeholder(algo: str) -> str:
    """A checksum of ``algo`` of the final width (what the planner sizes the footer with)."""
    return format_checksum(0, algo)


def blocks_checksum(block_crcs: Iterable[int], algo: str = CRC32C) -> int:
    """Checksum ``algo`` of a block list (each value as 4 little-endian bytes): a tensor item's
    ``checksum`` in versions 2 and 3."""
    crcs = list(block_crcs)
    return crc_update(algo, struct.pack(f"<{len(crcs)}I", *crcs))


def checksum_algo(text: str) -> str:
    """The algorithm a checksum spelling names; ``ValueError`` when it is no known spelling."""
    algo = text.partition(":")[0] if isinstance(text, str) else None
    if algo not in ALGOS or len(text) != len(placeholder(algo)):
        raise ValueError(f"bad checksum {text!r}")
    return algo


def parse_checksum(text: str) -> int:
    """The value of ``"crc32:%08x"`` or ``"crc32c:%08x"``; ``ValueError`` for any other text."""
    algo = checksum_algo(text)
    try:
        return int(text[len(algo) + 1 :], 16)
    except ValueError:
        raise ValueError(f"bad checksum {text!r}") from None


def block_count(extent: int, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` covering ``extent`` bytes (the last one may be short)."""
    return -(-extent // block_bytes) if block_bytes else 0


def _freeze_attrs(attrs: Optional[Mapping[str, Any]], key: str) -> Mapping[str, Any]:
    attrs = dict(attrs or {})
    try:
        json.dumps(attrs, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidItemError(f"item {key!r}: attrs must be JSON-serializable: {e}") from None
    return MappingProxyType(attrs)


@dataclass(frozen=True)
class ItemSpec:
    """What the caller wants stored: one named payload of ``nbytes`` bytes.

    ``kind`` is ``"tensor"`` (placed aligned) or ``"object"`` (opaque serialized bytes, packed).
    ``dtype`` is a name (``"float16"``; ``"bytes"`` for objects) and ``shape`` a tuple of ints or
    None; when both are known their product must equal ``nbytes``. ``attrs`` is a free-form,
    JSON-serializable dict stored verbatim (e.g. VPS key and region).

    Raises :class:`InvalidItemError` on any inconsistency.
    """

    key: str
    nbytes: int
    kind: str = KIND_TENSOR
    dtype: str = "uint8"
    shape: Optional[Tuple[int, ...]] = None
    attrs: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if not isinstance(self.key, str) or not self.key:
            raise InvalidItemError(f"item key must be a non-empty str, got {self.key!r}")
        if self.kind not in KINDS:
            raise InvalidItemError(f"item {self.key!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise InvalidItemError(f"item {self.key!r}: nbytes must be an int >= 0, got {self.nbytes!r}")
        if self.shape is not None:
            shape = tuple(int(d) for d in self.shape)
            if any(d < 0 for d in shape):
                raise InvalidItemError(f"item {self.key!r}: negative dimension in shape {shape}")
            object.__setattr__(self, "shape", shape)
            size = _ITEMSIZE.get(self.dtype)
            if size is not None and math.prod(shape) * size != self.nbytes:
                raise InvalidItemError(
                    f"item {self.key!r}: shape {shape} of {self.dtype} is "
                    f"{math.prod(shape) * size} bytes, not {self.nbytes}"
                )
        object.__setattr__(self, "attrs", _freeze_attrs(self.attrs, self.key))


@dataclass(frozen=True)
class ItemMeta:
    """One item as placed in (or read from) a file: its footer entry.

    ``offset`` and ``nbytes`` are bytes from the start of the file. ``checksum`` is
    ``"<algo>:%08x"`` of the payload (a version-2 or 3 tensor: of its block list), or None in a
    plan that has not been written yet. ``blocks`` (tensors of versions 2 and 3 only) holds the
    checksum of each :data:`BLOCK_BYTES` block of the stored extent (payload and zero padding to
    the alignment).
    """

    key: str
    kind: str
    dtype: str
    shape: Optional[Tuple[int, ...]]
    offset: int
    nbytes: int
    checksum: Optional[str]
    attrs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    blocks: Optional[Tuple[str, ...]] = None

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready dict (the footer entry)."""
        d = {
            "key": self.key,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
            "attrs": dict(self.attrs),
        }
        if self.blocks is not None:
            d["blocks"] = list(self.blocks)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ItemMeta":
        """Inverse of :meth:`to_dict`; raises ``ValueError``/``TypeError``/``KeyError`` on bad input."""
        shape = d["shape"]
        if shape is not None:
            if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
                raise ValueError(f"bad shape {shape!r}")
            shape = tuple(shape)
        meta = cls(
            key=d["key"],
            kind=d["kind"],
            dtype=d["dtype"],
            shape=shape,
            offset=d["offset"],
            nbytes=d["nbytes"],
            checksum=d["checksum"],
            attrs=MappingProxyType(dict(d["attrs"])),
            blocks=None if d.get("blocks") is None else tuple(d["blocks"]),
        )
        if not isinstance(meta.key, str) or meta.kind not in KINDS or not isinstance(meta.dtype, str):
            raise ValueError(f"bad key/kind/dtype in {dict(d)!r}")
        for name in ("offset", "nbytes"):
            v = getattr(meta, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"bad {name} {v!r}")
        parse_checksum(meta.checksum)
        for b in meta.blocks or ():
            parse_checksum(b)
        if meta.shape is not None and meta.dtype in _ITEMSIZE:
            if math.prod(meta.shape) * _ITEMSIZE[meta.dtype] != meta.nbytes:
                raise ValueError(f"item {meta.key!r}: shape {list(meta.shape)} of {meta.dtype} is not {meta.nbytes} B")
        return meta


@dataclass(frozen=True)
class FileLayout:
    """Where everything sits in one snapshot file (a plan before writing, the footer after).

    All offsets and sizes in bytes. Tensors occupy ``[data_offset, objects_offset)``, objects
    ``[objects_offset, footer_offset)``, the footer ``[footer_offset, footer_offset +
    footer_length)``, the trailer the last :data:`TRAILER_SIZE` bytes; ``file_size`` is the total.
    """

    items: Tuple[ItemMeta, ...]
    alignment: int
    data_offset: int
    objects_offset: int
    footer_offset: int
    footer_length: int
    file_size: int
    file_attrs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    version: int = FORMAT_VERSION
    block_bytes: int = BLOCK_BYTES  # 0 in version-1 files (whole-item checksums only)

    @property
    def algo(self) -> str:
        """The payload checksum algorithm of this layout's version (``"crc32"``, ``"crc32c"``)."""
        return CHECKSUM_ALGO[self.version]

    def extent(self, item: ItemMeta) -> int:
        """Bytes ``item`` occupies from its offset: a tensor's payload and its zero padding to the
        alignment, an object's payload."""
        return align_up(item.nbytes, self.alignment) if item.kind == KIND_TENSOR else item.nbytes

    def item(self, key: str) -> ItemMeta:
        """The entry of ``key``; ``KeyError`` when absent."""
        for it in self.items:
            if it.key == key:
                return it
        raise KeyError(key)

    @property
    def keys(self) -> Tuple[str, ...]:
        return tuple(it.key for it in self.items)

    def with_checksums(
        self, checksums: Mapping[str, str], blocks: Optional[Mapping[str, Sequence[str]]] = None
    ) -> "FileLayout":
        """A copy whose items carry the given checksums (``key -> "crc32c:..."``) and, for the
        keys in ``blocks``, block checksums (``key -> ["crc32c:...", ...]``)."""
        blocks = blocks or {}
        return replace(
            self,
            items=tuple(
                replace(
                    it,
                    checksum=checksums[it.key],
                    blocks=tuple(blocks[it.key]) if it.key in blocks else it.blocks,
                )
                for it in self.items
            ),
        )


def encode_footer(layout: FileLayout) -> bytes:
    """The footer bytes of ``layout``: deterministic, ASCII-only JSON."""
    doc = {
        "format": "ds_dynatrain.snapshot",
        "version": layout.version,
        "alignment": layout.alignment,
        "block_bytes": layout.block_bytes,
        "data_offset": layout.data_offset,
        "objects_offset": layout.objects_offset,
        "file_attrs": dict(layout.file_attrs),
        "items": [it.to_dict() for it in layout.items],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def encode_header(file_size: int, alignment: int, version: int = FORMAT_VERSION) -> bytes:
    """The :data:`HEADER_SIZE`-byte header of a file of ``file_size`` bytes in format ``version``."""
    head = _HEADER.pack(MAGIC, version, HEADER_SIZE, alignment, file_size)
    head += _HEADER_CRC.pack(zlib.crc32(head))
    return head + bytes(HEADER_SIZE - len(head))


def encode_trailer(footer: bytes, version: int = FORMAT_VERSION) -> bytes:
    """The :data:`TRAILER_SIZE`-byte trailer that follows ``footer`` in format ``version``."""
    return _TRAILER.pack(len(footer), zlib.crc32(footer), version, MAGIC)


def plan_layout(
    specs: Iterable[ItemSpec],
    *,
    alignment: int = DEFAULT_ALIGNMENT,
    file_attrs: Optional[Mapping[str, Any]] = None,
    version: int = FORMAT_VERSION,
) -> FileLayout:
    """Place ``specs`` in a file of format ``version`` (2 or 3: they differ in the checksum
    algorithm alone). Pure: no I/O, deterministic in the order of ``specs``.

    Tensors go first, in the given order, each at a multiple of ``alignment`` (a zero-byte tensor
    gets the current aligned offset and no bytes); objects follow, packed in the given order.
    The footer length is exact (fixed-width checksum placeholders), so ``file_size`` is final.

    Raises :class:`InvalidItemError` for duplicate keys, a bad alignment or non-JSON attrs, and
    ``ValueError`` for a version other than 2 or 3.
    """
    if version not in (2, 3):
        raise ValueError(f"a writer writes format versions 2 and 3, not {version!r}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise InvalidItemError(f"alignment must be a power of two, got {alignment}")
    specs = list(specs)
    seen = set()
    for s in specs:
        if not isinstance(s, ItemSpec):
            raise InvalidItemError(f"expected ItemSpec, got {type(s).__name__}")
        if s.key in seen:
            raise InvalidItemError(f"duplicate item key {s.key!r}")
        seen.add(s.key)
    data_offset = align_up(HEADER_SIZE, alignment)
    cursor = data_offset
    placed = {}
    for s in specs:
        if s.kind == KIND_TENSOR:
            placed[s.key] = cursor
            cursor = align_up(cursor + s.nbytes, alignment)
    objects_offset = cursor
    for s in specs:
        if s.kind == KIND_OBJECT:
            placed[s.key] = cursor
            cursor += s.nbytes
    items = tuple(
        ItemMeta(
            key=s.key,
            kind=s.kind,
            dtype=s.dtype,
            shape=s.shape,
            offset=placed[s.key],
            nbytes=s.nbytes,
            checksum=None,
            attrs=s.attrs,
        )
        for s in specs
    )
    attrs = _freeze_attrs(file_attrs, "<file_attrs>")
    layout = FileLayout(
        items=items,
        alignment=alignment,
        data_offset=data_offset,
        objects_offset=objects_offset,
        footer_offset=cursor,
        footer_length=0,
        file_size=0,
        file_attrs=attrs,
        version=version,
    )
    zero = placeholder(layout.algo)
    placeholders = {
        it.key: [zero] * block_count(layout.extent(it), BLOCK_BYTES) for it in items if it.kind == KIND_TENSOR
    }
    footer_len = len(encode_footer(layout.with_checksums({k: zero for k in seen}, placeholders)))
    return replace(layout, footer_length=footer_len, file_size=cursor + footer_len + TRAILER_SIZE)


def specs_of(layout: FileLayout) -> Sequence[ItemSpec]:
    """The item descriptions that planned ``layout`` (re-planning them reproduces its offsets)."""
    return [
        ItemSpec(key=it.key, nbytes=it.nbytes, kind=it.kind, dtype=it.dtype, shape=it.shape, attrs=it.attrs)
        for it in layout.items
    ]
