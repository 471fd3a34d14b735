"""A script that starts ``torch.distributed`` itself (``deepspeed.init_distributed()``, as
DeepSpeed's docs show) before ``ds_dynatrain.initialize``, under ``dynatrain launch``, through a
resize 2 -> 3 -> 2 (a joiner runs the script from its start too); and no process ends with a gloo
thread alive (what aborted a process at exit, "terminate called without an active exception").

Real jobs (TinyLM, ZeRO-2, gloo). Oracles: exit status 0; the same job without that call trains
to bitwise the same losses and final state (the script's own group is replaced by the job's, and
nothing else changes); what the script's own group was in each process (the launch's processes:
a real group over both; the joiner: a group of one); the OS threads of every process after the
library's exit hooks (``/proc/self/task``, written by a hook that runs after them).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import WORKERS, assert_no_gloo_thread, launch, read_jsonl

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # a whole resizing job (make test-slow)

SCRIPT = os.path.join(WORKERS, "lifecycle_worker.py")
STEPS = 8
SCHEDULE = [{"step": 3, "world_size": 3}, {"step": 6, "world_size": 2}]


def _job(tmp_path, name: str, init: bool):
    from workers.common import base_config

    d = tmp_path / name
    d.mkdir()
    cfg = base_config(2, str(d / "metrics.jsonl"))
    cfg["dynatrain"]["resize_schedule"] = SCHEDULE
    args = ["--out", str(d), "--steps", str(STEPS)] + (["--init-distributed"] if init else [])
    job = launch(d, SCRIPT, 2, cfg, args, timeout=300, name=name)
    assert job.returncode == 0, job.output[-5000:]
    assert "EADDRINUSE" not in job.output and "Traceback" not in job.output, job.output[-5000:]
    assert "deepspeed_shm_comm" not in job.output  # DeepSpeed's CPU op is not built by the script's own start
    steps = [r for r in read_jsonl(d / "metrics.jsonl") if r["event"] == "step"]
    members = sorted(f[len("pid_") :] for f in os.listdir(d) if f.startswith("pid_"))
    return d, steps, members


def _no_gloo_thread_left(d, members) -> None:
    for m in members:
        assert_no_gloo_thread(d / f"threads_{m}")


@pytest.mark.timeout(900)
def test_a_script_that_starts_torch_distributed_itself_trains_through_resizes(tmp_path):
    d, steps, members = _job(tmp_path, "own_init", init=True)
    ref, ref_steps, ref_members = _job(tmp_path, "plain", init=False)
    assert [r["world_size"] for r in steps] == [2, 2, 2, 3, 3, 3, 2, 2]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in steps] == [r["loss"] for r in ref_steps]  # bitwise: the same job
    final, ref_final = torch.load(d / "final.pt"), torch.load(ref / "final.pt")
    for name in (k for k in final if not k.startswith("__")):
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(final[name][kind], ref_final[name][kind]), (name, kind)
    assert members == ref_members and len(members) == 3
    for m in members:
        seen = json.loads((d / f"init_{m}.json").read_text())
        if m.startswith("g0"):  # started together: the script's group is a real one over both
            assert seen == {"rank": int(m[-1]), "world_size": 2, "joiner": "0", "all_reduce": 2.0}, (m, seen)
        else:  # a joiner, started while the others train: a group of its own until it joins
            assert seen == {"rank": 0, "world_size": 1, "joiner": "1", "all_reduce": 1.0}, (m, seen)
    _no_gloo_thread_left(d, members)
    _no_gloo_thread_left(ref, ref_members)
