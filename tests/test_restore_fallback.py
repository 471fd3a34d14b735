"""A restore whose newest snapshot is damaged falls back to the previous complete one and says so.

A real 2-rank job (TinyLM, ZeRO-2) takes snapshots at steps 2, 4 and 6; one bit of an fp32-master
element of step 6's rank-1 file is then flipped (storage failing after the commit). A second job is
started the way the launcher restarts a job after a worker died (``DYNATRAIN_RESTORE`` names the
snapshot directory: the seam this test enters by), at 2 ranks (DeepSpeed's own load of our files)
and at 1 rank (the resharded load, which reads byte ranges). Oracles: the first job's losses after
step 4 (the restored job must repeat them: bitwise at 2 ranks, within reduction noise at 1), and
the restore record and log naming the snapshot skipped.
"""

from __future__ import annotations

import os

import pytest
from conftest import WORKERS, launch, read_jsonl

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(WORKERS, "elastic_worker.py")


def _config(metrics: str, snaps) -> dict:
    from workers.common import base_config

    cfg = base_config(2, metrics)
    cfg["dynatrain"]["snapshot"] = {"interval_steps": 2, "dir": str(snaps), "keep_last": 10}
    return cfg


def _flip_master_bit(path) -> None:
    from io_engine import read_footer

    item = next(it for it in read_footer(str(path)).items if (it.attrs.get("vps") or {}).get("kind") == "fp32")
    with open(path, "r+b") as f:
        f.seek(item.offset + 4 * 5 + 3)
        b = f.read(1)
        f.seek(item.offset + 4 * 5 + 3)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """The first job's directory: its losses and a snapshot directory whose latest is damaged."""
    d = tmp_path_factory.mktemp("first")
    snaps = d / "snaps"
    job = launch(d, SCRIPT, 2, _config(str(d / "first.jsonl"), snaps), ["--out", str(d), "--steps", "6"], 200, "first")
    assert job.returncode == 0, job.output[-3000:]
    assert (snaps / "latest").read_text() == "global_step6"
    _flip_master_bit(snaps / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    losses = {r["step"]: r["loss"] for r in read_jsonl(d / "first.jsonl") if r["event"] == "step"}
    return snaps, losses


@pytest.mark.timeout(400)
@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), 1])
def test_a_damaged_latest_snapshot_falls_back_to_the_previous_one(damaged, tmp_path, monkeypatch, nproc):
    snaps, first = damaged
    monkeypatch.setenv("DYNATRAIN_RESTORE", str(snaps))  # what the launcher sets on a restart
    cfg = _config(str(tmp_path / "again.jsonl"), tmp_path / "snaps_again")
    job = launch(tmp_path, SCRIPT, nproc, cfg, ["--out", str(tmp_path), "--steps", "8"], 300, "again")
    assert job.returncode == 0, job.output[-4000:]
    out = job.output
    assert "restore: snapshot global_step6 of" in out and "is damaged, trying an older one" in out
    assert "checksum mismatch for item" in out and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in out
    assert "(skipped as damaged: global_step6)" in out
    recs = read_jsonl(tmp_path / "again.jsonl")
    (rec,) = [r for r in recs if r["event"] == "restore"]
    assert rec["step"] == 4 and rec["skipped"] == ["global_step6"] and rec["world_size"] == nproc
    after = {r["step"]: r["loss"] for r in recs if r["event"] == "step"}
    assert sorted(after) == [5, 6, 7, 8]
    for step in (5, 6):
        if nproc == 2:
            assert after[step] == first[step], step  # the same state and data order: bitwise
        else:
            assert abs(after[step] - first[step]) <= 1e-5 * abs(first[step]), (step, after[step], first[step])
