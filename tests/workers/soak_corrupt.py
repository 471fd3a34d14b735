"""Generated corruptions of a snapshot directory (this project's file format), for the fuzz part of
the soak (``tests/soak/test_soak_corruptions.py``, ``tests/workers/soak_fuzz_worker.py``).

Pure: a corruption is computed from the pristine bytes of the files and a seeded
``random.Random``; it names its kind, sub-kind, target file and where it landed, and gives the
new contents of the files it changes (None: the file is deleted). The format is read here from
first principles (trailer, footer JSON, header), not through ``io_engine``, so a reader's bug is
not shared by the generator.

Metadata corruptions re-encode the footer JSON with one wrong value and a valid footer CRC (and a
header whose recorded file size and CRC match the new file), so only that value is wrong: the
model of a writer that records the wrong thing. Fields no reader uses are not corrupted (the
``path`` attribute of an item, the file attributes, the rank, world size and stage recorded beside
a partition's fragments): changing them changes nothing a tool returns.
"""

from __future__ import annotations

import json
import random
import struct
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

MAGIC = b"DSDYNSNP"
HEADER = struct.Struct("<8sHHIQ")  # magic, version, header size, alignment, file size
HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = 64
TRAILER = struct.Struct("<QII8s")  # footer length, footer CRC-32, version, magic
LATEST = "latest"


@dataclass
class Corruption:
    """One corruption: ``files`` maps a file name of the tag directory (or :data:`LATEST`, the
    directory's ``latest``) to its new bytes, None to delete it."""

    kind: str
    sub: str
    target: str
    detail: str
    files: Dict[str, Optional[bytes]] = field(default_factory=dict)
    region: str = ""


@dataclass
class Parsed:
    """The parts of one snapshot file, as offsets (bytes)."""

    size: int
    alignment: int
    footer_offset: int
    footer_length: int
    doc: dict

    def items(self, kind: Optional[str] = None) -> List[dict]:
        return [it for it in self.doc["items"] if kind is None or it["kind"] == kind]


def parse(data: bytes) -> Parsed:
    """The header fields and the footer of a pristine file (``ValueError`` for anything else)."""
    magic, _version, _hsize, alignment, file_size = HEADER.unpack_from(data)
    footer_len, _crc, _tv, tmagic = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    if magic != MAGIC or tmagic != MAGIC or file_size != len(data):
        raise ValueError("not a pristine snapshot file")
    off = len(data) - TRAILER.size - footer_len
    return Parsed(len(data), alignment, off, footer_len, json.loads(data[off : off + footer_len]))


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def regions(p: Parsed) -> List[Tuple[int, int, str]]:
    """``(start, end, label)`` spans that tile the file: header, header padding, each tensor's
    payload and its padding, objects, footer, trailer."""
    out = [(0, HEADER.size + HEADER_CRC.size, "header"), (HEADER.size + HEADER_CRC.size, HEADER_SIZE, "header padding")]
    data_offset = p.doc["data_offset"]
    if data_offset > HEADER_SIZE:
        out.append((HEADER_SIZE, data_offset, "header padding"))
    for it in sorted(p.items("tensor"), key=lambda it: it["offset"]):
        end, padded = it["offset"] + it["nbytes"], align_up(it["offset"] + it["nbytes"], p.alignment)
        if it["nbytes"]:
            out.append((it["offset"], end, "tensor"))
        if padded > end:
            out.append((end, padded, "tensor padding"))
    for it in p.items("object"):
        if it["nbytes"]:
            out.append((it["offset"], it["offset"] + it["nbytes"], "object"))
    out.append((p.footer_offset, p.footer_offset + p.footer_length, "footer"))
    out.append((p.size - TRAILER.size, p.size, "trailer"))
    return out


def region_of(p: Parsed, offset: int) -> str:
    for lo, hi, label in regions(p):
        if lo <= offset < hi:
            return label
    return "gap"


def encode_footer(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def with_header_size(data: bytes, file_size: int) -> bytes:
    """``data`` whose header records ``file_size`` (the header CRC recomputed)."""
    magic, version, hsize, alignment, _ = HEADER.unpack_from(data)
    head = HEADER.pack(magic, version, hsize, alignment, file_size)
    return head + HEADER_CRC.pack(zlib.crc32(head)) + data[HEADER.size + HEADER_CRC.size :]


def with_footer(data: bytes, p: Parsed, doc: dict) -> bytes:
    """The file with footer ``doc`` (re-encoded), a trailer with its valid CRC, and a header whose
    recorded size matches."""
    footer = encode_footer(doc)
    _len, _crc, version, magic = TRAILER.unpack_from(data, p.size - TRAILER.size)
    body = data[: p.footer_offset] + footer + TRAILER.pack(len(footer), zlib.crc32(footer), version, magic)
    return with_header_size(body, len(body))


def flip(data: bytes, offset: int, bit: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ (1 << bit)]) + data[offset + 1 :]


def _bitflip_in(rng: random.Random, data: bytes, p: Parsed, lo: int, hi: int) -> Tuple[bytes, str, str]:
    off = rng.randrange(lo, hi)
    bit = rng.randrange(8)
    return flip(data, off, bit), f"bit {bit} of byte {off}", region_of(p, off)


# ---- byte-level corruptions of one file: (rng, data, parsed) -> (new data, sub-kind, detail, region)


def _bitflip(rng, data, p):
    new, detail, region = _bitflip_in(rng, data, p, 0, len(data))
    return new, region, detail, region


def _burst(rng, data, p):
    n = rng.randint(2, 64)
    off = rng.randrange(0, len(data) - n)
    return data[:off] + rng.randbytes(n) + data[off + n :], "random bytes", f"{n} bytes at {off}", region_of(p, off)


def _zero_block(rng, data, p):
    blocks = -(-len(data) // 4096)
    i = rng.randrange(blocks)
    lo, hi = i * 4096, min(len(data), (i + 1) * 4096)
    return data[:lo] + bytes(hi - lo) + data[hi:], "4 KiB block zeroed", f"block {i}", region_of(p, lo)


def _payload(rng, data, p):
    items = [it for it in p.items() if it["nbytes"]]
    it = rng.choice(items)
    new, detail, region = _bitflip_in(rng, data, p, it["offset"], it["offset"] + it["nbytes"])
    return new, it["kind"], f"item {it['key']}: {detail}", region


def _padding(rng, data, p):
    spans = [(lo, hi) for lo, hi, label in regions(p) if label.endswith("padding") and hi > lo]
    lo, hi = rng.choice(spans)
    new, detail, region = _bitflip_in(rng, data, p, lo, hi)
    return new, region, detail, region


def _header(rng, data, p):
    new, detail, region = _bitflip_in(rng, data, p, 0, HEADER_SIZE)
    return new, region, detail, region


def _trailer(rng, data, p):
    new, detail, region = _bitflip_in(rng, data, p, len(data) - TRAILER.size, len(data))
    field_of = ["footer length"] * 8 + ["footer crc"] * 4 + ["version"] * 4 + ["magic"] * 8
    return new, field_of[int(detail.split()[-1]) - (len(data) - TRAILER.size)], detail, region


def _footer(rng, data, p):
    new, detail, region = _bitflip_in(rng, data, p, p.footer_offset, p.footer_offset + p.footer_length)
    return new, "bit flip", detail, region


def _truncate(rng, data, p):
    if rng.random() < 0.5:
        n = rng.randrange(0, len(data))
        return data[:n], "anywhere", f"cut to {n} of {len(data)} bytes", region_of(p, n)
    n = len(data) - rng.randint(1, p.footer_length + TRAILER.size + 64)
    return data[:n], "in the tail", f"cut to {n} of {len(data)} bytes", region_of(p, n)


def _extend(rng, data, p):
    n = rng.randint(1, 8192)
    if rng.random() < 0.5:
        return data + bytes(n), "zeros", f"{n} zero bytes appended", "end"
    return data + rng.randbytes(n), "random", f"{n} random bytes appended", "end"


def _wrong_size(rng, data, p):
    delta = rng.choice([-1, 1, -4096, 4096, -len(data) // 2, rng.randint(1, 1 << 40)])
    size = max(0, len(data) + delta)
    return with_header_size(data, size), "header file size", f"records {size}, file is {len(data)}", "header"


# ---- metadata: one wrong value in the footer JSON, re-encoded with a valid CRC


def _tensor(rng, p, nonempty=True):
    items = [it for it in p.items("tensor") if it["nbytes"] or not nonempty]
    return rng.choice(items)


def _m_offset(rng, p, doc):
    it = rng.choice([it for it in doc["items"] if it["nbytes"]])
    step = p.alignment if it["kind"] == "tensor" and rng.random() < 0.5 else rng.randint(1, 64)
    it["offset"] = max(0, it["offset"] + rng.choice([-1, 1]) * step)
    return f"item {it['key']} offset -> {it['offset']}"


def _m_nbytes(rng, p, doc):
    it = rng.choice([it for it in doc["items"] if it["nbytes"]])
    it["nbytes"] = rng.choice(
        [0, max(0, it["nbytes"] - 1), it["nbytes"] + 1, max(0, it["nbytes"] - 4), 2 * it["nbytes"]]
    )
    return f"item {it['key']} nbytes -> {it['nbytes']}"


def _m_dtype(rng, p, doc):
    key = _tensor(rng, p)["key"]
    it = next(x for x in doc["items"] if x["key"] == key)
    choices = ["float16", "bfloat16", "int32", "float64", "uint8", "int64", "float8_e4m3fn", "complex64", "bogus"]
    it["dtype"] = rng.choice([d for d in choices if d != it["dtype"]])
    return f"item {it['key']} dtype -> {it['dtype']}"


def _m_shape(rng, p, doc):
    key = _tensor(rng, p)["key"]
    it = next(x for x in doc["items"] if x["key"] == key)
    shape = list(it["shape"])
    options = [shape + [1], [1] + shape, shape[::-1] if len(shape) > 1 and shape[0] != shape[-1] else shape + [1]]
    if shape:
        options += [shape[:-1] + [shape[-1] + 1], shape[:-1] + [max(0, shape[-1] - 1)]]
    else:
        options.append([2])
    it["shape"] = rng.choice(options)
    return f"item {it['key']} shape {shape} -> {it['shape']}"


def _m_key(rng, p, doc):
    it = rng.choice(doc["items"])
    others = [x["key"] for x in doc["items"] if x["key"] != it["key"]]
    old = it["key"]
    it["key"] = rng.choice([old + "0", old.replace("/", "_"), "t/999", rng.choice(others)])
    return f"item {old} key -> {it['key']}"


def _algo(checksum: str) -> str:
    """The algorithm a footer checksum names (``crc32c`` in version 3, ``crc32`` before)."""
    return checksum.partition(":")[0]


def _m_checksum(rng, p, doc):
    it = rng.choice(doc["items"])
    old = it["checksum"]
    while it["checksum"] == old:
        it["checksum"] = f"{_algo(old)}:{rng.getrandbits(32):08x}"
    return f"item {it['key']} checksum -> {it['checksum']}"


def _m_blocks(rng, p, doc):
    items = [it for it in doc["items"] if it.get("blocks")]
    if not items:
        return _m_checksum(rng, p, doc)
    it = rng.choice(items)
    how = rng.choice(["change", "drop", "add"])
    if how == "change":
        i = rng.randrange(len(it["blocks"]))
        algo, _, value = it["blocks"][i].partition(":")
        it["blocks"][i] = f"{algo}:{(int(value, 16) ^ (1 << rng.randrange(32))):08x}"
    elif how == "drop":
        it["blocks"].pop(rng.randrange(len(it["blocks"])))
    else:
        it["blocks"].append(f"{_algo(it['checksum'])}:{rng.getrandbits(32):08x}")
    return f"item {it['key']} blocks: {how} one"


def _vps_items(doc):
    return [it for it in doc["items"] if "vps" in (it.get("attrs") or {})]


def _m_fragments(rng, p, doc):
    items = _vps_items(doc)
    if not items:
        return _m_offset(rng, p, doc)
    it = rng.choice(items)
    frags = it["attrs"]["vps"]["fragments"]
    f = rng.choice(frags)
    j = rng.randrange(1, 4)  # start, numel or local offset
    f[j] = max(0, f[j] + rng.choice([-1, 1, 7]))
    return f"item {it['key']} fragment {f[0]} field {j} -> {f[j]}"


def _m_vps_group(rng, p, doc):
    items = _vps_items(doc)
    if not items:
        return _m_offset(rng, p, doc)
    it = rng.choice(items)
    it["attrs"]["vps"]["group"] = it["attrs"]["vps"]["group"] + rng.choice([1, -1, 5])
    return f"item {it['key']} partition -> {it['attrs']['vps']['group']}"


def _m_vps_kind(rng, p, doc):
    items = _vps_items(doc)
    if not items:
        return _m_offset(rng, p, doc)
    it = rng.choice(items)
    old = it["attrs"]["vps"]["kind"]
    it["attrs"]["vps"]["kind"] = rng.choice([k for k in ("fp32", "exp_avg", "exp_avg_sq") if k != old])
    return f"item {it['key']} state kind {old} -> {it['attrs']['vps']['kind']}"


def _m_item_kind(rng, p, doc):
    it = rng.choice(doc["items"])
    it["kind"] = "object" if it["kind"] == "tensor" else "tensor"
    return f"item {it['key']} kind -> {it['kind']}"


def _m_drop(rng, p, doc):
    i = rng.randrange(len(doc["items"]))
    return f"item {doc['items'].pop(i)['key']} removed"


def _m_regions(rng, p, doc):
    name = rng.choice(["data_offset", "objects_offset"])
    doc[name] = max(0, doc[name] + rng.choice([-p.alignment, p.alignment, -1, 1]))
    return f"{name} -> {doc[name]}"


def _m_layout(rng, p, doc):
    name = rng.choice(["alignment", "block_bytes", "version"] if "block_bytes" in doc else ["alignment", "version"])
    doc[name] = rng.choice([v for v in (0, 1, 2, 3, 512, 8192, 1 << 19, 1 << 21) if v != doc[name]])
    return f"{name} -> {doc[name]}"


META = {
    "offset": _m_offset,
    "nbytes": _m_nbytes,
    "dtype": _m_dtype,
    "shape": _m_shape,
    "key": _m_key,
    "checksum": _m_checksum,
    "blocks": _m_blocks,
    "fragments": _m_fragments,
    "partition": _m_vps_group,
    "state kind": _m_vps_kind,
    "item kind": _m_item_kind,
    "item removed": _m_drop,
    "regions": _m_regions,
    "layout": _m_layout,
}


def _meta(rng, data, p):
    sub = rng.choice(sorted(META))
    doc = json.loads(encode_footer(p.doc))  # a deep copy
    detail = META[sub](rng, p, doc)
    return with_footer(data, p, doc), sub, detail, "footer"


BYTES: Dict[str, Tuple[int, Callable]] = {  # kind -> (weight, generator)
    "bit flip": (28, _bitflip),
    "burst": (6, _burst),
    "zeroed block": (5, _zero_block),
    "payload": (8, _payload),
    "padding": (4, _padding),
    "header": (4, _header),
    "trailer": (4, _trailer),
    "footer": (6, _footer),
    "truncation": (8, _truncate),
    "extension": (4, _extend),
    "wrong size": (3, _wrong_size),
    "metadata": (16, _meta),
}
FILE_WEIGHT = 2  # whole files: missing, empty, swapped, duplicated
LATEST_WEIGHT = 2  # the directory's latest


def _file_level(rng, files, names, optim):
    sub = rng.choice(["missing", "empty", "swapped ranks", "duplicated rank"])
    if sub in ("missing", "empty"):
        name = rng.choice(names)
        return Corruption("file", sub, name, name, {name: None if sub == "missing" else b""})
    a, b = optim[0], optim[1]
    if sub == "swapped ranks":
        return Corruption("file", sub, a, f"{a} <-> {b}", {a: files[b], b: files[a]})
    src, dst = (a, b) if rng.random() < 0.5 else (b, a)
    return Corruption("file", sub, dst, f"{src} copied over {dst}", {dst: files[src]})


def _latest(rng, tag):
    sub = rng.choice(["garbage", "empty", "path", "dangling", "absolute"])
    content = {
        "garbage": rng.randbytes(rng.randint(1, 64)) + b"\xff",
        "empty": b"",
        "path": f"../{tag}".encode(),
        "dangling": f"{tag}_missing".encode(),
        "absolute": b"/etc",
    }[sub]
    return Corruption("latest", sub, LATEST, repr(content[:40]), {LATEST: content})


def generate(rng: random.Random, files: Dict[str, bytes], tag: str) -> Corruption:
    """One corruption of the snapshot files ``files`` (name -> pristine bytes; every one of this
    project's format) of tag ``tag``."""
    names = sorted(files)
    optim = [n for n in names if "optim_states" in n]
    kinds = sorted(BYTES)
    weights = [BYTES[k][0] for k in kinds] + [FILE_WEIGHT, LATEST_WEIGHT]
    kind = rng.choices(kinds + ["file", "latest"], weights)[0]
    if kind == "file":
        return _file_level(rng, files, names, optim)
    if kind == "latest":
        return _latest(rng, tag)
    name = rng.choice(names)
    data = files[name]
    new, sub, detail, region = BYTES[kind][1](rng, data, parse(data))
    return Corruption(kind, sub, name, detail, {name: new}, region)


def changes_bytes(c: Corruption, files: Dict[str, bytes], latest: bytes) -> bool:
    """Whether ``c`` leaves some file different (a corruption that changes no byte does not count)."""
    for name, new in c.files.items():
        old = latest if name == LATEST else files.get(name)
        if new != old:
            return True
    return False
