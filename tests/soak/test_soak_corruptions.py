"""Soak part 3: generated corruptions of a real snapshot (``SOAK_CORRUPTIONS``, default 10,000).

The snapshot: TinyLM after 3 steps at ZeRO-2 on 2 ranks, saved through the plugin's snapshot
engine by a real DeepSpeed job (``tests/workers/soak_fuzz_worker.py save``, once per run), with a
client state of tensors over and under 64 KiB. Each corruption (``tests/workers/soak_corrupt.py``:
bit flips anywhere, random bursts, zeroed blocks, payload and padding flips, header, trailer and
footer damage, truncations, extensions, a wrong recorded size, one wrong value in the footer JSON
re-encoded with a valid CRC, missing, empty, swapped and duplicated files, a bad ``latest``) is
applied to a working copy and put to ``verify``, ``export``, ``inspect`` and a resharded
``load_checkpoint`` into a 1-rank engine (two such workers, half of the corruptions each).

Oracle: every reader refuses every corruption with an exception of ours (``DynatrainError``: a
report that is not ok, for ``verify``), a refused load leaves the engine's state as it was, a
refused export leaves no file; no other exception type, no hang; the pristine copy is accepted
by all four before and after (the load bitwise equal to the state and client state the saving job
had); no reader call leaves a file descriptor open. A corruption that changes no byte is drawn
again, not counted.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import time

import pytest
import soaklib
from conftest import free_port

COUNT = soaklib.count("SOAK_CORRUPTIONS", 10_000)
TOOLS = ("verify", "export", "inspect", "load")
SHARDS = 2  # at most two processes on this 2-core machine
CHUNK = 1000  # trials per round of processes
pytestmark = pytest.mark.soak

WORKER = os.path.join(soaklib.WORKERS, "soak_fuzz_worker.py")


def _plain(rank: int, world: int, port: int) -> dict:
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _run_all(procs, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            p.stop()


def _save(tmp_path) -> str:
    out = tmp_path / "saved"
    out.mkdir()
    port = free_port()
    procs = [
        soaklib.Proc(
            [sys.executable, WORKER, "save", "--work", str(out)],
            str(tmp_path / f"save{r}.log"),
            extra_env=_plain(r, 2, port),
        )
        for r in range(2)
    ]
    rcs = _run_all(procs, 300)
    assert rcs == [0, 0], (rcs, procs[0].output()[-3000:])
    return str(out)


def _fuzz(tmp_path, saved: str) -> list:
    """Every trial, in rounds of :data:`CHUNK` over :data:`SHARDS` processes (a fresh engine each
    round: a reader that leaks file descriptors would otherwise exhaust a long-lived process's
    limit; the leak is counted, not hidden)."""
    for shard in range(SHARDS):
        (tmp_path / f"work{shard}").mkdir()
    for first in range(0, COUNT, CHUNK):
        procs = []
        for shard in range(SHARDS):
            work = tmp_path / f"work{shard}"
            shutil.rmtree(work / "ckpt", ignore_errors=True)
            cmd = [sys.executable, WORKER, "fuzz", "--snapshot", os.path.join(saved, "snapshot")]
            cmd += ["--state", os.path.join(saved, "state.pt"), "--work", str(work), "--out", str(work / "res.jsonl")]
            cmd += ["--seed", str(soaklib.seed()), "--first", str(first), "--count", str(min(COUNT, first + CHUNK))]
            cmd += ["--shard", str(shard), "--shards", str(SHARDS)]
            log = str(tmp_path / f"fuzz{shard}_{first}.log")
            procs.append(soaklib.Proc(cmd, log, extra_env=_plain(0, 1, free_port())))
        rcs = _run_all(procs, 120 + 0.2 * CHUNK)
        for shard, (p, rc) in enumerate(zip(procs, rcs)):
            recs = soaklib.read_jsonl(str(tmp_path / f"work{shard}" / "res.jsonl"))
            hung = any(r["outcome"] == "hang" for rec in recs for r in rec["tools"].values())
            assert rc == 0 or (rc == 3 and hung), (shard, first, rc, p.output()[-3000:])
            if hung:
                break
    records = []
    for shard in range(SHARDS):
        records += soaklib.read_jsonl(str(tmp_path / f"work{shard}" / "res.jsonl"))
    return sorted(records, key=lambda r: r["i"])


def _cell(c: collections.Counter) -> str:
    return f"{c['refused']}/{c['accepted']}/{c['foreign'] + c['hang']}"


def _report(records: list, seconds: float):
    per_kind = collections.defaultdict(lambda: {t: collections.Counter() for t in TOOLS})
    per_class = {t: collections.Counter() for t in TOOLS}
    findings = collections.defaultdict(list)  # (kind, sub, tool, outcome) -> examples
    leaks = {t: collections.Counter() for t in TOOLS}  # outcome -> descriptors left open
    for rec in records:
        for tool, r in rec["tools"].items():
            leaks[tool][r["outcome"]] += r.get("fds", 0)
            per_kind[rec["kind"]][tool][r["outcome"]] += 1
            per_kind["all"][tool][r["outcome"]] += 1
            per_class[tool][r["cls"] or r["outcome"]] += 1
            if r["outcome"] != "refused":
                what = (
                    r["outcome"]
                    if r["outcome"] != "accepted"
                    else f"accepted ({'same' if r.get('same') else 'different'} result)"
                )
                findings[(rec["kind"], rec["sub"], tool, what, r["cls"])].append(
                    f"{rec['target']}: {rec['detail']} {r['msg']}"
                )
    kinds = sorted(k for k in per_kind if k != "all") + ["all"]
    rows = [[k, sum(per_kind[k]["verify"].values())] + [_cell(per_kind[k][t]) for t in TOOLS] for k in kinds]
    lines = [
        f"{len(records)} corruptions of a 2-rank ZeRO-2 snapshot (seed {soaklib.seed()}), {seconds:.0f} s",
        "each cell: refused / accepted / other exception or hang",
        soaklib.table(["kind", "n"] + list(TOOLS), rows),
        "refusals by class: " + "; ".join(f"{t}: {dict(per_class[t])}" for t in TOOLS),
        "file descriptors left open by the readers (net, by outcome): "
        + "; ".join(f"{t}: {dict(+leaks[t]) or 0}" for t in TOOLS),
    ]
    if findings:
        lines.append("not refused, by kind / sub-kind / reader (count, first example):")
        for (kind, sub, tool, what, cls), ex in sorted(findings.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  {kind} / {sub} / {tool}: {what} {cls} x{len(ex)}: {ex[0][:240]}")
    figures = {
        "corruptions": len(records),
        "seed": soaklib.seed(),
        "seconds": seconds,
        "per_kind": {k: {t: dict(per_kind[k][t]) for t in TOOLS} for k in kinds},
        "refusals_by_class": {t: dict(per_class[t]) for t in TOOLS},
        "fds_left_open": {t: dict(leaks[t]) for t in TOOLS},
        "not_refused": [
            {"kind": k, "sub": s, "tool": t, "outcome": w, "class": c, "count": len(ex), "examples": ex[:3]}
            for (k, s, t, w, c), ex in sorted(findings.items())
        ],
    }
    return figures, "\n".join(lines), per_kind["all"], leaks


@pytest.mark.timeout(600 + int(0.25 * COUNT))
def test_every_reader_refuses_every_corruption(tmp_path):
    t0 = time.monotonic()
    saved = _save(tmp_path)
    records = _fuzz(tmp_path, saved)
    figures, text, total, leaks = _report(records, time.monotonic() - t0)
    soaklib.write_figures("corruptions", figures, text)
    assert [r["i"] for r in records] == list(range(COUNT)), "some trials did not run"
    assert {t: dict(total[t]) for t in TOOLS} == {t: {"refused": COUNT} for t in TOOLS}
    assert all(sum(leaks[t].values()) <= 0 for t in TOOLS), {t: dict(leaks[t]) for t in TOOLS}
