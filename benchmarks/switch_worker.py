"""What the workers of ``benchmarks.tp_reconfig`` and ``benchmarks.pp_reconfig`` share: our switch
measured in one job (iterations, record, memory), and the two halves of DeepSpeed's route (save;
relaunch and load). ``train(engine, step) -> (seconds, loss)`` runs one optimizer step on the
batch of ``step``; times in seconds, sizes in bytes."""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from typing import Callable, Dict, Sequence

from benchmarks.reconfig_worker import dir_bytes, write_json

PREPARE_AHEAD = 2  # steps: dynatrain.warm_switch_steps' default


def status_bytes(key: str) -> int:
    """A size of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), bytes."""
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def state_bytes(engine) -> int:
    """This rank's ZeRO-1/2 partition of the fp32 master and both Adam moments, bytes."""
    return 3 * sum(p.numel() * p.element_size() for p in engine.optimizer.single_partition_of_fp32_groups)


def measure_switch(engine, a, params: int, train_before, train_after, switch, prepare=None) -> None:
    """``--steps-before`` steps, ``switch()`` (the resize, returning its record), ``--steps-after``
    steps; with ``prepare`` (``engine.prepare_resize`` of the switch), it is called
    :data:`PREPARE_AHEAD` steps before the switch (as a scheduled switch is prepared by default),
    so that its background touching runs beside those steps. Rank 0
    writes ``a.out``: the record, every iteration, ``first_step_excess_s`` (the first iteration
    after minus the median of the later ones, at least 0), and per rank the resident set before
    and after the switch, its peak during it (``VmHWM`` after writing 5 to
    ``/proc/self/clear_refs``), the memory held for it (``prepared_bytes``, part of the resident
    set before) and :func:`state_bytes` before and after. Collective."""
    import torch.distributed as tdist

    before, prepare_call_s = [], 0.0
    for s in range(a.steps_before):
        if prepare is not None and s == max(0, a.steps_before - PREPARE_AHEAD):
            t0 = time.perf_counter()
            prepare()
            prepare_call_s = time.perf_counter() - t0  # on the training thread: the layout computed
        before.append(train_before(engine, s))
    state_before = state_bytes(engine)
    tdist.barrier()
    rss_before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
        f.write("5")
    record = switch()
    hwm, rss_after = status_bytes("VmHWM"), status_bytes("VmRSS")
    state_after = state_bytes(engine)
    after = [train_after(engine, s) for s in range(a.steps_before, a.steps_before + a.steps_after)]
    mem = {
        "rank": tdist.get_rank(),
        "rss_before": rss_before,
        "rss_after": rss_after,
        "hwm": hwm,
        "state_bytes_before": state_before,
        "state_bytes_after": state_after,
        "prepared_bytes": (record or {}).get("prepared_bytes") or 0,
        "prepared_touch_s": (record or {}).get("prepared_touch_s") or 0.0,
    }
    ranks = [None] * tdist.get_world_size()
    tdist.all_gather_object(ranks, mem)
    if tdist.get_rank() == 0:
        rest = statistics.median(t for t, _ in after[1:])
        write_json(
            a.out,
            {
                "mode": "ours",
                "params": params,
                "record": record,
                "old_iter_s": statistics.median(t for t, _ in before[1:]) if len(before) > 1 else None,
                "prepare_call_s": prepare_call_s,
                "new_iter_s": rest,
                "first_step_excess_s": max(0.0, after[0][0] - rest),
                "iterations_before": before,
                "iterations_after": after,
                "ranks": ranks,
            },
        )
    tdist.barrier()
    tdist.destroy_process_group()


def save_route(engine, a, train, extra: dict) -> None:
    """The route's first half: ``--steps`` steps, ``save_checkpoint`` to ``--dir``/``--tag``
    (``save_s`` barrier to barrier); rank 0 writes ``a.out`` (with ``extra``). Collective."""
    import torch.distributed as tdist

    iters = [train(engine, s) for s in range(a.steps)]
    tdist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(a.dir, tag=a.tag)
    tdist.barrier()
    save_s = time.perf_counter() - t0
    if engine.global_rank == 0:
        out = {"mode": "ds-save", "save_s": save_s, "checkpoint_bytes": dir_bytes(os.path.join(a.dir, a.tag))}
        write_json(a.out, {**out, "iterations": iters, "global_steps": engine.global_steps, **extra})
    tdist.destroy_process_group()


def load_route(engine, a, train) -> None:
    """The route's second half (or our load): ``load_checkpoint`` of ``--dir``/``--tag``, then
    ``--steps`` steps from ``--first-step``; rank 0 writes ``a.out``: wall-clock timestamps
    (``time.time()``) of the end of start-up, of the load and of the first step, and the
    iterations. Collective."""
    import torch.distributed as tdist

    t_init = time.time()
    path, _client = engine.load_checkpoint(a.dir, tag=a.tag)
    if path is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint {a.tag!r} in {a.dir}")
    t_load = time.time()
    iters = []
    for s in range(a.first_step, a.first_step + a.steps):
        iters.append(train(engine, s))
        if len(iters) == 1:
            t_first = time.time()
    if engine.global_rank == 0:
        write_json(
            a.out,
            {
                "mode": a.mode,
                "t_init": t_init,
                "t_load": t_load,
                "t_first_step": t_first,
                "iterations": iters,
                "global_steps": engine.global_steps,
            },
        )
    tdist.destroy_process_group()


def parse_worker_args(flag: str, label: str, layers: int, model_args: Sequence[tuple] = ()) -> argparse.Namespace:
    """The command line of a switch worker: ``--mode`` (``ours``, ``ds-save``, ``ds-load``,
    ``ours-load``), the model's size, ``--<flag>-from``/``--<flag>-to`` (degrees of ``label``), the
    step counts of each mode, the checkpoint and the result file. ``model_args``: further
    ``(name, type, default)`` options of the model placed after ``--layers``."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ours", "ds-save", "ds-load", "ours-load"], required=True)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=layers)
    for name, kind, default in model_args:
        p.add_argument(name, type=kind, default=default)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument(f"--{flag}-from", type=int, default=1)
    p.add_argument(f"--{flag}-to", type=int, default=1)
    p.add_argument("--steps-before", type=int, default=3, help=f"ours: steps at the old {label}")
    p.add_argument("--steps-after", type=int, default=4, help=f"ours: steps at the new {label}")
    p.add_argument(
        "--prepare", action="store_true", help="ours: engine.prepare_resize before the last two steps before the switch"
    )
    p.add_argument("--steps", type=int, default=1, help="ds-*: steps to run")
    p.add_argument("--first-step", type=int, default=0, help="ds-load: the step index of its first batch")
    p.add_argument("--dir", help="checkpoint directory (ds-save, ds-load)")
    p.add_argument("--tag", help="checkpoint tag (ds-save, ds-load)")
    p.add_argument("--out", required=True)
    return p.parse_args()


def run_mode_and_exit(a: argparse.Namespace, modes: Dict[str, Callable[[argparse.Namespace], None]]) -> None:
    """Run ``modes[a.mode](a)`` with DeepSpeed's logger at WARNING, then end the process at once
    (``os._exit(0)``): the results are written and the groups destroyed, and no interpreter
    teardown runs (a stray gloo thread can abort it)."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    modes[a.mode](a)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
