"""The payload checksums (:mod:`io_engine.checksum`) and the snapshot worker's thread priority.

Oracles: ``zlib.crc32`` and ``google_crc32c.value`` (that package's own binding, neither the
``crc32c`` package :mod:`io_engine.checksum` prefers nor its ``ctypes`` route into google's
library), the CRC-32C check value of RFC 3720 (B.4), the source bytes a copy must reproduce, and
the nice values the kernel reports per thread.
"""

from __future__ import annotations

import os
import sys
import threading
import zlib

import google_crc32c
import numpy as np
import pytest

from ds_dynatrain.checkpoint.snapshot import SnapshotCheckpointEngine
from ds_dynatrain.errors import ConfigError
from io_engine import checksum as ck
from io_engine.host_cache import alloc_aligned
from io_engine.priority import lower_thread_priority

ORACLE = {"crc32": zlib.crc32, "crc32c": google_crc32c.value}


def test_the_hardware_crc32c_loads_and_gives_the_check_value():
    assert ck.native_crc32c() and ck.default_algo() == "crc32c"
    assert ck.crc_update("crc32c", b"123456789") == 0xE3069283  # RFC 3720 B.4


@pytest.mark.parametrize("load", [ck._icrar_crc32c, ck._google_crc32c])
def test_each_hardware_route_gives_the_oracles_value_for_any_contiguous_view(load):
    fn = load()
    assert fn is not None  # both packages are dependencies, and this CPU has the instruction
    data = np.random.default_rng(3).standard_normal((257, 1031)).astype(np.float16)  # 529,934 bytes
    raw = data.tobytes()
    view = memoryview(data).cast("B")
    assert fn(0, view) == google_crc32c.value(raw)
    assert fn(fn(0, view[:4099]), view[4099:]) == google_crc32c.value(raw)  # continued
    assert fn(0, memoryview(raw)) == google_crc32c.value(raw)  # read-only memory
    assert ck.crc_update("crc32c", data) == google_crc32c.value(raw)  # a 2-D half-precision array


@pytest.mark.parametrize("algo", ["crc32c", "crc32"])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, ck.PIECE_BYTES, ck.PIECE_BYTES + 1, 3 * ck.PIECE_BYTES - 7])
def test_copy_with_crc_copies_every_byte_and_checksums_the_copy(algo, nbytes):
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = alloc_aligned(nbytes + 100)
    dst[:] = b"\xaa" * len(dst)  # bytes past the copy must stay as they were
    got = ck.copy_with_crc(algo, memoryview(dst)[:nbytes], memoryview(src))
    assert dst[:nbytes] == src.tobytes() and dst[nbytes:] == b"\xaa" * (len(dst) - nbytes)
    assert got == ORACLE[algo](src.tobytes())


@pytest.mark.parametrize("algo", ["crc32c", "crc32"])
def test_running_checksums_continue_across_pieces(algo):
    data = np.random.default_rng(1).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    dst = bytearray(len(data))
    crc = 0
    for a, b in ((0, 5), (5, 1 << 20), (1 << 20, len(data))):
        crc = ck.copy_with_crc(algo, memoryview(dst)[a:b], memoryview(data)[a:b], crc)
    assert crc == ORACLE[algo](data) == ck.crc_update(algo, data[7:], ck.crc_update(algo, data[:7]))


def test_a_cpu_without_the_crc32c_instruction_writes_crc32_and_still_reads_crc32c(monkeypatch):
    """INJECTED: the ``crc32c`` package says it has no hardware path (``hardware_based``)."""
    import crc32c

    monkeypatch.setattr(crc32c, "hardware_based", False)
    monkeypatch.setattr(ck, "_native", None)
    monkeypatch.setattr(ck, "_native_tried", False)
    assert not ck.native_crc32c() and ck.default_algo() == "crc32"  # not google's software path either
    data = np.random.default_rng(5).integers(0, 256, 70_001, dtype=np.uint8)
    assert ck.crc_update("crc32c", data) == google_crc32c.value(data.tobytes())  # version 3 files still read


def test_data_that_is_not_contiguous_is_refused_by_name():
    strided = np.arange(64, dtype=np.uint8)[::2]
    for algo in ("crc32c", "crc32"):
        with pytest.raises(ValueError, match="must be C-contiguous"):
            ck.crc_update(algo, strided)


def test_bad_calls_are_refused_and_touch_nothing():
    dst = bytearray(8)
    with pytest.raises(ValueError, match="copy of 4 bytes into a view of 8"):
        ck.copy_with_crc("crc32c", memoryview(dst), memoryview(b"abcd"))
    with pytest.raises(ValueError, match="copy of 4 bytes into a view of 8"):
        ck.copy_bytes(memoryview(dst), memoryview(b"abcd"))
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        ck.copy_with_crc("md5", memoryview(dst), memoryview(b"abcdefgh"))
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        ck.crc_update("md5", b"x")
    assert dst == bytearray(8)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_a_thread_lowers_its_own_priority_and_no_other():
    main_before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def worker():
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        seen["returned"] = lower_thread_priority(3)
        seen["before"], seen["after"] = before, os.getpriority(os.PRIO_PROCESS, tid)
        child = threading.Thread(target=lambda: seen.__setitem__("child", os.getpriority(os.PRIO_PROCESS, 0)))
        child.start()
        child.join()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["after"] == min(19, seen["before"] + 3) == seen["returned"]
    assert seen["child"] == seen["after"]  # threads it starts inherit it
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_before
    assert lower_thread_priority(0) is None


@pytest.mark.parametrize("nice", [-1, 20, 2.5, "5"])
def test_an_engine_refuses_a_bad_worker_nice(nice):
    with pytest.raises(ConfigError, match="worker_nice must be an int from 0 to 19"):
        SnapshotCheckpointEngine(worker_nice=nice)


def test_a_writer_refuses_an_unknown_checksum():
    from io_engine import SnapshotFileWriter

    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        SnapshotFileWriter(checksum="md5")
