"""Every byte of a snapshot file is under a checksum, and a reader that needs only part of a tensor
verifies exactly the blocks it reads (format versions 2 and 3), on real files written by the real
writer, with either checksum (CRC-32C, version 3, and CRC-32, version 2).

Oracles: the payloads handed to the writer (what a read must return), the file's bytes as written
(a flip anywhere must be refused by some check, never returned as data), and checksums computed
independently of ``io_engine`` (``zlib.crc32``; ``google_crc32c.value``, the package's own binding).
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import google_crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from io_engine import (
    ChecksumMismatchError,
    CorruptFooterError,
    CorruptHeaderError,
    FileReader,
    SnapshotFormatError,
    read_footer,
    write_snapshot_file,
)
from io_engine import format as fmt

MiB = 1 << 20


def payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def flip(path: str, offset: int, mask: int = 0x10) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ mask]), offset)
    finally:
        os.close(fd)


ORACLE = {"crc32": zlib.crc32, "crc32c": google_crc32c.value}  # bytes -> checksum, outside io_engine


@pytest.fixture(params=["crc32c", "crc32"])
def big(tmp_path, request):
    """A file with a 2.5 MiB + 3 byte tensor (three blocks, the last one padded), a small tensor
    and an object, written with each checksum (versions 3 and 2)."""
    data = {"w": payload(5 * MiB // 2 + 3, 1), "b": payload(100, 2), "o": b"object bytes"}
    path = str(tmp_path / "f.snap")
    items = [("w", data["w"]), ("b", data["b"]), ("o", data["o"], "object")]
    write_snapshot_file(path, items, checksum=request.param)
    return path, data


def test_tensor_items_carry_one_checksum_per_block_of_their_padded_extent(big):
    path, data = big
    lay = read_footer(path)
    algo = {3: "crc32c", 2: "crc32"}[lay.version]
    assert lay.algo == algo and lay.block_bytes == MiB
    crc = ORACLE[algo]
    w = lay.item("w")
    extent = fmt.align_up(w.nbytes, lay.alignment)
    assert len(w.blocks) == 3 and all(c.startswith(algo + ":") for c in (*w.blocks, w.checksum))
    raw = open(path, "rb").read()
    want = [crc(raw[w.offset + i * MiB : w.offset + min(extent, (i + 1) * MiB)]) for i in range(3)]
    assert [fmt.parse_checksum(c) for c in w.blocks] == want
    assert fmt.parse_checksum(w.checksum) == crc(struct.pack("<3I", *want))
    assert lay.item("o").blocks is None  # objects keep one checksum of their payload
    assert fmt.parse_checksum(lay.item("o").checksum) == crc(data["o"])


def test_a_writer_uses_the_hardware_crc32c_and_format_version_3(tmp_path):
    path = str(tmp_path / "f.snap")
    w = payload(3 * MiB + 5, 9)
    write_snapshot_file(path, [("w", w)])
    lay = read_footer(path)
    assert fmt.FORMAT_VERSION == 3 and lay.version == 3 and lay.algo == "crc32c"
    raw = open(path, "rb").read()
    it = lay.item("w")
    assert fmt.parse_checksum(it.blocks[0]) == google_crc32c.value(raw[it.offset : it.offset + MiB])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5 * MiB // 2 + 3), st.integers(0, 5 * MiB // 2 + 3)), min_size=1, max_size=6))
def test_range_reads_return_exactly_the_bytes_asked(tmp_path_factory, ranges):
    path = str(tmp_path_factory.mktemp("r") / "f.snap")
    w = payload(5 * MiB // 2 + 3, 3)
    write_snapshot_file(path, [("w", w)])
    reqs = [("w", min(a, b), abs(a - b)) for a, b in ranges]
    with FileReader(path) as r:
        views = r.read_item_ranges(reqs)
    for (_k, start, length), v in zip(reqs, views):
        assert bytes(v) == w[start : start + length].tobytes()


@pytest.mark.parametrize("where", ["first block", "middle block", "last byte of payload", "padding"])
def test_a_flip_is_found_by_the_read_of_its_block_and_only_that_block(big, where):
    path, data = big
    w = read_footer(path).item("w")
    offset = {
        "first block": w.offset + 17,
        "middle block": w.offset + MiB + 4000,
        "last byte of payload": w.offset + w.nbytes - 1,
        "padding": w.offset + w.nbytes + 5,  # zero padding after the payload, inside the last block
    }[where]
    block = (offset - w.offset) // MiB
    flip(path, offset)
    with FileReader(path) as r:
        with pytest.raises(ChecksumMismatchError, match=f"item 'w', bytes \\[{w.offset + block * MiB}, ") as err:
            r.read_item_ranges([("w", block * MiB, 1)])
        assert err.value.key == "w" and err.value.offset == w.offset + block * MiB
        other = (block + 1) % 3
        (v,) = r.read_item_ranges([("w", other * MiB, 10)])  # an untouched block reads fine
        assert bytes(v) == data["w"][other * MiB : other * MiB + 10].tobytes()
        with pytest.raises(ChecksumMismatchError):
            r.read_items(["w"])


@pytest.mark.parametrize("checksum", ["crc32c", "crc32"])
def test_a_flip_anywhere_in_a_file_is_refused(tmp_path, checksum):
    """One bit flipped at byte offsets all over a small file (header and its padding, tensors and
    their padding, objects, footer, trailer): each is refused by the footer checks or by a
    verified read of every item, with a format error naming the file; with either checksum."""
    path = str(tmp_path / "small.snap")
    write_snapshot_file(
        path,
        [("a", payload(5000, 4)), ("e", payload(0, 5)), ("b", payload(300, 6)), ("o", b"xyz" * 40, "object")],
        file_attrs={"step": 3},
        checksum=checksum,
    )
    assert read_footer(path).algo == checksum
    size = os.path.getsize(path)
    lay = read_footer(path)
    # every byte of the header, of each item's first and last 64 bytes (padding included), of the
    # footer and trailer; every 7th byte elsewhere (the same checks, a sixth of the time)
    edges = {o for it in lay.items for a in (it.offset, it.offset + lay.extent(it)) for o in range(a - 64, a + 64)}
    edges |= set(range(0, 2 * fmt.HEADER_SIZE)) | set(range(lay.footer_offset, size))
    for offset in sorted((edges | set(range(0, size, 7))) & set(range(size))):
        flip(path, offset, 1 << (offset % 8))
        try:
            with pytest.raises(SnapshotFormatError, match=str(path)):
                with FileReader(path) as r:
                    r.read_items()
        finally:
            flip(path, offset, 1 << (offset % 8))
    with FileReader(path) as r:
        assert bytes(r.read_items(["o"])["o"]) == b"xyz" * 40  # the file is back as written


def test_a_flip_in_the_header_padding_is_refused(big):
    path, _ = big
    flip(path, fmt.HEADER_SIZE + 100)
    with pytest.raises(CorruptHeaderError, match="padding"):
        read_footer(path)


def _rewrite_footer(path: str, edit) -> None:
    """Re-encode the footer with ``edit(doc)`` applied and a valid CRC (what a foreign writer or a
    bug could produce), keeping the file size consistent."""
    lay = read_footer(path)
    raw = open(path, "rb").read()
    doc = json.loads(raw[lay.footer_offset : lay.footer_offset + lay.footer_length])
    edit(doc)
    footer = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    body = raw[: lay.footer_offset] + footer + fmt.encode_trailer(footer, lay.version)
    head = bytearray(body[: fmt.HEADER_SIZE])
    struct.pack_into("<Q", head, 16, len(body))
    struct.pack_into("<I", head, 24, zlib.crc32(bytes(head[:24])))
    with open(path, "wb") as f:
        f.write(bytes(head) + body[fmt.HEADER_SIZE :])


def _other(doc) -> str:
    """The checksum algorithm a footer of ``doc``'s version must not use."""
    return "crc32" if fmt.CHECKSUM_ALGO[doc["version"]] == "crc32c" else "crc32c"


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda d: d["items"][0]["blocks"].pop(), "block checksums"),
        (lambda d: d["items"][0].update(nbytes=d["items"][0]["nbytes"] - 8192, shape=None), "are in no item"),
        (lambda d: d.__setitem__("block_bytes", 1000), "block size"),
        (lambda d: d.__setitem__("block_bytes", 2 << 20), r"version \d blocks are"),
        (
            lambda d: d["items"][0].__setitem__("checksum", fmt.placeholder(fmt.CHECKSUM_ALGO[d["version"]])),
            "block list",
        ),
        (lambda d: d["items"][1].__setitem__("checksum", fmt.placeholder(_other(d))), r"in a version-\d file"),
        (lambda d: d["items"][0]["blocks"].__setitem__(0, fmt.placeholder(_other(d))), r"in a version-\d file"),
        (lambda d: d["items"][1].__setitem__("checksum", "crc64:00000000"), "bad checksum"),
        (lambda d: d["items"][1].__setitem__("shape", [7]), "is not 100 B"),
    ],
)
def test_a_footer_with_a_valid_crc_but_wrong_values_is_refused(big, edit, why):
    path, _ = big

    def edit_b(doc):
        doc["items"][1]["shape"] = [100]
        doc["items"][1]["dtype"] = "uint8"
        edit(doc)

    _rewrite_footer(path, edit_b)
    with pytest.raises(CorruptFooterError, match=why):
        read_footer(path)


def _write_v1(path: str, tensors, objects) -> None:
    """A file of format version 1 (whole-item CRCs, no blocks), laid out as that version's writer
    did: header, aligned tensors, packed objects, footer, trailer."""
    align = fmt.DEFAULT_ALIGNMENT
    body, items, cursor = bytearray(align), [], align
    for key, data in tensors:
        items.append(dict(key=key, kind="tensor", dtype="uint8", shape=[len(data)], offset=cursor, nbytes=len(data)))
        items[-1].update(checksum=fmt.format_checksum(zlib.crc32(data), "crc32"), attrs={})
        body += data + bytes(fmt.align_up(len(data), align) - len(data))
        cursor = len(body)
    objects_offset = cursor
    for key, data in objects:
        items.append(dict(key=key, kind="object", dtype="bytes", shape=None, offset=len(body), nbytes=len(data)))
        items[-1].update(checksum=fmt.format_checksum(zlib.crc32(data), "crc32"), attrs={})
        body += data
    doc = dict(format="ds_dynatrain.snapshot", version=1, alignment=align, data_offset=align)
    doc.update(objects_offset=objects_offset, file_attrs={}, items=items)
    footer = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    body += footer + struct.pack("<QII8s", len(footer), zlib.crc32(footer), 1, fmt.MAGIC)
    head = struct.pack("<8sHHIQ", fmt.MAGIC, 1, fmt.HEADER_SIZE, align, len(body))
    head += struct.pack("<I", zlib.crc32(head))
    body[: len(head)] = head
    with open(path, "wb") as f:
        f.write(bytes(body))


def test_version_1_files_are_still_read_and_a_part_is_checked_whole(tmp_path):
    path = str(tmp_path / "v1.snap")
    w = payload(3 * MiB, 7).tobytes()
    _write_v1(path, [("w", w)], [("o", b"old object")])
    with FileReader(path) as r:
        assert r.layout.version == 1 and r.layout.item("w").blocks is None
        got = r.read_items()
        assert bytes(got["w"]) == w and bytes(got["o"]) == b"old object"
        (part,) = r.read_item_ranges([("w", 5, 11)])
        assert bytes(part) == w[5:16]
    flip(path, fmt.DEFAULT_ALIGNMENT + 2 * MiB)  # outside the part asked for: the whole item is checked
    with FileReader(path) as r, pytest.raises(ChecksumMismatchError, match="item 'w'"):
        r.read_item_ranges([("w", 5, 11)])
