"""``python -m benchmarks.gpu_check`` (``make gpu-check``) on a machine without a GPU: the skip path,
and, marked slow, the same steps on the CPU (``--device cpu``) end to end.

Oracles: torch's own answer to "is there a usable GPU" (``torch.version.cuda``,
``torch.cuda.is_available``) for the skip line; for the CPU flow, the states the jobs gathered,
compared here with ``torch.equal`` (not through the script's comparison), the resize records and the
snapshot directory's files; the installed distributions' metadata for ``--pins``.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata

import pytest
import torch
from conftest import _env, _run

pytestmark = pytest.mark.multiprocess


def _check(tmp_path, *args, timeout=180):
    env = _env()
    env.pop("DS_ACCELERATOR", None)  # the script sets it for its jobs
    return _run([sys.executable, "-m", "benchmarks.gpu_check", *args], str(tmp_path / "check.log"), timeout, env)


def test_skips_without_a_gpu_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check runs instead of skipping")
    job = _check(tmp_path, "--dir", str(tmp_path / "work"))
    assert job.returncode == 0, job.output
    lines = job.output.splitlines()
    assert len(lines) == 1, job.output
    why = "is a build without CUDA" if torch.version.cuda is None else "sees no GPU"
    assert lines[0].startswith("gpu-check: skipped: torch ") and why in lines[0], lines[0]
    assert not (tmp_path / "work").exists()  # nothing ran


def test_pins_name_the_installed_versions(tmp_path):
    from benchmarks.gpu_check import WHEELS

    for kind, dists in WHEELS.items():
        job = _check(tmp_path, "--pins", kind, timeout=120)
        assert job.returncode == 0, job.output
        assert job.output.split() == [f"{d}=={metadata.version(d)}" for d in dists]


def _states_equal(a: dict, b: dict) -> bool:
    tensors = [k for k in a if not k.startswith("__")]
    return set(a) == set(b) and all(
        torch.equal(a[k][kind], b[k][kind]) for k in tensors for kind in ("fp32", "exp_avg", "exp_avg_sq", "param")
    )


@pytest.mark.slow  # three multi-process jobs (about 3 minutes here); the resize and snapshot paths have faster tests
def test_cpu_flow_end_to_end(tmp_path):
    work = tmp_path / "work"
    job = _check(tmp_path, "--device", "cpu", "--dir", str(work), "--timeout", "420", timeout=480)
    lines = job.output.splitlines()
    assert len(lines) == 1, job.output[-3000:]
    fig = json.loads(lines[0])
    assert job.returncode == 0 and fig["ok"] is True, fig
    r, s, rl = fig["resize"], fig["snapshot"], fig["reload"]
    assert [(t["from"], t["to"], t["step"]) for t in r["transitions"]] == [(2, 1, 2), (1, 2, 4)]
    assert r["bitwise_across_resizes"] and r["bitwise_with_static_before_resize"] and r["losses_follow_static"]
    assert r["bitwise_with_static_at_end"] and r["final_fp32_max_abs_diff"] == 0.0
    load = lambda name: torch.load(work / name, weights_only=True)  # noqa: E731
    for step in (2, 4):
        assert _states_equal(load(f"resize/before_{step}.pt"), load(f"resize/after_{step}.pt")), step
    assert _states_equal(load("resize/before_2.pt"), load("static/at_2.pt"))
    assert _states_equal(load("resize/final.pt"), load("static/final.pt"))
    for fig_s, step in ((s, 3), (s["again"], 5)):
        snap_dir = work / "static" / "snapshots" / f"global_step{step}"
        on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(snap_dir) for f in fs)
        assert fig_s["committed"] and fig_s["bytes"] == on_disk > 0
        assert fig_s["stall_s"] >= fig_s["save_s"] > 0 and fig_s["capture_gbps"] > 0
    assert s["pinned_gbps"] is None and s["again"]["step"] == 5
    assert s["device"] == "cpu" and s["backend"] == "gloo"
    assert rl["backend"] == "gloo" and rl["bitwise"] and rl["state_moved_before_load"]
    assert _states_equal(load("reload/saved.pt"), load("reload/loaded.pt"))
    assert not _states_equal(load("reload/saved.pt"), load("reload/moved.pt"))
    assert fig["seconds"] < 420
