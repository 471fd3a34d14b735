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
    job = launch(tmp_path, os.path.join(WORKERS, "snapshot_worker.py"), 2, base_config(2), [str(tmp_path)],
                 timeout=180, name="snapshot")
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


def test_unknown_config_key_refused_before_any_process_starts(tmp_path):
    cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
           "dynatrain": {"snapshot": {"intervall_steps": 5}}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    marker = tmp_path / "started"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    p = subprocess.run([sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--config", str(path),
                        str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2
    assert "dynatrain.snapshot.intervall_steps: unknown key" in p.stderr
    assert not marker.exists()
