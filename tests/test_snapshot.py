"""Snapshots through the plugin's DeepSpeed checkpoint engine: atomic commit, a write error on one
rank becomes the same error on every rank with ``latest`` unmoved, and a committed snapshot loads
back bitwise (with ``torch.load(weights_only=True)``: loading executes no code from the file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, WORKERS, launch

pytestmark = pytest.mark.multiprocess


def test_write_error_keeps_previous_snapshot_loadable(tmp_path):
    from workers.common import base_config

    job = launch(
        tmp_path,
        os.path.join(WORKERS, "snapshot_worker.py"),
        2,
        base_config(2),
        [str(tmp_path)],
        timeout=180,
        name="snapshot",
    )
    assert job.returncode == 0, job.output[-5000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["errors_all_ranks"][0] and r["errors_all_ranks"][1], r
    assert r["errors_all_ranks"][0] == r["errors_all_ranks"][1]
    err = r["errors_all_ranks"][0]
    assert "global_step4 was not committed" in err and "rank 1:" in err and "No space left on device" in err
    assert "rank 0:" not in err and "'latest' still names 'global_step2'" in err
    assert r["latest_after_failure"] == "global_step2"
    assert [d for d in r["dirs_after_failure"] if d.startswith((".tmp", "global"))] == ["global_step2"]
    assert r["state_equal"] is True
    assert r["steps"][0] == r["steps"][1]
    assert r["steps"][2] == 2
    # the footers carry the VPS fragments of every ZeRO partition (what another layout reads by)
    import torch
    from workers.common import TinyLM

    from ds_dynatrain.zero.geometry import layout_for_model
    from io_engine import read_footer

    model = TinyLM()
    layout = layout_for_model(
        list(model.named_parameters()), [list(model.parameters())], 2, base_config(2), torch.float32
    )
    for rank in (0, 1):
        footer = read_footer(
            str(tmp_path / "snapshots" / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        )
        vps = {m.attrs["vps"]["kind"]: m.attrs["vps"] for m in footer.items if "vps" in m.attrs}
        assert set(vps) == {"fp32", "exp_avg", "exp_avg_sq"}
        expected = [[f.key, f.start, f.numel, f.local] for f in layout.fragments(rank)]
        for v in vps.values():
            assert v["fragments"] == expected and v["rank"] == rank and v["world_size"] == 2


@pytest.mark.parametrize(
    "section, zero, fp16, message",
    [
        ({"snapshot": {"intervall_steps": 5}}, 2, False, "dynatrain.snapshot.intervall_steps: unknown key"),
        ({"resize_schedule": [{"step": 3, "world_size": 0}]}, 2, False, "dynatrain.resize_schedule.0.world_size"),
        (
            {"resize_schedule": [{"step": 3, "world_size": 3}]},
            2,
            False,
            "resize_schedule (step 3): world size 3 refused: the global batch train_batch_size=4 is not divisible",
        ),
        (
            {"resize_schedule": [{"step": 3, "world_size": 4}], "max_world_size": 2},
            2,
            False,
            "world size 4 refused: above max_world_size=2",
        ),
        (
            {"resize_schedule": [{"step": 3, "world_size": 1}]},
            0,
            False,
            "needs zero_optimization.stage 1, 2 or 3 (stage 0 has no partitions to resize)",
        ),
        (
            {"resize_schedule": [{"step": 3, "world_size": 1}, {"step": 3, "world_size": 2}]},
            3,
            True,
            "resize_schedule steps must increase strictly; got 3 then 3",
        ),
    ],
)
def test_bad_config_refused_before_any_process_starts(tmp_path, section, zero, fp16, message):
    cfg = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": zero},
        "dynatrain": section,
    }
    if fp16:
        cfg["fp16"] = {"enabled": True}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    marker = tmp_path / "started"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    p = subprocess.run(
        [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--config", str(path), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert not marker.exists()


def test_prune_keeps_user_tags_and_temporary_directories(tmp_path):
    from ds_dynatrain.checkpoint.snapshot import PRUNABLE_TAG
    from io_engine import prune_snapshots

    for d in ["best", "global_step10", "global_step20", "global_step30", ".tmp-global_step40-g0s3"]:
        (tmp_path / d).mkdir()
    deleted = prune_snapshots(str(tmp_path), 2, protect=["global_step30"], pattern=PRUNABLE_TAG)
    assert deleted == ["global_step10"]
    assert sorted(x.name for x in tmp_path.iterdir()) == [
        ".tmp-global_step40-g0s3",
        "best",
        "global_step20",
        "global_step30",
    ]


def test_stale_temporary_directory_is_never_published(tmp_path):
    """A temporary directory left by a crashed save (same tag) must not leak into a snapshot."""
    from workers.common import base_config

    stale = tmp_path / "snapshots" / ".tmp-global_step2"
    stale.mkdir(parents=True)
    (stale / "zero_pp_rank_5_mp_rank_00_optim_states.pt").write_bytes(b"stale")
    job = launch(
        tmp_path,
        os.path.join(WORKERS, "snapshot_worker.py"),
        2,
        base_config(2),
        [str(tmp_path)],
        timeout=180,
        name="snapshot",
    )
    assert job.returncode == 0, job.output[-5000:]
    published = sorted(x.name for x in (tmp_path / "snapshots" / "global_step2").iterdir())
    assert "zero_pp_rank_5_mp_rank_00_optim_states.pt" not in published
    assert published == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]


def test_prune_renames_before_it_deletes_and_leftovers_of_killed_writes_are_removed(tmp_path, monkeypatch):
    """A prune killed half-way (here: ``rmtree`` stopped after the rename, a seam for the SIGKILL)
    leaves a hidden directory, never a visible snapshot with files missing; ``remove_stale`` then
    deletes it with the other leftovers (an unpublished snapshot, a temporary ``latest``) and
    nothing else."""
    import shutil

    from ds_dynatrain.checkpoint.snapshot import PRUNABLE_TAG
    from io_engine import commit, prune_snapshots, remove_stale

    for d in ["best", "global_step10", "global_step20", "global_step30", ".tmp-global_step40-g0s3"]:
        (tmp_path / d).mkdir()
        (tmp_path / d / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / ".tmp-latest.123").write_text("global_step30")
    (tmp_path / "latest").write_text("global_step30")
    rmtree = shutil.rmtree
    monkeypatch.setattr(commit.shutil, "rmtree", lambda *a, **k: None)  # killed before deleting
    assert prune_snapshots(str(tmp_path), 2, pattern=PRUNABLE_TAG) == ["global_step10"]
    monkeypatch.setattr(commit.shutil, "rmtree", rmtree)
    visible = sorted(x.name for x in tmp_path.iterdir() if not x.name.startswith("."))
    assert visible == ["best", "global_step20", "global_step30", "latest"]
    removed = remove_stale(str(tmp_path))
    assert sorted(removed) == sorted(
        [".tmp-global_step40-g0s3", ".tmp-latest.123", f".tmp-pruned-global_step10.{os.getpid()}"]
    )
    assert sorted(x.name for x in tmp_path.iterdir()) == ["best", "global_step20", "global_step30", "latest"]
