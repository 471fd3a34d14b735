"""The policy for failed snapshot writes (``dynatrain.snapshot.on_write_error``), in real jobs of two
ranks with a periodic snapshot every 2 steps.

The fault is INJECTED at the io engine's seams on rank 1 only (tests/workers/write_policy_worker.py
``inject_enospc``): every write of that rank's files of snapshot ``global_step4`` completes with
-ENOSPC, as on a full disk; the snapshots before and after it meet working storage. The oracle
is a run of the same job without the fault, and what the commit protocol promises: a failed
snapshot is the same outcome on every rank, leaves nothing behind, never moves ``latest``.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import WORKERS, launch, read_jsonl

pytestmark = pytest.mark.multiprocess

STEPS = 8
WORKER = os.path.join(WORKERS, "write_policy_worker.py")


def _run(root, name, policy=None, fail_tag=None):
    """Launch the worker as job ``name``; returns ``(job, [result of rank 0, rank 1], metrics, snapshot dir)``."""
    from workers.common import base_config

    out = root / name
    out.mkdir()
    snaps = root / f"{name}_snapshots"
    cfg = base_config(2, metrics_path=str(root / f"{name}_metrics.jsonl"))
    cfg["dynatrain"]["snapshot"] = {"interval_steps": 2, "dir": str(snaps), "keep_last": 10}
    if policy is not None:
        cfg["dynatrain"]["snapshot"]["on_write_error"] = policy
    args = [str(out), "--steps", str(STEPS)] + (["--fail-tag", fail_tag] if fail_tag else [])
    job = launch(root, WORKER, 2, cfg, args, timeout=300, name=name)
    assert job.returncode == 0, job.output[-6000:]
    results = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    return job, results, read_jsonl(str(root / f"{name}_metrics.jsonl")), snaps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job without the fault: the losses every faulty run must reproduce."""
    job, results, metrics, snaps = _run(tmp_path_factory.mktemp("reference"), "reference")
    return job, results, metrics, snaps


def _losses(metrics):
    return [(r["step"], r["loss"]) for r in metrics if r["event"] == "step"]


def _snapshot_records(metrics):
    return [(r["tag"], r["step"], r["ok"], r.get("failed_ranks")) for r in metrics if r["event"] == "snapshot"]


def _entries(snaps):
    """What the snapshot directory holds: tag directories, ``latest``, anything hidden (none may be)."""
    names = sorted(os.listdir(snaps))
    return [n for n in names if n.startswith("global_step")], [n for n in names if n.startswith(".")]


@pytest.mark.timeout(900)
def test_warn_training_goes_on_and_the_next_snapshot_commits(tmp_path, reference):
    # the default policy is "warn": the config names none
    job, results, metrics, snaps = _run(tmp_path, "faulty", fail_tag="global_step4")
    _rjob, ref_results, ref_metrics, _rsnaps = reference

    # training went on, exactly as without the fault
    assert _losses(metrics) == _losses(ref_metrics)
    assert [s for s, _ in _losses(metrics)] == list(range(1, STEPS + 1))

    # every rank saw the same outcomes; `latest` named the previous snapshot when 4 failed, then 6
    want = [
        ("global_step2", True, [], "global_step2"),
        ("global_step4", False, [1], "global_step2"),
        ("global_step6", True, [], "global_step6"),
        ("global_step8", True, [], "global_step8"),
        ("explicit", False, [0, 1], "global_step8"),
    ]
    for r in results:
        assert [(o["tag"], o["ok"], o["ranks"], o["latest"]) for o in r["outcomes"]] == want, r["outcomes"]
    causes = [r["outcomes"][1]["error"] for r in results]
    assert causes[0] == causes[1]
    assert causes[0].startswith("rank 1: ") and "No space left on device (ENOSPC)" in causes[0], causes[0]
    assert "rank 0" not in causes[0]

    # a warning on every rank naming the tag, the rank and the cause
    warnings = [line for line in job.output.splitlines() if "global_step4 was not committed" in line]
    assert len(warnings) == 2, job.output[-6000:]
    for line in warnings:
        assert "rank 1: " in line and "ENOSPC" in line and "'latest' still names 'global_step2'" in line
        assert "training goes on" in line

    # the metrics file records the failed snapshot as failed, and no other as failed
    assert _snapshot_records(metrics) == [
        ("global_step2", 2, True, None),
        ("global_step4", 4, False, [1]),
        ("global_step6", 6, True, None),
        ("global_step8", 8, True, None),
        ("explicit", 8, False, [0, 1]),
    ]
    failed = [r for r in metrics if r["event"] == "snapshot" and r["tag"] == "global_step4"][0]
    assert failed["error"] == causes[0]
    assert all("error" not in r for r in metrics if r["event"] == "snapshot" and r["ok"])
    assert [t for t, _s, ok, _r in _snapshot_records(ref_metrics)] == ["global_step2", "global_step4"] + [
        "global_step6",
        "global_step8",
        "explicit",
    ]

    # nothing of the failed snapshot is left; latest names the last one
    tags, hidden = _entries(snaps)
    assert tags == ["global_step2", "global_step6", "global_step8"] and hidden == []
    assert (snaps / "latest").read_text() == "global_step8"

    # an explicit save into a directory that cannot be created: our error on every rank, no OSError
    for r in results:
        assert r["explicit"].startswith(f"snapshot {tmp_path / 'faulty' / 'a_file' / 'snapshots' / 'explicit'}")
        assert "rank 0: " in r["explicit"] and "rank 1: " in r["explicit"] and "a_file" in r["explicit"]
        assert "'latest' still names None" in r["explicit"]
    assert "Traceback" not in job.output, job.output[-6000:]

    # the final snapshot loads back at its step, bitwise
    for r in results:
        assert r["loaded"].endswith(os.path.join("global_step8", "mp_rank_00_model_states.pt"))
        assert r["loaded_step"] == STEPS and r["state_equal"] is True


@pytest.mark.timeout(900)
def test_raise_every_rank_raises_at_the_next_save_and_the_record_says_failed(tmp_path, reference):
    job, results, metrics, snaps = _run(tmp_path, "raising", policy="raise", fail_tag="global_step4")
    _rjob, _ref_results, ref_metrics, _rsnaps = reference

    # the save after the failed snapshot (step 6) raised on every rank, the same error
    assert [r["raised_at"] for r in results] == [6, 6]
    err = results[0]["raised"]
    assert results[1]["raised"] == err
    assert "global_step4 was not committed" in err and "rank 1: " in err and "ENOSPC" in err
    assert "rank 0" not in err and "'latest' still names 'global_step2'" in err

    # until then it trained as without the fault; the record says the snapshot failed
    assert _losses(metrics) == _losses(ref_metrics)[:6]
    assert _snapshot_records(metrics) == [("global_step2", 2, True, None), ("global_step4", 4, False, [1])]
    tags, hidden = _entries(snaps)
    assert tags == ["global_step2"] and hidden == []
    assert (snaps / "latest").read_text() == "global_step2"


# ------------------------------------------------- the snapshot engine alone (one process, real store)


def _engine(store, policy, asynchronous=True):
    from ds_dynatrain.checkpoint.snapshot import SnapshotCheckpointEngine

    ce = SnapshotCheckpointEngine(
        store_address=("127.0.0.1", store.port),
        timeout_s=30,
        cache_bytes=16 << 20,
        asynchronous=asynchronous,
        on_write_error=policy,
    )
    seen = []
    ce.on_outcome = seen.append
    return ce, seen


def _save(ce, d, tag):
    import torch
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    info = CheckpointCommitInfo(tag=tag, save_dir=str(d), save_latest=True)
    ce.makedirs(str(d), exist_ok=True)
    ce.create(info)
    ce.makedirs(os.path.join(d, tag), exist_ok=True)
    ce.save({"w": torch.arange(5000, dtype=torch.float32), "global_steps": int(tag[-1])}, os.path.join(d, tag, "s.pt"))
    ce.commit(info)


@pytest.fixture
def store():
    import torch.distributed as tdist

    yield tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_engine_warn_goes_on_and_retries(store, tmp_path, asynchronous):
    from workers.write_policy_worker import inject_enospc

    from io_engine import read_latest

    ce, seen = _engine(store, "warn", asynchronous)
    _save(ce, tmp_path, "global_step1")
    ce.wait()  # its writer is idle before the fault is put in
    inject_enospc(ce, "global_step2")  # INJECTED: every write of snapshot global_step2 fails with ENOSPC
    _save(ce, tmp_path, "global_step2")
    _save(ce, tmp_path, "global_step3")  # no exception: the failure of 2 is a warning
    ce.wait()
    assert [(o.tag, o.ok, o.step, o.failed_ranks) for o in seen] == [
        ("global_step1", True, 1, ()),
        ("global_step2", False, 2, (0,)),
        ("global_step3", True, 3, ()),
    ]
    assert "No space left on device (ENOSPC)" in seen[1].error and seen[1].error.startswith("rank 0: ")
    assert read_latest(str(tmp_path)) == "global_step3"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["global_step1", "global_step3", "latest"]
    ce.close()


def test_engine_raise_raises_at_the_next_save_and_wait_always_raises(store, tmp_path):
    from workers.write_policy_worker import inject_enospc

    from ds_dynatrain.errors import ConfigError, SnapshotWriteError
    from io_engine import read_latest

    ce, seen = _engine(store, "raise")
    _save(ce, tmp_path, "global_step1")
    ce.wait()  # its writer is idle before the fault is put in
    inject_enospc(ce, "global_step2")  # INJECTED: every write of snapshot global_step2 fails with ENOSPC
    _save(ce, tmp_path, "global_step2")
    with pytest.raises(SnapshotWriteError, match=r"global_step2 was not committed, .*ENOSPC.*'global_step1'"):
        _save(ce, tmp_path, "global_step3")
    assert [(o.tag, o.ok) for o in seen] == [("global_step1", True), ("global_step2", False)]
    assert read_latest(str(tmp_path)) == "global_step1"
    ce.close()
    # under "warn" too, the explicit question raises
    ce, seen = _engine(store, "warn")
    inject_enospc(ce, "global_step4")  # INJECTED
    _save(ce, tmp_path, "global_step4")
    with pytest.raises(SnapshotWriteError, match="global_step4 was not committed"):
        ce.wait()
    ce.close()
    with pytest.raises(ConfigError, match="on_write_error must be 'warn' or 'raise', got 'ignore'"):
        _engine(store, "ignore")


def test_engine_an_unusable_directory_is_a_failed_snapshot_not_an_oserror(store, tmp_path):
    from ds_dynatrain.errors import SnapshotWriteError

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    ce, seen = _engine(store, "warn")
    _save(ce, blocker / "snapshots", "global_step1")  # makedirs, create, save, commit: none raises
    with pytest.raises(SnapshotWriteError) as e:
        ce.wait()
    assert "global_step1 was not committed" in str(e.value) and "cannot create the directory (ENOTDIR" in str(e.value)
    assert [(o.tag, o.ok, o.failed_ranks) for o in seen] == [("global_step1", False, (0,))]
    _save(ce, tmp_path / "good", "global_step2")  # the engine goes on with a usable directory
    ce.wait()
    assert seen[-1].ok and (tmp_path / "good" / "latest").read_text() == "global_step2"
    ce.close()
