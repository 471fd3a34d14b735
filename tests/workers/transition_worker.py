"""Test worker for the transition engine alone (no DeepSpeed engine): plain processes, a real
``TCPStore`` and real gloo groups made by :func:`ds_dynatrain.transition.execute.transition_group`.

Mode ``all``: every transition between world sizes 1-4 (12 of them), each run with the default
``max_inflight_bytes``, with a bound of 64 bytes (many chunks), and in the background
(:func:`~ds_dynatrain.transition.execute.start_plan`). Partitions hold, for every parameter element, a
value unique to (parameter, element, state kind); after a transition each process compares its
new partitions with the values the new layout puts there (padding zero). Writes
``<out>/rank<r>.json``.

Mode ``die``: a 3 → 1 transition in which the process of rank ``--victim`` exits in the middle of
its first exchange (INJECTED through the engine's ``fault_hook`` seam); the others record the
error they get and how long it took.

Mode ``spread``: :func:`~ds_dynatrain.transition.spread.post_to_joiners`, then its wait, over a real default gloo
group of the 4 processes, ranks 0 and 2 holding tensors of several shapes and dtypes (an empty one
among them) with values that differ between the two holders, ranks 1 and 3 joining with -1
everywhere; each process records whether every tensor holds what it must (a joiner: tensor ``k``
as holder ``k mod 2`` made it; a holder: its own values, unchanged).

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment (4 processes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ds_dynatrain.errors import TransitionAbortedError  # noqa: E402
from ds_dynatrain.planner import assign_members, plan_transition  # noqa: E402
from ds_dynatrain.transition import execute as transition  # noqa: E402
from ds_dynatrain.transition.buffers import allocate_partitions  # noqa: E402
from ds_dynatrain.vps.layout import ParamMeta, ZeroLayout  # noqa: E402

KINDS = ("exp_avg", "exp_avg_sq")
GROUPS = (
    (
        ParamMeta("embed.weight", (37, 13), "float32"),
        ParamMeta("mix.weight", (7, 13), "float32"),
        ParamMeta("gain", (1,), "float32"),
    ),
    (ParamMeta("head.weight", (37, 7), "float32"), ParamMeta("head.bias", (37,), "float32")),
)
BASE = {m.key: i * 10_000 for i, m in enumerate(m for g in GROUPS for m in g)}


def partitions(layout: ZeroLayout, rank: int):
    """The partitions of ``rank``: element ``e`` of parameter ``key`` holds ``BASE[key] + e + 1``
    (plus 100 000 per state kind); padding holds 0."""
    out = {}
    for g in range(layout.num_groups):
        out[g] = {k: torch.zeros(layout.partition_numel(g)) for k in KINDS}
    for f in layout.fragments(rank):
        ids = torch.arange(f.start, f.start + f.numel, dtype=torch.float32) + BASE[f.key] + 1
        for i, k in enumerate(KINDS):
            out[f.group][k][f.local : f.local + f.numel] = ids + 100_000 * i
    return out


def one(store, case: int, a: int, b: int, me: str, inflight: int, background: bool) -> dict:
    old = ZeroLayout(a, GROUPS, False, False, 2)
    old_members = tuple(f"p{i}" for i in range(a))
    new_members = assign_members(old_members, b, tuple(f"p{i}" for i in range(a, b)))
    plan = plan_transition(old, old.with_world_size(b), old_members, new_members)
    ranks = transition.transition_ranks(plan)
    if me not in ranks:
        return {"case": case, "skipped": True}
    group = transition.transition_group(store, f"test/xfer/{case}", ranks, me, 30)
    sources = partitions(old, old_members.index(me)) if me in old_members else None
    dests = allocate_partitions(plan, me, KINDS, torch.float32) if me in new_members else None
    kw = dict(sources=sources, dests=dests, timeout_s=30, max_inflight_bytes=inflight)
    if background:
        stats = transition.start_plan(plan, me, group, KINDS, **kw).wait(60)
    else:
        stats = transition.execute_plan(plan, me, group, KINDS, **kw)
    ok = True
    if dests is not None:
        want = partitions(plan.new_layout, new_members.index(me))
        ok = all(torch.equal(dests[g][k], want[g][k]) for g in want for k in KINDS)
    return {
        "case": case,
        "transition": f"{a}->{b}",
        "inflight": inflight,
        "background": background,
        "ok": ok,
        "messages": stats.messages,
        "sent": stats.bytes_sent,
        "received": stats.bytes_received,
        "kept": stats.bytes_kept,
        "peak_staging": stats.peak_staging_bytes,
    }


SHAPES = (
    ((37, 13), torch.float32),
    ((5,), torch.int64),
    ((7, 3), torch.bfloat16),
    ((0,), torch.float32),
    ((1,), torch.float32),
)


def holder_values(k: int, holder: int) -> torch.Tensor:
    """Tensor ``k`` as holder rank ``holder`` makes it: distinct per tensor, element and holder."""
    shape, dtype = SHAPES[k]
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float64) + 1000 * k + 100_000 * (holder + 1)).to(dtype).reshape(shape)


def spread(store, rank: int, world: int) -> dict:
    from ds_dynatrain.transition.spread import post_to_joiners

    tdist.init_process_group("gloo", store=tdist.PrefixStore("spread", store), rank=rank, world_size=world)
    holders = [0, 2]
    mine = [
        holder_values(k, rank) if rank in holders else torch.full(shape, -1, dtype=dtype)
        for k, (shape, dtype) in enumerate(SHAPES)
    ]
    nbytes = post_to_joiners(mine, holders).wait()
    want = [holder_values(k, rank if rank in holders else holders[k % 2]) for k in range(len(SHAPES))]
    ok = all(torch.equal(t, w) for t, w in zip(mine, want))
    # the bytes the two joiners received in all, the same on every rank
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in SHAPES]
    ok = ok and nbytes == 2 * sum(sizes)
    tdist.barrier()
    tdist.destroy_process_group()
    return {"ok": ok, "rank": rank}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["all", "die", "spread"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--background", action="store_true", help="mode die: run the transfer in a background thread")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = tdist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timedelta(seconds=60)
    )
    me = f"p{rank}"
    results = []
    if a.mode == "all":
        case = 0
        for x in range(1, 5):
            for y in range(1, 5):
                if x == y:
                    continue
                for inflight, background in ((transition.DEFAULT_MAX_INFLIGHT_BYTES, False), (64, False), (1024, True)):
                    results.append(one(store, case, x, y, me, inflight, background))
                    case += 1
    elif a.mode == "spread":
        results.append(spread(store, rank, world))
    else:
        if rank == a.victim:

            def die(step, chunk):  # INJECTED: this process vanishes mid-transition
                if chunk == 1:
                    os._exit(17)

            transition.fault_hook = die
        t = time.perf_counter()
        try:
            results.append(one(store, 0, 3, 1, me, 64, a.background))
        except TransitionAbortedError as err:
            results.append({"error": str(err), "seconds": time.perf_counter() - t})
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    if rank == 0:  # the store's host outlives its clients
        time.sleep(1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
