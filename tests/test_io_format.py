"""The snapshot file format: the pure planner, and every way a file can be wrong.

Each corruption is made on a real file written by the real writer, then read back; the error
must be the specific one and name the file (and the item key for a payload checksum).
"""

import json
import os
import pickle
import struct
import zlib

import numpy as np
import pytest

from io_engine import (
    BadMagicError,
    ChecksumMismatchError,
    CorruptFooterError,
    FileReader,
    FileSizeMismatchError,
    InvalidItemError,
    ItemSpec,
    SnapshotFormatError,
    TruncatedFileError,
    UnsupportedVersionError,
    plan_layout,
    read_footer,
    read_snapshot_file,
    write_snapshot_file,
)
from io_engine import format as fmt

A = fmt.DEFAULT_ALIGNMENT


# --- planner (pure) ----------------------------------------------------------------------------


def test_plan_places_tensors_aligned_then_objects_packed():
    specs = [
        ItemSpec("t0", 1),
        ItemSpec("o0", 5, kind="object"),
        ItemSpec("t1", 4097),
        ItemSpec("t2", 0),
        ItemSpec("o1", 3, kind="object"),
        ItemSpec("t3", 4096),
    ]
    lay = plan_layout(specs)
    off = {it.key: it.offset for it in lay.items}
    # hand-derived: header block, then t0 (1 B -> 1 block), t1 (2 blocks), t2 (0 B), t3 (1 block)
    assert off == {"t0": A, "t1": 2 * A, "t2": 4 * A, "t3": 4 * A, "o0": 5 * A, "o1": 5 * A + 5}
    assert lay.data_offset == A and lay.objects_offset == 5 * A
    assert lay.footer_offset == 5 * A + 8
    assert lay.file_size == lay.footer_offset + lay.footer_length + fmt.TRAILER_SIZE
    assert [it.key for it in lay.items] == [s.key for s in specs]  # order kept
    assert plan_layout(specs) == lay  # deterministic


def test_plan_footer_length_is_exact_once_checksums_are_known():
    specs = [ItemSpec(f"k{i}", i * 1000 + 1, attrs={"vps": f"layer.{i}.weight", "region": [[0, i]]}) for i in range(7)]
    lay = plan_layout(specs, file_attrs={"step": 12})
    blocks = {
        it.key: [
            fmt.format_checksum(zlib.crc32(f"{it.key}/{b}".encode()))
            for b in range(fmt.block_count(lay.extent(it), fmt.BLOCK_BYTES))
        ]
        for it in lay.items
    }
    real = lay.with_checksums({s.key: fmt.format_checksum(zlib.crc32(s.key.encode())) for s in specs}, blocks)
    assert len(fmt.encode_footer(real)) == lay.footer_length


@pytest.mark.parametrize(
    "specs,match",
    [
        ([ItemSpec("a", 1), ItemSpec("a", 2)], "duplicate item key 'a'"),
    ],
)
def test_plan_refuses_duplicates(specs, match):
    with pytest.raises(InvalidItemError, match=match):
        plan_layout(specs)


def test_item_spec_refusals():
    with pytest.raises(InvalidItemError, match="shape"):
        ItemSpec("w", 10, dtype="float16", shape=(3,))
    with pytest.raises(InvalidItemError, match="JSON"):
        ItemSpec("w", 1, attrs={"bad": object()})
    with pytest.raises(InvalidItemError, match="kind"):
        ItemSpec("w", 1, kind="pickle")
    with pytest.raises(InvalidItemError, match="nbytes"):
        ItemSpec("w", -1)
    ItemSpec("w", 6, dtype="bfloat16", shape=(3,))  # names numpy lacks are fine


# --- a written file, then broken in every way ---------------------------------------------------


@pytest.fixture
def snap(tmp_path):
    path = str(tmp_path / "rank0.dsnap")
    items = [
        ("w", np.arange(3001, dtype=np.float16), "tensor", {"vps": "w/param", "region": [[0, 3001]]}),
        ("b", np.ones(7, dtype=np.float32)),
        ("opt", b"serialized optimizer meta", "object", {"vps": "opt"}),
    ]
    layout = write_snapshot_file(path, items, file_attrs={"step": 5})
    return path, layout


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_footer_roundtrip(snap):
    path, layout = snap
    got = read_footer(path)
    assert got == layout
    assert got.item("w").dtype == "float16" and got.item("w").shape == (3001,)
    assert dict(got.item("w").attrs) == {"vps": "w/param", "region": [[0, 3001]]}
    assert dict(got.file_attrs) == {"step": 5}
    assert got.item("opt").kind == "object"


def test_wrong_header_magic(snap):
    path, _ = snap
    _patch(path, 0, b"NOTASNAP")
    with pytest.raises(BadMagicError, match=f"{path}.*header magic"):
        read_footer(path)


def test_wrong_trailer_magic(snap):
    path, layout = snap
    _patch(path, layout.file_size - 8, b"XXXXXXXX")
    with pytest.raises(BadMagicError, match=f"{path}.*trailer magic"):
        read_footer(path)


def test_corrupt_footer_byte(snap):
    path, layout = snap
    _flip(path, layout.footer_offset + layout.footer_length // 2)
    with pytest.raises(CorruptFooterError, match=f"{path}.*footer checksum"):
        read_footer(path)


def test_corrupt_footer_length_in_trailer(snap):
    path, layout = snap
    _patch(path, layout.file_size - fmt.TRAILER_SIZE, struct.pack("<Q", layout.file_size * 3))
    with pytest.raises(CorruptFooterError, match=path):
        read_footer(path)


def test_footer_with_valid_checksum_but_overlapping_items_is_refused(snap):
    path, layout = snap
    w = layout.item("w")
    bad = layout.with_checksums({k.key: k.checksum for k in layout.items})
    items = tuple(fmt.ItemMeta(**{**it.__dict__, "offset": w.offset}) if it.key == "b" else it for it in bad.items)
    footer = fmt.encode_footer(fmt.FileLayout(**{**bad.__dict__, "items": items}))
    footer = footer.ljust(layout.footer_length, b" ")  # JSON allows trailing blanks
    assert len(footer) == layout.footer_length
    _patch(path, layout.footer_offset, footer + fmt.encode_trailer(footer))
    with pytest.raises(CorruptFooterError, match="overlap"):
        read_footer(path)


def test_footer_that_is_not_our_json(snap):
    path, layout = snap
    junk = json.dumps({"format": "other"}).encode().ljust(layout.footer_length, b" ")
    _patch(path, layout.footer_offset, junk + fmt.encode_trailer(junk))
    with pytest.raises(CorruptFooterError, match="does not parse"):
        read_footer(path)


@pytest.mark.parametrize("keep", [0, 10, fmt.HEADER_SIZE, "minus100"])
def test_truncated_file(snap, keep):
    path, layout = snap
    n = layout.file_size - 100 if keep == "minus100" else keep
    os.truncate(path, n)
    with pytest.raises(TruncatedFileError, match=path):
        read_footer(path)


def test_longer_file_is_a_size_mismatch_not_truncation(snap):
    path, _ = snap
    with open(path, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(FileSizeMismatchError, match=path) as ei:
        read_footer(path)
    assert not isinstance(ei.value, TruncatedFileError)


def test_unsupported_version(snap):
    path, layout = snap
    head = bytearray(fmt.encode_header(layout.file_size, A))
    struct.pack_into("<H", head, 8, 99)
    struct.pack_into("<I", head, 24, zlib.crc32(bytes(head[:24])))
    _patch(path, 0, bytes(head))
    with pytest.raises(UnsupportedVersionError, match="version 99"):
        read_footer(path)


def test_flipped_payload_byte_names_file_and_key(snap):
    path, layout = snap
    _flip(path, layout.item("w").offset + 1234)
    read_footer(path)  # the metadata is still fine
    with pytest.raises(ChecksumMismatchError, match=f"{path}.*'w'") as ei:
        read_snapshot_file(path)
    assert ei.value.key == "w" and isinstance(ei.value, SnapshotFormatError)
    with FileReader(path) as r:  # other items still read and verify
        assert bytes(r.read_item("b")) == np.ones(7, np.float32).tobytes()


def test_flipped_object_byte_is_detected(snap):
    path, layout = snap
    _flip(path, layout.item("opt").offset)
    with pytest.raises(ChecksumMismatchError, match="'opt'"):
        read_snapshot_file(path)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo should-never-run",))


def test_loading_never_unpickles(tmp_path):
    path = str(tmp_path / "f")
    payload = pickle.dumps(_Boom())
    write_snapshot_file(path, [("evil", payload, "object")])
    view, meta = read_snapshot_file(path)["evil"]
    assert bytes(view) == payload and meta.kind == "object" and meta.dtype == "bytes"
