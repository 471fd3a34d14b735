"""How close does a snapshot file write come to what the storage can do?

Measured in one run, same directory, same total size, each write ending with fsync:

* **device bound** — sequential O_DIRECT writes through io_uring (``queue_depth`` ×
  ``chunk`` bytes in flight) straight from page-aligned buffers: the most this path can get
  (where io_uring or O_DIRECT is refused, the fallback is used and printed);
* **buffered** — ``open().write()`` of the same chunks, then ``fsync``: what a plain
  ``torch.save``-style writer gets;
* **write_snapshot_file** — ~100 items of mixed sizes (odd ones included, a few objects) totalling
  the same size, through the host cache (a memmove and a CRC-32C per buffer) and the flusher;
* **read_snapshot_file** — reading that file back with its checksums verified.

Printed side by side with ratios to the device bound (``--json``: one JSON object). Each figure
is the median of ``--repeat`` runs. Run as ``python -m benchmarks.io_bound [--size-mib 256]
[--dir DIR] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from io_engine import Flusher, IOBackend, IOConfig, SnapshotFileWriter, WriteItem, read_snapshot_file
from io_engine.host_cache import alloc_aligned

MIB = 1 << 20


def fs_type(path: str) -> str:
    """File system type of ``path`` from /proc/mounts (longest matching mount point)."""
    best, kind = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                if os.path.abspath(path).startswith(mnt.rstrip("/") + "/") or os.path.abspath(path) == mnt:
                    if len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def mixed_items(pool: np.ndarray, n_items: int = 100, seed: int = 0):
    """~``n_items`` views into ``pool`` with log-uniform sizes (odd ones included) that cover it."""
    rng = np.random.default_rng(seed)
    weights = np.exp(rng.uniform(np.log(1), np.log(4096), n_items))
    sizes = np.floor(weights / weights.sum() * pool.nbytes).astype(np.int64)
    sizes[:5] = [0, 1, 511, 4097, 12345]
    sizes[-1] = pool.nbytes - sizes[:-1].sum()
    items, pos = [], 0
    for i, n in enumerate(sizes):
        view = pool[pos : pos + int(n)]
        pos += int(n)
        if i % 25 == 7:
            items.append(WriteItem(f"obj{i}", view, kind="object", attrs={"i": i}))
        else:
            items.append(WriteItem(f"t{i}", view, attrs={"vps": f"layer{i}.weight/param"}))
    return items


def bench_device(path: str, size: int, backend: IOBackend, bufs):
    chunk = backend.config.chunk_bytes
    extents = [(bufs[i % len(bufs)], i * chunk) for i in range(size // chunk)]
    rep = Flusher(backend=backend).write_file(path, extents)
    return rep.seconds, {"engine": rep.engine, "direct": rep.direct}


def bench_buffered(path: str, size: int, cfg: IOConfig, bufs):
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for i in range(size // cfg.chunk_bytes):
            f.write(bufs[i % len(bufs)])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0, {"engine": "write()", "direct": False}


def run(size_mib: int, directory: str, repeat: int, queue_depth: int, chunk_mib: int, cache_mib: int) -> dict:
    cfg = IOConfig(queue_depth=queue_depth, chunk_bytes=chunk_mib * MIB)
    size = max(1, size_mib * MIB // cfg.chunk_bytes) * cfg.chunk_bytes
    rng = np.random.default_rng(0)
    bufs = []
    for _ in range(4):
        m = alloc_aligned(cfg.chunk_bytes)
        np.frombuffer(m, np.uint8)[:] = rng.integers(0, 256, cfg.chunk_bytes, dtype=np.uint8)
        bufs.append(m)
    pool = rng.integers(0, 256, size, dtype=np.uint8)
    items = mixed_items(pool)
    backend = IOBackend(cfg)  # one policy: a refusal (io_uring, O_DIRECT) shows once, below
    writer = SnapshotFileWriter(flusher=Flusher(backend=backend), cache_bytes=cache_mib * MIB)
    path = os.path.join(directory, f".io_bound.{os.getpid()}")
    results, meta = {}, {}

    def timed(name, fn):
        runs = []
        for _ in range(repeat):
            if name != "read_snapshot_file" and os.path.exists(path):
                os.unlink(path)  # every write creates a fresh file
            seconds, info = fn()
            runs.append(seconds)
            meta[name] = info
        results[name] = statistics.median(runs)

    def snapshot_write():
        res = writer.write(path, items, file_attrs={"bench": True})
        return res.report.seconds, {
            "engine": res.report.engine,
            "direct": res.report.direct,
            "file_bytes": res.layout.file_size,
        }

    def snapshot_read():
        t0 = time.perf_counter()
        got = read_snapshot_file(path, backend=backend)
        seconds = time.perf_counter() - t0
        assert len(got) == len(items)
        return seconds, {"verified": True}

    try:
        writer.write(path, mixed_items(pool[: writer.cache.total_bytes]))  # warm the cache pages
        timed("device_bound_odirect_uring", lambda: bench_device(path, size, backend, bufs))
        timed("buffered_write_fsync", lambda: bench_buffered(path, size, cfg, bufs))
        timed("write_snapshot_file", snapshot_write)
        timed("read_snapshot_file", snapshot_read)
    finally:
        writer.close()
        if os.path.exists(path):
            os.unlink(path)
    dev = results["device_bound_odirect_uring"]
    out = {
        "size_bytes": size,
        "dir": directory,
        "fs_type": fs_type(directory),
        "repeat": repeat,
        "queue_depth": cfg.queue_depth,
        "chunk_bytes": cfg.chunk_bytes,
        "host_cache_bytes": cache_mib * MIB,
        "items": len(items),
        "results": {
            k: {"seconds": round(v, 4), "gib_per_s": round(size / v / (1 << 30), 3), **meta[k]}
            for k, v in results.items()
        },
        "ratios_vs_device_bound": {k: round(dev / v, 3) for k, v in results.items()},
        "snapshot_vs_buffered": round(results["buffered_write_fsync"] / results["write_snapshot_file"], 3),
        "fallbacks": backend.fallbacks,
    }
    return out


def writer_cpu(size_bytes: int, directory: str, repeat: int = 4, tensors: int = 3) -> dict:
    """CPU time one rank's snapshot file costs its process, apart from training: ``tensors``
    page-aligned fp32 arrays of random values totalling ``size_bytes`` (what a rank's optimizer
    file holds: master and two moments), written ``repeat + 1`` times to the same path by one
    :class:`SnapshotFileWriter` as the snapshot engine writes them (from the arrays' own memory,
    O_DIRECT, CRC-32C per block, ``fsync``). The first write, with the pages' first touches, is
    left out. Returns ``cpu_s`` (median user + system seconds of every thread of this process per
    file), ``user_s``, ``system_s``, ``wall_s`` (medians), ``first_cpu_s`` and ``size_bytes``."""
    import resource

    rng = np.random.default_rng(0)
    n = max(1, size_bytes // (4 * tensors))
    arrays = []
    for _ in range(tensors):
        m = alloc_aligned(n * 4)
        a = np.frombuffer(m, np.float32, count=n)
        a[:] = rng.standard_normal(n, dtype=np.float32)
        arrays.append(a)
    path = os.path.join(directory, f".writer_cpu.{os.getpid()}")
    runs = []
    with SnapshotFileWriter(cache_bytes=256 * MIB) as writer:
        try:
            for _ in range(repeat + 1):
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                writer.write(path, [(f"t{i}", a) for i, a in enumerate(arrays)])
                r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                runs.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, t1 - t0))
        finally:
            if os.path.exists(path):
                os.unlink(path)
    first, rest = runs[0], runs[1:]
    return {
        "size_bytes": n * 4 * tensors,
        "cpu_s": statistics.median(u + s for u, s, _ in rest),
        "user_s": statistics.median(u for u, _, _ in rest),
        "system_s": statistics.median(s for _, s, _ in rest),
        "wall_s": statistics.median(w for _, _, w in rest),
        "first_cpu_s": first[0] + first[1],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=int, default=256, help="total bytes per write, MiB")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="directory to write into")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--cache-mib", type=int, default=256, help="host cache size, MiB")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    out = run(a.size_mib, a.dir, a.repeat, a.queue_depth, a.chunk_mib, a.cache_mib)
    if a.json:
        print(json.dumps(out))
        return 0
    print(
        f"io bound: {out['size_bytes'] / MIB:.0f} MiB per write in {out['dir']} ({out['fs_type']}), "
        f"queue depth {out['queue_depth']}, chunk {out['chunk_bytes'] // MIB} MiB, "
        f"host cache {out['host_cache_bytes'] // MIB} MiB, median of {out['repeat']}"
    )
    print(f"{'':34s} {'GiB/s':>7s} {'seconds':>8s} {'x device':>9s}  path")
    for k, r in out["results"].items():
        how = f"{r.get('engine', '')}{', O_DIRECT' if r.get('direct') else ''}"
        print(f"{k:34s} {r['gib_per_s']:7.3f} {r['seconds']:8.3f} {out['ratios_vs_device_bound'][k]:9.2f}  {how}")
    print(f"write_snapshot_file vs buffered write+fsync: {out['snapshot_vs_buffered']:.2f}x")
    for line in out["fallbacks"]:
        print(f"fallback: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
