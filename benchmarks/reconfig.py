"""Reconfiguration downtime: our online resize beside DeepSpeed's universal-checkpoint route.

    python -m benchmarks.reconfig [--params 100M] [--transitions 2:1,1:2,2:3] [--busy K] [--json] [--dir DIR]

One run, on this machine, a Llama-shaped model (vocabulary 8192, hidden 768, MLP 2048, 64-wide
heads, untied embeddings, sequence length 64, micro-batch 1; ``--params`` picks the number of
layers, 12 for about 97 M parameters; ``--hidden``/``--layers`` override), ZeRO-2, fp32, AdamW
(``torch_adam`` with ``fused``: torch's one-kernel CPU AdamW), the same global batch on both sides
of each transition. Per transition N->M:

* ``ours``: ``dynatrain launch --nproc N`` with ``resize_schedule`` at step K (``--steps-before``)
  to M; K steps on N, the resize inside ``engine.step()`` of step K, then ``--steps-after`` steps
  on M. ``ours_s`` = the resize record's ``seconds`` + ``first_step_excess_s`` (how much longer the
  first iteration on M takes than the median of the later ones): the downtime between the last
  step on N and the first normal step on M. Split: ``plan_s, group_s`` (forming the new process
  group, waiting for joiners included), ``transfer_s, rebuild_s``, and any further ``*_s`` of the
  record; ``transfer_gbps`` = ``bytes_moved / transfer_s``.
* ``deepspeed``: N plain ``deepspeed.initialize`` ranks train K steps and ``save_checkpoint``
  (``save_s``); ``python -m deepspeed.checkpoint.ds_to_universal`` (``convert_s``, the whole
  command); M fresh ranks with ``checkpoint.load_universal`` load it and train one step
  (``relaunch_s``: from starting the processes to the end of their load, plus how much longer
  their first step takes than a normal iteration on M, ``new_iter_s``, measured in our run: the
  same end point as ours). ``deepspeed_route_s`` = the sum; ``ratio`` = ``deepspeed_route_s / ours_s``.
* the link bound: two plain gloo processes send a 256 MiB buffer (best of 3 after a warm-up),
  right before and right after our job of each transition (this VM's loopback bandwidth moves by
  up to 2x from one minute to the next); the better of the two is ``link_gbps``;
  ``bound_s = bytes_moved / link``; ``transfer_vs_bound = transfer_s / bound_s``.
  For 2->1 and 1->2 every byte crosses the one link; for 2->3 two senders feed one joiner, so the
  bound counts the bytes as if they crossed one link. A grow also sends the joiners the working
  parameters (``params_bytes``; ``params_s`` from the start of the moments' transfer to the end
  of the parameters') beside the moments, over the same link:
  ``all_vs_bound = max(transfer_s, params_s) / ((bytes_moved + params_bytes) / link)`` is how
  near the link the two together ran (for a shrink it is ``transfer_vs_bound``).

``--busy K`` keeps K more processes busy with one-thread matrix products for the whole run (the
same work beside both routes): the ratio on a machine with other work.

Times in seconds, sizes in bytes, bandwidths in GB/s (1e9 bytes per second). ``--json`` prints one
JSON object per transition; otherwise a table. Checkpoints and logs go to a temporary directory
under ``--dir`` that is removed at the end. A failed job stops the run with the tail of its log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "reconfig_worker.py")
VOCAB = 8192


class JobFailed(RuntimeError):
    """A benchmark job exited non-zero or ran past its timeout (the message holds its log's tail)."""


# ---------------------------------------------------------------------- model size
def llama_params(hidden: int, layers: int, vocab: int = VOCAB, kv_heads: Optional[int] = None) -> int:
    """Parameters of the worker's Llama: untied embedding and head, per layer q/k/v/o (k and v
    ``kv_heads`` 64-wide heads, all ``hidden // 64`` by default), gate/up/down (MLP width
    ``hidden * 8 // 3``) and two RMSNorms, plus the final norm."""
    inter = hidden * 8 // 3
    kv = hidden if kv_heads is None else 64 * kv_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


def parse_count(text: str) -> int:
    """``100M``, ``20m``, ``1.5B``, ``500K`` or a plain number -> a count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 100M, 20M, 1.5B)")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}[m.group(2).lower()])


def layers_for(params: int, hidden: int, kv_heads: Optional[int] = None) -> int:
    """The number of layers (at least 1) whose model is nearest ``params``."""
    return min(range(1, 1000), key=lambda n: abs(llama_params(hidden, n, kv_heads=kv_heads) - params))


def parse_transitions(text: str) -> List[Tuple[int, int]]:
    out = []
    for part in text.split(","):
        n, sep, m = part.strip().partition(":")
        if not sep or not n.isdigit() or not m.isdigit() or int(n) < 1 or int(m) < 1 or n == m:
            raise argparse.ArgumentTypeError(f"bad transition {part!r}: expected N:M with N != M, both >= 1")
        out.append((int(n), int(m)))
    return out


def global_batch(n: int, m: int, at_least: int) -> int:
    """The smallest multiple of lcm(n, m) that is at least ``at_least`` (samples)."""
    step = math.lcm(n, m)
    return step * max(1, -(-at_least // step))


# ---------------------------------------------------------------------- jobs
def job_env() -> dict:
    """Environment of every job: CPU accelerator unless set, the repository importable, and
    OMP_NUM_THREADS unset: our workers take their share of the host's CPUs at every world size
    (ds_dynatrain/elastic/threads.py); the plain DeepSpeed ranks get the same share from
    :func:`run_plain`. torch's huge-page CPU allocation on for both routes, as ``dynatrain
    launch`` sets it (unless the caller's environment names it)."""
    from ds_dynatrain.elastic.launch_env import with_huge_pages

    env = with_huge_pages(dict(os.environ))
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("OMP_NUM_THREADS", None)
    return env


def tail(path: str, chars: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def wait_all(procs: Sequence[subprocess.Popen], logs: Sequence[str], timeout: float, what: str) -> None:
    """Wait for ``procs`` (each in its own session) within ``timeout`` seconds; kill every process
    group they left behind; raise :class:`JobFailed` on a timeout or a non-zero status."""
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    for i, rc in enumerate(codes):
        if rc != 0:
            why = f"timed out after {timeout:.0f} s" if rc is None else f"exited with status {rc}"
            raise JobFailed(f"{what} (process {i}) {why}; log {logs[i]}:\n{tail(logs[i])}")


def start(cmd: Sequence[str], log: str, env: dict) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(
            list(cmd), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )


def run_job(cmd: Sequence[str], log: str, timeout: float, what: str) -> float:
    """Run one command to completion; returns its wall time, seconds."""
    t0 = time.perf_counter()
    wait_all([start(cmd, log, job_env())], [log], timeout, what)
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plain(nproc: int, args: Sequence[str], work: str, name: str, timeout: float, worker: str = WORKER) -> float:
    """Start ``nproc`` plain torch.distributed ranks of ``worker`` (env:// rendezvous) and wait for
    them. Returns the wall-clock time (``time.time()``) just before the first was started."""
    port = free_port()
    procs, logs = [], []
    t_start = time.time()
    for r in range(nproc):
        env = job_env()
        env.update(
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(max(1, len(os.sched_getaffinity(0)) // nproc)),  # as ours: the host's CPUs shared
        )
        logs.append(os.path.join(work, f"{name}_rank{r}.log"))
        procs.append(start([sys.executable, worker, *args], logs[-1], env))
    wait_all(procs, logs, timeout, name)
    return t_start


def read_json(path: str, log: str) -> dict:
    """A job's result file; :class:`JobFailed` with the tail of ``log`` when the job ended
    without writing it."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise JobFailed(f"the job wrote no result ({err}); its log:\n{tail(log)}") from None


def base_config(batch: int) -> dict:
    """DeepSpeed config shared by both routes: global batch ``batch`` samples, micro-batch 1."""
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }


def model_args(a) -> List[str]:
    return ["--hidden", str(a.hidden), "--layers", str(a.layers), "--seq-len", str(a.seq_len)]


def measure_link(a, work: str) -> dict:
    """Point-to-point bandwidth between two gloo processes on this host (``link_gbps``, GB/s)."""
    out = os.path.join(work, "link.json")
    run_plain(2, ["--mode", "link", "--mib", str(a.link_mib), "--repeat", "3", "--out", out], work, "link", a.timeout)
    return read_json(out, os.path.join(work, "link_rank0.log"))


def run_ours(n: int, m: int, a, work: str, batch: int) -> dict:
    """Our route N -> M: one ``dynatrain launch`` job resized at step K. Returns rank 0's result."""
    name = f"ours_{n}to{m}"
    k = a.steps_before
    cfg = dict(
        base_config(batch),
        dynatrain={
            "resize_schedule": [{"step": k, "world_size": m}],
            "spawn_lookahead_steps": k,
            "log_interval_steps": 10**6,
            **({} if a.joiner_nice is None else {"joiner_nice": a.joiner_nice}),
        },
    )
    cfg_path = os.path.join(work, f"{name}.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    out = os.path.join(work, f"{name}.out.json")
    cmd = [
        sys.executable,
        "-m",
        "ds_dynatrain.cli",
        "launch",
        "--nproc",
        str(n),
        "--slots",
        str(max(n, m)),
        "--config",
        cfg_path,
        WORKER,
        "--mode",
        "ours",
        *model_args(a),
        "--steps",
        str(k + a.steps_after),
        "--out",
        out,
    ]
    log = os.path.join(work, f"{name}.log")
    run_job(cmd, log, a.timeout, f"ours {n}->{m}")
    return read_json(out, log)


def run_deepspeed(n: int, m: int, a, work: str, batch: int) -> dict:
    """DeepSpeed's route N -> M: save on N, ds_to_universal, load on M. Times in seconds."""
    name = f"ds_{n}to{m}"
    k = a.steps_before
    ckpt = os.path.join(work, f"{name}_ckpt")
    tag = f"global_step{k}"
    cfg_path = os.path.join(work, f"{name}.json")
    with open(cfg_path, "w") as f:
        json.dump(base_config(batch), f)
    common = ["--config", cfg_path, *model_args(a), "--dir", ckpt]
    save_out = os.path.join(work, f"{name}_save.json")
    run_plain(
        n,
        ["--mode", "ds-save", *common, "--tag", tag, "--steps", str(k), "--out", save_out],
        work,
        f"{name}_save",
        a.timeout,
    )
    save = read_json(save_out, os.path.join(work, f"{name}_save_rank0.log"))
    uni_tag = f"{tag}_universal"
    convert_s = run_job(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            os.path.join(ckpt, tag),
            "--output_folder",
            os.path.join(ckpt, uni_tag),
            "--num_extract_workers",
            str(a.convert_workers),
            "--num_merge_workers",
            str(a.convert_workers),
        ],
        os.path.join(work, f"{name}_convert.log"),
        a.timeout,
        f"ds_to_universal {n}->{m}",
    )
    load_out = os.path.join(work, f"{name}_load.json")
    t_start = run_plain(
        m,
        ["--mode", "ds-load", *common, "--tag", uni_tag, "--steps", "1", "--out", load_out],
        work,
        f"{name}_load",
        a.timeout,
    )
    load = read_json(load_out, os.path.join(work, f"{name}_load_rank0.log"))
    shutil.rmtree(ckpt, ignore_errors=True)
    return {
        "save_s": save["save_s"],
        "convert_s": convert_s,
        "relaunch_s": load["t_first_step"] - t_start,
        "relaunch_startup_s": load["t_init"] - t_start,
        "relaunch_load_s": load["t_load"] - load["t_init"],
        "relaunch_first_step_s": load["t_first_step"] - load["t_load"],
        "checkpoint_bytes": save["checkpoint_bytes"],
        "params": save["params"],
    }


def transition(n: int, m: int, a, work: str) -> dict:
    """Both routes for N -> M and the figures derived from them (seconds, bytes, GB/s)."""
    batch = global_batch(n, m, a.global_batch)
    before = measure_link(a, work)
    ours = run_ours(n, m, a, work, batch)
    after = measure_link(a, work)
    link = before if before["link_gbps"] >= after["link_gbps"] else after
    ds = run_deepspeed(n, m, a, work, batch)
    rec = ours["record"]
    excess = ours["first_step_excess_s"] or 0.0
    ours_s = rec["seconds"] + excess
    split = {k: v for k, v in rec.items() if k.endswith("_s") and k != "seconds"}
    # as for ours, the route's downtime ends at the first *normal* step on M: its first step counts
    # only by its excess over a normal iteration on M
    ds["relaunch_first_step_excess_s"] = max(0.0, ds["relaunch_first_step_s"] - (ours["new_iter_s"] or 0.0))
    ds["relaunch_s"] = ds["relaunch_startup_s"] + ds["relaunch_load_s"] + ds["relaunch_first_step_excess_s"]
    route = ds["save_s"] + ds["convert_s"] + ds["relaunch_s"]
    bound_s = rec["bytes_moved"] / (link["link_gbps"] * 1e9)
    return {
        "transition": f"{n}->{m}",
        "params": ours["params"],
        "train_batch_size": batch,
        "ours_s": ours_s,
        **split,
        "first_step_excess_s": excess,
        "resize_seconds": rec["seconds"],
        "bytes_moved": rec["bytes_moved"],
        "bytes_kept": rec.get("bytes_kept"),
        "transfer_gbps": rec["bytes_moved"] / rec["transfer_s"] / 1e9 if rec["transfer_s"] > 0 else None,
        "old_iter_s": ours["old_iter_s"],
        "new_iter_s": ours["new_iter_s"],
        "deepspeed_route_s": route,
        **{k: v for k, v in ds.items() if k != "params"},
        "ratio": route / ours_s if ours_s > 0 else None,
        "link_gbps": link["link_gbps"],
        "link_gbps_before_after": [before["link_gbps"], after["link_gbps"]],
        "bound_s": bound_s,
        "transfer_vs_bound": rec["transfer_s"] / bound_s if bound_s > 0 else None,
        "all_vs_bound": all_vs_bound(rec, link["link_gbps"]),
        "peak_extra_bytes": rec.get("peak_extra_bytes"),
        # the issue's memory bound: max(max_inflight_bytes, 1.25 x the largest local partition),
        # a partition being one rank's fp32 master and two Adam moments at the smaller world size
        "peak_bound_bytes": max(256 << 20, int(1.25 * math.ceil(ours["params"] / min(n, m)) * 12)),
        "record": rec,
    }


def all_vs_bound(rec: dict, link_gbps: float) -> Optional[float]:
    """The moments and (a grow) the joiners' working parameters together against the link: the
    longer of the two transfers over the time all their bytes take at ``link_gbps``."""
    nbytes = rec["bytes_moved"] + (rec.get("params_bytes") or 0)
    seconds = max(rec["transfer_s"], rec.get("params_s") or 0.0)
    return seconds / (nbytes / (link_gbps * 1e9)) if nbytes > 0 else None


# ---------------------------------------------------------------------- output
def fmt(v, spec: str, width: int) -> str:
    """``v`` formatted with ``spec`` in ``width`` columns, or a dash when it is None."""
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{spec}}"


def print_table(results: List[dict], a) -> None:
    r0 = results[0]
    print(
        f"model: {r0['params'] / 1e6:.1f} M parameters (hidden {a.hidden}, {a.layers} layers, vocabulary {VOCAB}, "
        f"sequence {a.seq_len}), ZeRO-2 fp32 AdamW, micro-batch 1; resize after step {a.steps_before}; "
        f"link: gloo send/recv of {a.link_mib} MiB before and after each of our jobs, GB/s: "
        + ", ".join(f"{r['transition']} {b:.2f} / {e:.2f}" for r in results for b, e in [r["link_gbps_before_after"]])
    )
    extra = sorted(
        {k for r in results for k in r["record"] if k.endswith("_s") and k != "seconds"}
        - {"plan_s", "group_s", "transfer_s", "rebuild_s"}
    )
    cols = ["plan_s", "group_s", "transfer_s", "rebuild_s", *extra, "first_step_excess_s"]
    short = {"first_step_excess_s": "excess"}
    print("\nours (seconds)")
    head = f"{'transition':<10} {'ours':>8} " + " ".join(f"{short.get(c, c[:-2]):>9}" for c in cols)
    print(
        head + f" {'moved MiB':>10} {'GB/s':>7} {'bound':>8} {'xfer/bound':>10} {'all/bound':>9}"
        f" {'peak+ MiB':>9} {'limit MiB':>9}"
    )
    for r in results:
        peak = r["peak_extra_bytes"] / 2**20 if r["peak_extra_bytes"] is not None else None
        print(
            f"{r['transition']:<10} {r['ours_s']:>8.3f} "
            + " ".join(fmt(r.get(c), ".3f", 9) for c in cols)
            + f" {r['bytes_moved'] / 2**20:>10.1f} {fmt(r['transfer_gbps'], '.2f', 7)} {r['bound_s']:>8.3f}"
            f" {fmt(r['transfer_vs_bound'], '.2f', 10)} {fmt(r['all_vs_bound'], '.2f', 9)}"
            f" {fmt(peak, '.1f', 9)} {r['peak_bound_bytes'] / 2**20:>9.0f}"
        )
    print("\nDeepSpeed's route: save_checkpoint -> ds_to_universal -> relaunch with load_universal (seconds)")
    print(
        f"{'transition':<10} {'route':>8} {'save':>8} {'convert':>8} {'relaunch':>9} "
        f"{'(start':>7} {'load':>7} {'step)':>7} {'ckpt MiB':>9} {'iter N':>7} {'iter M':>7} {'ratio':>7}"
    )
    for r in results:
        print(
            f"{r['transition']:<10} {r['deepspeed_route_s']:>8.2f} {r['save_s']:>8.2f} {r['convert_s']:>8.2f} "
            f"{r['relaunch_s']:>9.2f} {r['relaunch_startup_s']:>7.2f} {r['relaunch_load_s']:>7.2f} "
            f"{r['relaunch_first_step_s']:>7.2f} {r['checkpoint_bytes'] / 2**20:>9.0f} "
            f"{fmt(r['old_iter_s'], '.2f', 7)} {fmt(r['new_iter_s'], '.2f', 7)} {fmt(r['ratio'], '.1f', 7)}"
        )
    print(
        "\nratio = DeepSpeed's route / ours; relaunch = start + load + the first step's excess over iter M; "
        "bound = bytes moved / the better link bandwidth of the two (all bytes over one link); "
        "all/bound: with a grow's working parameters to the joiners, sent beside the moments"
    )


BUSY_LOOP = "import torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\nwhile True:\n    a = torch.tanh(a @ a)"


def start_busy(k: int) -> List[subprocess.Popen]:
    """``k`` processes that keep one CPU each busy with matrix products until :func:`stop_busy`
    (the "busy run": the ratio to DeepSpeed's route measured on a machine with other work)."""
    return [
        subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdout=subprocess.DEVNULL, start_new_session=True)
        for _ in range(k)
    ]


def stop_busy(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--params",
        type=parse_count,
        default=parse_count("100M"),
        help="model size to aim at, e.g. 100M or 20M (picks the number of layers)",
    )
    ap.add_argument("--hidden", type=int, default=768, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (overrides --params)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument(
        "--transitions",
        type=parse_transitions,
        default=parse_transitions("2:1,1:2,2:3"),
        help="N:M,... world-size transitions",
    )
    ap.add_argument(
        "--global-batch",
        type=int,
        default=6,
        help="global batch in samples (rounded up to a multiple of both world sizes)",
    )
    ap.add_argument("--steps-before", type=int, default=3, help="optimizer steps on N before the resize (K)")
    ap.add_argument("--steps-after", type=int, default=4, help="optimizer steps on M after the resize")
    ap.add_argument("--link-mib", type=int, default=256, help="message size of the link measurement, MiB")
    ap.add_argument("--convert-workers", type=int, default=2, help="ds_to_universal extract and merge workers")
    ap.add_argument("--timeout", type=float, default=1800.0, help="limit of each job, seconds")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint directory goes")
    ap.add_argument(
        "--busy",
        type=int,
        default=0,
        help="CPU-heavy processes (one-thread matrix products) running beside the whole benchmark: a busy machine",
    )
    ap.add_argument(
        "--joiner-nice", type=int, default=None, help="dynatrain.joiner_nice of our jobs (default: the config's)"
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per transition")
    a = ap.parse_args(argv)
    if a.hidden % 64:
        ap.error("--hidden must be a multiple of 64 (64-wide attention heads)")
    if a.steps_before < 1 or a.steps_after < 2:
        ap.error("--steps-before must be >= 1 and --steps-after >= 2")
    if a.layers is None:
        a.layers = layers_for(a.params, a.hidden)
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="dynatrain-reconfig-", dir=a.dir)
    results = []
    busy = start_busy(a.busy)
    try:
        for n, m in a.transitions:
            r = transition(n, m, a, work)
            r["busy_processes"] = a.busy
            results.append(r)
            if a.json:
                print(json.dumps(r), flush=True)
    except JobFailed as err:
        print(f"benchmarks.reconfig: {err}", file=sys.stderr)
        return 1
    finally:
        stop_busy(busy)
        shutil.rmtree(work, ignore_errors=True)
    if not a.json:
        print_table(results, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
