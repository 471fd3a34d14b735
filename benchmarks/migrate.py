"""Loading a checkpoint at another world size: ours beside DeepSpeed's universal-checkpoint route.

    python -m benchmarks.migrate [--params 100M] [--save-ranks 4] [--to 3,2] [--json] [--dir DIR]

One run, on this machine. A Llama-shaped model (as ``benchmarks.reconfig``: vocabulary 8192,
hidden 768, 12 layers for about 97 M parameters; ``--params`` picks the number of layers), ZeRO-2,
fp32, AdamW, trained one step on ``--save-ranks`` ranks, which save the same state twice: a
snapshot (this project's engine) and a DeepSpeed checkpoint (DeepSpeed's default engine). Then:

* ``convert_s``: DeepSpeed's ``ds_to_universal`` of the DeepSpeed checkpoint, one process start
  to its end (once; its peak resident memory, workers included, ``convert_peak_rss_bytes``);
* the device bound: this project's reader (io_uring, O_DIRECT, 8 MiB reads, 32 in flight) reading
  every optimizer-state file of the snapshot whole, from one process and from one process per
  file at once, the faster: ``bound_gbps``;
* per target world size M: ``ours_s``, M fresh ranks' ``load_checkpoint`` of the snapshot
  (barrier to barrier, after the engines are built), with the bytes each rank read and how long
  its reads took (``read_gbps`` = all ranks' bytes / the slowest rank's read time); and
  ``deepspeed_route_s`` = ``convert_s`` + M fresh ranks' ``load_checkpoint`` with
  ``load_universal`` (same end points). ``ratio`` = ``deepspeed_route_s / ours_s``;
  ``peak_rss_bytes`` / ``deepspeed_peak_rss_bytes``: the largest rise of a rank's resident set
  during its load (for DeepSpeed's route also the converter's whole peak).

Before every load the checkpoint files are dropped from the page cache (``posix_fadvise``
``DONTNEED``), so both routes read from the device. Times in seconds, sizes in bytes, bandwidths
in GB/s (1e9 bytes per second). ``--json`` prints one JSON object per transition.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.reconfig import JobFailed, layers_for, llama_params, parse_count, read_json, run_job, run_plain  # noqa: E402

WORKER = os.path.join(ROOT, "benchmarks", "migrate_worker.py")
TAG = "global_step1"


def run_ranks(nproc: int, args: List[str], work: str, name: str, timeout: float) -> None:
    run_plain(nproc, args, work, name, timeout, worker=WORKER)


def evict(path: str) -> None:
    """Drop every file under ``path`` from the page cache (clean pages only; no privileges)."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _read_whole(path: str) -> int:
    from io_engine import FileReader

    with FileReader(path) as r:
        return sum(len(v) for v in r.read_ranges([(0, r.layout.file_size)]))


def device_bound(snapshot_dir: str) -> dict:
    """Read every optimizer-state file of the snapshot whole with our reader (io_uring, O_DIRECT),
    both from one process and from one process per file at once; the faster of the two, best of
    2 rounds, from a cold page cache."""
    from concurrent.futures import ProcessPoolExecutor

    files = sorted(os.path.join(snapshot_dir, f) for f in os.listdir(snapshot_dir) if f.endswith("optim_states.pt"))
    best, total = float("inf"), 0
    with ProcessPoolExecutor(max_workers=len(files)) as pool:
        for parallel in (False, True, False, True):
            evict(snapshot_dir)
            t0 = time.perf_counter()
            total = sum(pool.map(_read_whole, files)) if parallel else sum(map(_read_whole, files))
            best = min(best, time.perf_counter() - t0)
    return {"bound_bytes": total, "bound_s": best, "bound_gbps": total / best / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("100M"))
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--save-ranks", type=int, default=4)
    ap.add_argument("--to", default="3,2", help="target world sizes, comma-separated")
    ap.add_argument("--dir", default=None, help="where the temporary checkpoints go (default: the system's)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    layers = layers_for(a.params, a.hidden)
    model = ["--hidden", str(a.hidden), "--layers", str(layers)]
    work = tempfile.mkdtemp(prefix="dynatrain-migrate-", dir=a.dir)
    ckpt = os.path.join(work, "ckpt")
    results = []
    try:
        n = a.save_ranks
        run_ranks(
            n,
            ["--mode", "save", *model, "--dir", ckpt, "--tag", TAG, "--out", os.path.join(work, "save.json")],
            work,
            "save",
            a.timeout,
        )
        save = read_json(os.path.join(work, "save.json"), os.path.join(work, "save_rank0.log"))
        convert_out = os.path.join(work, "convert.json")
        convert_wall = run_job(
            [sys.executable, WORKER, "--mode", "convert", "--dir", ckpt, "--tag", TAG, "--out", convert_out],
            os.path.join(work, "convert.log"),
            a.timeout,
            "ds_to_universal",
        )
        convert = read_json(convert_out, os.path.join(work, "convert.log"))
        convert_s, convert_peak = convert_wall, convert["peak_rss_bytes"]
        bound = device_bound(os.path.join(ckpt, "ours", TAG))
        for m in (int(x) for x in a.to.split(",")):
            evict(ckpt)
            run_ranks(
                m,
                ["--mode", "ours", *model, "--dir", ckpt, "--tag", TAG, "--out", os.path.join(work, f"ours{m}.json")],
                work,
                f"ours{m}",
                a.timeout,
            )
            ours = read_json(os.path.join(work, f"ours{m}.json"), os.path.join(work, f"ours{m}_rank0.log"))
            evict(ckpt)
            run_ranks(
                m,
                [
                    "--mode",
                    "deepspeed",
                    *model,
                    "--dir",
                    ckpt,
                    "--tag",
                    f"{TAG}_universal",
                    "--out",
                    os.path.join(work, f"ds{m}.json"),
                ],
                work,
                f"ds{m}",
                a.timeout,
            )
            ds = read_json(os.path.join(work, f"ds{m}.json"), os.path.join(work, f"ds{m}_rank0.log"))
            read_bytes = sum(r["bytes_read"] for r in ours["ranks"])
            read_s = max(r["read_s"] for r in ours["ranks"])
            route = convert_s + ds["load_s"]
            results.append(
                {
                    "transition": f"{n}->{m}",
                    "params": save["params"],
                    "ours_s": ours["load_s"],
                    "deepspeed_route_s": route,
                    "convert_s": convert_s,
                    "deepspeed_load_s": ds["load_s"],
                    "ratio": route / ours["load_s"],
                    "bytes_read": read_bytes,
                    "read_s": read_s,
                    "read_gbps": read_bytes / read_s / 1e9,
                    "bound_gbps": bound["bound_gbps"],
                    "read_vs_bound": (read_bytes / read_s / 1e9) / bound["bound_gbps"],
                    "peak_rss_bytes": max(r["peak_extra_bytes"] for r in ours["ranks"]),
                    "deepspeed_peak_rss_bytes": max([r["peak_extra_bytes"] for r in ds["ranks"]] + [convert_peak]),
                    "convert_peak_rss_bytes": convert_peak,
                    "ranks": ours["ranks"],
                }
            )
    except JobFailed as err:
        print(f"benchmarks.migrate: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        for r in results:
            print(json.dumps(r))
        return 0
    mib = 2**20
    print(
        f"{results[0]['params'] / 1e6:.1f} M parameters ({llama_params(a.hidden, layers) / 1e6:.1f} M computed), "
        f"ZeRO-2 fp32 AdamW, saved on {a.save_ranks} ranks; ds_to_universal {results[0]['convert_s']:.2f} s; "
        f"device bound {results[0]['bound_gbps']:.2f} GB/s"
    )
    for r in results:
        print(
            f"{r['transition']}: ours {r['ours_s']:.2f} s, DeepSpeed route {r['deepspeed_route_s']:.2f} s "
            f"(convert {r['convert_s']:.2f} + load {r['deepspeed_load_s']:.2f}) -> {r['ratio']:.1f}x; "
            f"read {r['bytes_read'] / mib:.0f} MiB at {r['read_gbps']:.2f} GB/s = "
            f"{r['read_vs_bound']:.2f} of the bound; "
            f"peak extra memory per rank: ours {r['peak_rss_bytes'] / mib:.0f} MiB, "
            f"DeepSpeed's route {r['deepspeed_peak_rss_bytes'] / mib:.0f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
