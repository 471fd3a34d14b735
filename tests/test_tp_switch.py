"""Switching the TP degree of a running AutoTP + ZeRO job online (``engine.resize(world,
tensor_parallel=N)``), on real gloo groups with a tiny Hugging Face Llama with uneven GQA
(``tests/workers/tp_switch_worker.py``).

Oracles:

* the gathered logical state (every parameter's fp32 master and both Adam moments whole, the TP
  shards joined by DeepSpeed's own affine maps, and the optimizer step) right after the switch
  equals, bitwise, the state right before it;
* a static run at the new layout, plain DeepSpeed with no code of ds_dynatrain, started from the
  state before the switch (set through DeepSpeed's own ``safe_set_full_*`` with each shard cut by
  the layer's affine map), trains the same batches: every loss after the switch and the final
  state equal the switched job's, bitwise.

One case also switches by the config's ``resize_schedule`` (inside ``engine.step()``): its losses
and final state equal the ``engine.resize`` run's, bitwise.

Refusals (``--refuse``): a TP degree that does not divide the world, and a world-size change,
are refused with the reason before anything changes (the switch that follows still matches the
oracles).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from conftest import WORKERS, assert_no_gloo_thread, launch, run_plain

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(WORKERS, "tp_switch_worker.py")

# (processes, worker arguments)
CASES = {
    # max_inflight_bytes 4096: messages of 1 KiB (85 elements of each of the 3 fp32 kinds; boxes cut by rows)
    "tp2_to_tp1_zero2_and_schedule": (
        2,
        ["--tp-from", "2", "--tp-to", "1", "--stage", "2", "--max-inflight-bytes", "4096"],
    ),
    "tp1_to_tp2_zero3_bf16_refusals": (2, ["--tp-from", "1", "--tp-to", "2", "--stage", "3", "--bf16", "--refuse"]),
    # Qwen3's q_norm/k_norm: replicated, their gradients summed over TP by hooks the rebuild must keep
    # make test-slow (the suite's time): a Qwen3 model, and a frozen parameter AutoTP does not cut
    "qwen3_tp1_to_tp2_grad_allreduce_hooks": pytest.param(
        (2, ["--tp-from", "1", "--tp-to", "2", "--stage", "2", "--qwen3"]), marks=pytest.mark.slow
    ),
    # a frozen parameter AutoTP does not cut (the final norm): copied into the rebuilt model
    "tp2_to_tp1_zero2_frozen_norm": pytest.param(
        (2, ["--tp-from", "2", "--tp-to", "1", "--stage", "2", "--freeze", "model.norm.weight"]),
        marks=pytest.mark.slow,
    ),
    "tp2_to_tp1_zero3": pytest.param((2, ["--tp-from", "2", "--tp-to", "1", "--stage", "3"]), marks=pytest.mark.slow),
    "tp2dp2_to_tp1dp4_bf16_tied": pytest.param(
        (4, ["--tp-from", "2", "--tp-to", "1", "--stage", "2", "--bf16", "--tie"]), marks=pytest.mark.slow
    ),
    "tp1_to_tp2_zero1_fp16": pytest.param(
        (2, ["--tp-from", "1", "--tp-to", "2", "--stage", "1", "--fp16"]), marks=pytest.mark.slow
    ),
    "tp2dp2_to_tp4_above_kv_heads_zero1": pytest.param(
        (4, ["--tp-from", "2", "--tp-to", "4", "--stage", "1"]), marks=pytest.mark.slow
    ),
    # down from above the KV heads: rank 3's k/v shards are empty, DeepSpeed's groups leave them out
    "tp4_above_kv_heads_to_tp2dp2_zero1": pytest.param(
        (4, ["--tp-from", "4", "--tp-to", "2", "--stage", "1"]), marks=pytest.mark.slow
    ),
}


def _equal(a: dict, b: dict) -> list:
    """Names of the entries of two gathered states that differ (bitwise)."""
    assert a.keys() == b.keys()
    bad = []
    for name in a:
        if name.startswith("__"):
            if a[name] != b[name]:
                bad.append(name)
            continue
        for kind in a[name]:
            if a[name][kind].shape != b[name][kind].shape or not torch.equal(a[name][kind], b[name][kind]):
                bad.append(f"{name}.{kind}")
    return bad


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_tp_switch_equals_the_static_run(tmp_path, case, request):
    nproc, args = case
    common = ["--out", str(tmp_path), *args]
    for mode in ("switch", "static"):
        jobs = run_plain(tmp_path, SCRIPT, nproc, [*common, "--mode", mode], timeout=200, name=mode)
        assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    for r in range(nproc):  # the switched job's processes exit normally, no gloo thread outlives it
        assert_no_gloo_thread(tmp_path / f"threads_switch_rank{r}")
    before, after = torch.load(tmp_path / "before.pt"), torch.load(tmp_path / "after.pt")
    assert not _equal(before, after), "the switch changed the logical state"
    final_switch, final_static = torch.load(tmp_path / "final_switch.pt"), torch.load(tmp_path / "final_static.pt")
    assert not _equal(final_switch, final_static), "training after the switch differs from the static run"
    switched = json.loads((tmp_path / "losses_switch.json").read_text())
    static = json.loads((tmp_path / "losses_static.json").read_text())
    assert switched["losses"] == static["losses"] and len(static["losses"]) == 2
    tp_from, tp_to = int(args[1]), int(args[3])
    rec = switched["record"]
    assert (rec["tensor_parallel_from"], rec["tensor_parallel_to"]) == (tp_from, tp_to)
    assert (rec["from"], rec["to"], rec["step"]) == (nproc, nproc, 2)
    assert rec["bytes_moved"] > 0 and rec["bytes_sent"] > 0
    if "--max-inflight-bytes" in args:  # bounded messages: many rounds, each within a quarter of the bound
        assert rec["messages"] > 100 and 0 < rec["peak_staging_bytes"] <= 2 * 1024, rec
    # rank 0's first q_proj rows: 6 heads of 8 in 3 KV groups (TP 2: 32 | 16; TP 4: 16 | 16 | 16 | 0)
    rows = {1: 48, 2: 32, 4: 16}
    if "--qwen3" not in args:
        assert switched["q_proj"] == {"before": [rows[tp_from], 48], "after": [rows[tp_to], 48]}
    if "schedule" in request.node.name:  # the same switch from the config's resize_schedule
        jobs = run_plain(tmp_path, SCRIPT, nproc, [*common, "--mode", "schedule"], timeout=200, name="schedule")
        assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
        scheduled = json.loads((tmp_path / "losses_schedule.json").read_text())
        assert scheduled["losses"] == switched["losses"]
        assert not _equal(torch.load(tmp_path / "final_schedule.pt"), final_switch)
        (r,) = scheduled["records"]
        assert (r["step"], r["tensor_parallel_from"], r["tensor_parallel_to"]) == (2, tp_from, tp_to)
        assert r["prepared_bytes"] > 0  # touched ahead (dynatrain.warm_switch_steps)
    if "--refuse" in args:
        assert switched["refusals"] == [
            f"TP degree 3 refused: it does not divide the world size {nproc}",
            f"world size {nproc - 1} refused: this process was started by a launcher other than `dynatrain "
            f"launch`; such an AutoTP job changes only its TP degree at its world size ({nproc}); `dynatrain "
            "launch` serves its shrinks",
        ]


def test_a_frozen_parameter_autotp_cuts_refuses_the_switch(tmp_path):
    """A frozen parameter is in no optimizer partition, so no plan moves it; one AutoTP cuts (a
    q_proj) would come out of a switch wrong: the switch is refused, naming it, with the state
    unchanged and training going on at the old TP. (A job that starts with such a parameter cut
    stops at its start: its TP layout describes trainable parameters only.)"""
    args = ["--tp-from", "1", "--tp-to", "2", "--stage", "2", "--expect-refusal"]
    args += ["--freeze", "model.layers.0.self_attn.q_proj.weight", "--out", str(tmp_path), "--mode", "switch"]
    jobs = run_plain(tmp_path, SCRIPT, 2, args, timeout=200, name="switch")
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    out = json.loads((tmp_path / "refused.json").read_text())
    assert out["refusals"] == [
        "layout TP 2 x DP 1 refused: frozen parameters cut by AutoTP cannot move to other processes "
        "(only the optimizer's state does): model.layers.0.self_attn.q_proj.weight"
    ]
    states = torch.load(tmp_path / "refused.pt")
    assert not _equal(states["before"], states["after"])
    assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"])


CONFIG = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
    "steps_per_print": 10**9,
    "tensor_parallel": {"autotp_size": 2},
}


@pytest.mark.parametrize(
    "preempt, zero3",
    [
        # make test-slow (the suite's time): make test keeps a TP job's world size changed under
        # launch (the grow below, with joiners) and its TP degree lowered (tp2_to_tp1_zero2_and_schedule)
        pytest.param(False, False, marks=pytest.mark.slow),
        pytest.param(True, False, marks=pytest.mark.slow),
        pytest.param(False, True, marks=pytest.mark.slow),
    ],
    ids=["resize", "preemption", "resize_to_tp1_zero3_bf16"],
)
def test_tp_shrink_under_launch_equals_the_static_run(tmp_path, preempt, zero3):
    """``dynatrain launch`` of 4 processes at TP 2 x DP 2 shrinks after step 3 to 2 processes at
    TP 2 x DP 1: by ``engine.resize(2, tensor_parallel=2)`` (the logical state bitwise unchanged),
    and, in the slow case, by a preemption notice to rank 1, which breaks its TP group (3
    processes are left; TP 2 does not divide 3 and TP 1 x DP 3 cannot split the global batch of
    4, so the job picks TP 2 x DP 1 and says so). The two processes that leave exit with status 0;
    the losses of steps 4-5 and the final state equal a plain DeepSpeed run at TP 2 x DP 1 set
    from the state after step 3, bitwise. The ZeRO-3 bf16 case shrinks to TP 1 x DP 2 instead."""
    config = dict(CONFIG, dynatrain={"metrics_path": str(tmp_path / "metrics.jsonl")})
    tp_to, extra = (1, ["--stage", "3", "--bf16"]) if zero3 else (2, [])
    if zero3:
        config.update(zero_optimization={"stage": 3}, bf16={"enabled": True})
    common = ["--mode", "launch", "--out", str(tmp_path), "--tp-from", "2", "--tp-to", "2", "--steps", "5", *extra]
    job = launch(tmp_path, SCRIPT, 4, config, [*common, "--resize-at", f"3:2:{tp_to}"], timeout=240, name="resize")
    assert job.returncode == 0, job.output[-4000:]
    assert f"resize TP 2 x DP 2 → TP {tp_to} x DP {2 // tp_to} after step 3" in job.output
    assert not _equal(torch.load(tmp_path / "before.pt"), torch.load(tmp_path / "after.pt"))
    static, final_static = _static_after_step_3(tmp_path, 2, tp_to, extra)
    if preempt:
        for name in ("final_launch.pt", "losses_launch.json"):
            (tmp_path / name).unlink()
        job = launch(tmp_path, SCRIPT, 4, config, [*common, "--preempt", "3:1"], timeout=240, name="preempt")
        assert job.returncode == 0, job.output[-4000:]
        assert "preemption of ['g0r1'] after step 3: the job goes on with 2 ranks at TP 2 x DP 1" in job.output
        assert "member g0r1 left the job after step 3" in job.output
    ran = json.loads((tmp_path / "losses_launch.json").read_text())
    assert ran["losses"] == static["losses"] and ran["tp"] == tp_to
    assert [(r["from"], r["to"], r["tensor_parallel_from"], r["tensor_parallel_to"]) for r in ran["records"]] == [
        (4, 2, 2, tp_to)
    ]
    assert not _equal(torch.load(tmp_path / "final_launch.pt"), final_static)


def _static_after_step_3(tmp_path, nproc: int, tp_to: int, extra) -> tuple:
    """The oracle of the launched jobs: a plain DeepSpeed run of ``nproc`` processes at TP ``tp_to``
    set from ``before.pt`` (the state after step 3), two steps. Returns its losses (the JSON
    object) and its final gathered state."""
    args = ["--out", str(tmp_path), "--tp-from", "2", "--tp-to", str(tp_to), "--steps-before", "3"]
    args += ["--steps-after", "2", *extra, "--mode", "static"]
    jobs = run_plain(tmp_path, SCRIPT, nproc, args, timeout=200, name="static")
    assert all(j.returncode == 0 for j in jobs), jobs[0].output[-4000:]
    return json.loads((tmp_path / "losses_static.json").read_text()), torch.load(tmp_path / "final_static.pt")


@pytest.mark.parametrize(
    "world, tp_to, extra, by_schedule",
    [
        # a grow to a world the config's TP degree (2) does not divide: the joiner checks the config
        # at the job's launch world size, and is built at the job's new degree
        (3, 1, ["--global-batch", "3"], False),
        # make test-slow: the grow at the same TP degree, again from the config's resize_schedule (the
        # DP job's scheduled grow is test_main_job's), and to TP 1 under ZeRO-3 bf16
        pytest.param(4, 2, [], False, marks=pytest.mark.slow),
        pytest.param(4, 2, [], True, marks=pytest.mark.slow),
        pytest.param(4, 1, ["--stage", "3", "--bf16"], False, marks=pytest.mark.slow),
    ],
    ids=["tp2dp1_to_tp1dp3", "tp2dp1_to_tp2dp2", "tp2dp1_to_tp2dp2_schedule", "tp2dp1_to_tp1dp4_zero3_bf16"],
)
def test_tp_grow_under_launch_equals_the_static_run(tmp_path, world, tp_to, extra, by_schedule):
    """``dynatrain launch`` of 2 processes at TP 2 x DP 1 grows after step 3 to ``world``
    processes (``engine.resize(world, tensor_parallel=T)``): the launcher starts the joiners,
    which build their engines at the new layout and receive their state. The gathered logical
    state right after the grow equals the state before it, bitwise; the losses of steps 4-5 and
    the final state equal a plain DeepSpeed run of ``world`` processes at the new layout set from
    the state after step 3, bitwise. Cases: TP 1 x DP 3 (a global batch of 3; the config's
    ``autotp_size`` 2 does not divide 3), TP 2 x DP 2, TP 1 x DP 4 under ZeRO-3 bf16. The schedule
    case then runs again with the grow in the config's ``resize_schedule`` (its joiners started
    ahead, while the survivors train): the same losses and final state."""
    config = dict(CONFIG, dynatrain={"metrics_path": str(tmp_path / "metrics.jsonl")})
    if "--stage" in extra:
        config.update(zero_optimization={"stage": 3}, bf16={"enabled": True})
    if "--global-batch" in extra:
        config.update(train_batch_size=int(extra[extra.index("--global-batch") + 1]))
    common = ["--mode", "launch", "--out", str(tmp_path), "--tp-from", "2", "--tp-to", "2", "--steps", "5", *extra]
    job = launch(tmp_path, SCRIPT, 2, config, [*common, "--resize-at", f"3:{world}:{tp_to}"], timeout=300, name="grow")
    assert job.returncode == 0, job.output[-4000:]
    assert f"resize TP 2 x DP 1 → TP {tp_to} x DP {world // tp_to} after step 3" in job.output
    assert not _equal(torch.load(tmp_path / "before.pt"), torch.load(tmp_path / "after.pt"))
    static, final_static = _static_after_step_3(tmp_path, world, tp_to, extra)
    ran = json.loads((tmp_path / "losses_launch.json").read_text())
    assert ran["losses"] == static["losses"] and ran["tp"] == tp_to
    assert [(r["from"], r["to"], r["tensor_parallel_from"], r["tensor_parallel_to"]) for r in ran["records"]] == [
        (2, world, 2, tp_to)
    ]
    assert not _equal(torch.load(tmp_path / "final_launch.pt"), final_static)
    if not by_schedule:
        return
    for name in ("final_launch.pt", "losses_launch.json"):
        (tmp_path / name).unlink()
    config["dynatrain"]["resize_schedule"] = [{"step": 3, "world_size": 4}]
    args = [*common, "--resize-at", "3:4:2", "--by-schedule"]
    job = launch(tmp_path, SCRIPT, 2, config, args, timeout=300, name="schedule")
    assert job.returncode == 0, job.output[-4000:]
    assert "agent: starting joiner" in job.output.split("resize TP 2 x DP 1")[0]
    ran = json.loads((tmp_path / "losses_launch.json").read_text())
    assert ran["losses"] == static["losses"] and ran["tp"] == 2
    assert not _equal(torch.load(tmp_path / "final_launch.pt"), final_static)


def test_resize_request_carries_the_tensor_parallel_degree():
    """``dynatrain resize --tensor-parallel`` (``request_resize``) against a real TCPStore standing in
    for a job's: the TP degree is in the queued request, the global batch is checked over the DP
    ranks it leaves (world / TP), and a degree that does not divide the world is refused before
    anything is queued. The job's side (every rank reads the degree from the store and switches)
    is ``test_tp_request_under_launch``."""
    import threading
    from datetime import timedelta

    from conftest import free_port
    from torch.distributed import TCPStore

    from ds_dynatrain.elastic.keys import ANSWER_KEY, JOB_KEY, REQUEST_COUNT, REQUEST_KEY
    from ds_dynatrain.elastic.requests import request_resize
    from ds_dynatrain.errors import ResizeRefusedError

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    store.set(JOB_KEY, json.dumps({"global_batch": 4, "micro_batch": 1, "max_world_size": None, "world_size": 4}))
    with pytest.raises(ResizeRefusedError, match="TP degree 3 does not divide the world size 4"):
        request_resize("127.0.0.1", port, 4, 10, tensor_parallel=3)
    assert store.add(REQUEST_COUNT, 0) == 0  # nothing queued

    def answer():
        store.wait([REQUEST_KEY.format(0)], timedelta(seconds=30))
        seen.append(json.loads(store.get(REQUEST_KEY.format(0))))
        store.set(ANSWER_KEY.format(0), json.dumps({"ok": True, "message": "done", "record": None, "aborted": False}))

    seen: list = []
    t = threading.Thread(target=answer)
    t.start()
    assert request_resize("127.0.0.1", port, 4, 20, tensor_parallel=1)["message"] == "done"
    t.join()
    assert seen == [{"world_size": 4, "tensor_parallel": 1}]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp_request_under_launch(tmp_path):
    """``dynatrain resize --world-size 4`` against a running 2-process TP 2 job grows it to TP 2 x
    DP 2 (the launcher starts two processes, which join at the job's step; their start-up and the
    new group's rendezvous run behind training), then
    ``--tensor-parallel 1`` switches it to TP 1 x DP 4: each served at a step boundary (every rank
    reads the request from the store; the switch ``warm_switch_steps`` after it, its memory touched
    meanwhile), answered with the layouts, recorded; a degree that does not
    divide the world is refused by the requester with exit status 2; the job trains on to its end."""
    import subprocess
    import sys
    import time

    from conftest import background_job, free_port, read_jsonl, resize_command

    port = free_port()
    metrics = tmp_path / "metrics.jsonl"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(CONFIG, dynatrain={"metrics_path": str(metrics)})))
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "launch", "--nproc", "2", "--store", f"127.0.0.1:{port}"]
    cmd += ["--allow-oversubscribe", "--config", str(cfg), SCRIPT, "--mode", "launch", "--out", str(tmp_path)]
    cmd += ["--tp-from", "2", "--tp-to", "2", "--steps", "24", "--step-sleep", "0.7"]
    with background_job(cmd, str(tmp_path / "job.log")) as job:
        deadline = time.monotonic() + 150
        while not (metrics.exists() and any(r.get("event") == "step" for r in read_jsonl(metrics))):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "job.log").read_text()[-3000:]
            time.sleep(0.3)
        bad = subprocess.run(
            [*resize_command(f"127.0.0.1:{port}", 4, 60), "--tensor-parallel", "3"], capture_output=True, text=True
        )
        assert bad.returncode == 2 and "TP degree 3 does not divide the world size 4" in bad.stderr, bad.stderr
        grow = subprocess.run(resize_command(f"127.0.0.1:{port}", 4, 180), capture_output=True, text=True)
        assert grow.returncode == 0 and "resized 2 -> 4 (TP 2 -> 2) after step" in grow.stdout, (
            grow.stdout + grow.stderr
        )
        assert "prepared in the background" in grow.stdout  # joiners started and group built behind training
        ok = subprocess.run(
            [*resize_command(f"127.0.0.1:{port}", 4, 120), "--tensor-parallel", "1"], capture_output=True, text=True
        )
        assert ok.returncode == 0 and "resized 4 -> 4 (TP 2 -> 1) after step" in ok.stdout, ok.stdout + ok.stderr
        assert job.wait(timeout=200) == 0, (tmp_path / "job.log").read_text()[-3000:]
    ran = json.loads((tmp_path / "losses_launch.json").read_text())
    assert ran["tp"] == 1
    assert [(r["from"], r["to"], r["tensor_parallel_from"], r["tensor_parallel_to"]) for r in ran["records"]] == [
        (2, 4, 2, 2),
        (4, 4, 2, 1),
    ]
    steps = [r["step"] for r in read_jsonl(metrics) if r.get("event") == "step"]
    assert steps == list(range(1, 25))
    switched = [r for r in read_jsonl(metrics) if r.get("event") == "resize"][-1]
    assert switched["prepared_bytes"] > 0  # the request's switch came warm_switch_steps later, its memory touched
