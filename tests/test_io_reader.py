"""The reader: odd sizes round-trip exactly, byte ranges come back exactly as asked, every
backend reads the same bytes, and refusals (INJECTED at the seams) fall back."""

import errno
import fcntl
import os

import numpy as np
import pytest
from faults import SMALL, faulty, refuse_direct_open, refuse_uring, uring_available

from io_engine import (
    FileReader,
    IOBackend,
    IOConfig,
    StorageReadError,
    read_ranges,
    read_snapshot_file,
    write_snapshot_file,
)

ODD = (0, 1, 511, 512, 513, 4095, 4096, 4097)


ENGINES = [
    pytest.param("io_uring", marks=pytest.mark.skipif(not uring_available(), reason="io_uring refused here")),
    "threads",
]


@pytest.fixture
def odd_file(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {f"u8_{n}": rng.integers(0, 256, n, dtype=np.uint8) for n in ODD}
    arrays["f16_odd"] = rng.standard_normal(2049).astype(np.float16)  # 4098 bytes
    arrays["f32_2d"] = rng.standard_normal((3, 5)).astype(np.float32)
    path = str(tmp_path / "odd.dsnap")
    items = [(k, v, "tensor", {"n": int(v.size)}) for k, v in arrays.items()]
    items.append(("obj_513", bytes(range(256)) * 2 + b"!", "object"))
    layout = write_snapshot_file(path, items)
    return path, arrays, layout


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("direct", ["auto", False])
def test_odd_sizes_roundtrip_exactly(odd_file, engine, direct):
    path, arrays, _ = odd_file
    got = read_snapshot_file(path, config=IOConfig(engine=engine, direct=direct, **SMALL))
    for key, arr in arrays.items():
        view, meta = got[key]
        assert meta.nbytes == arr.nbytes and meta.dtype == arr.dtype.name and meta.shape == arr.shape
        back = np.frombuffer(view, dtype=meta.dtype).reshape(meta.shape)
        assert back.tobytes() == arr.tobytes(), key
    assert bytes(got["obj_513"][0]) == bytes(range(256)) * 2 + b"!"


def test_reader_uses_o_direct_and_io_uring_when_available(odd_file):
    path, _, _ = odd_file
    with FileReader(path) as r:
        assert r.engine == ("io_uring" if uring_available() else "threads")
        r.read_items()
        # O_DIRECT unless the file system refuses it (then the fallback was logged)
        assert r.direct or r.backend.fallbacks


@pytest.mark.parametrize("engine", ENGINES)
def test_range_reads_return_exactly_the_requested_bytes(tmp_path, engine):
    path = str(tmp_path / "raw")
    data = np.random.default_rng(2).integers(0, 256, 100_003, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    rng = np.random.default_rng(3)
    ranges = [
        (0, 0),
        (0, 1),
        (1, 1),
        (4095, 2),
        (4096, 4096),
        (100_002, 1),
        (12345, 50_000),
        (0, 100_003),
        (7, 0),
        (40_000, 33_333),
    ]
    ranges += [(int(o), int(rng.integers(0, 100_003 - o))) for o in rng.integers(0, 100_003, 20)]
    views = read_ranges(path, ranges, config=IOConfig(engine=engine, **SMALL))
    assert [len(v) for v in views] == [n for _, n in ranges]
    for (off, n), v in zip(ranges, views):
        assert bytes(v) == data[off : off + n], (off, n)


def test_item_ranges_of_a_snapshot(odd_file):
    path, arrays, layout = odd_file
    m = layout.item("f16_odd")
    with FileReader(path, config=IOConfig(**SMALL)) as r:
        # a rank that holds elements [100, 1100) of the float16 tensor reads only those bytes
        (view,) = r.read_ranges([(m.offset + 200, 2000)])
        assert bytes(view) == arrays["f16_odd"][100:1100].tobytes()


def test_range_outside_the_file_is_refused(tmp_path):
    path = str(tmp_path / "raw")
    with open(path, "wb") as f:
        f.write(b"x" * 10)
    with pytest.raises(StorageReadError, match=f"{path}.*outside the file of 10 bytes"):
        read_ranges(path, [(5, 6)])
    with pytest.raises(StorageReadError, match="outside"):
        read_ranges(path, [(-1, 1)])


def test_reader_falls_back_when_refused(odd_file):
    """INJECTED: io_uring refused at queue init and O_DIRECT refused at open."""
    path, arrays, _ = odd_file

    backend = IOBackend(
        IOConfig(**SMALL), queue_factory=lambda k, d: refuse_uring(k, d, errno.EPERM), opener=refuse_direct_open
    )
    got = read_snapshot_file(path, backend=backend)
    assert bytes(got["u8_4097"][0]) == arrays["u8_4097"].tobytes()
    with FileReader(path, backend=backend) as r:
        assert (r.engine, r.direct) == ("threads", False)
    assert len(backend.fallbacks) == 2
    assert any("EPERM" in m for m in backend.fallbacks)


def test_reader_direct_refused_on_first_read_retries_buffered(odd_file):
    """INJECTED: reads on an O_DIRECT descriptor complete with EINVAL (as on some file systems)."""
    path, arrays, _ = odd_file

    backend = IOBackend(
        IOConfig(**SMALL),
        queue_factory=faulty(
            lambda fd, off: False,
            lambda view: -errno.EINVAL,
            [],
            should_fail_read=lambda fd, off: bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT),
        ),
    )
    with FileReader(path, backend=backend) as r:
        views = r.read_items()
        assert r.direct is False
    for key, arr in arrays.items():
        assert bytes(views[key]) == arr.tobytes()
    assert len([m for m in backend.fallbacks if "O_DIRECT refused" in m]) == 1
