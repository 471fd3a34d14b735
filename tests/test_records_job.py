"""The records and the console of a real short job: the main job (examples/train_lm.py, a
transformers Llama) at ZeRO-3 under ``dynatrain launch``, 2 ranks resized to 1 after step 3, a
snapshot every 2 steps.

Oracles: the record classes of ``ds_dynatrain/engine/records.py`` (what the README documents:
every key of a record is a documented field of its event, every field that is not optional is
present, each value has its field's type); the job's own figures (the config's global batch,
the loader's sequence length, the record times around each step, the sizes of the snapshot files
on disk); the model built without DeepSpeed (its parameter count); and the lines DeepSpeed and
torch printed before the plugin fixed or filtered them (none may appear).
"""

from __future__ import annotations

import json
import math
import os
import re
import typing

import pytest
from conftest import ROOT, launch, read_jsonl

from ds_dynatrain.engine.records import RECORDS, record_fields

pytestmark = pytest.mark.multiprocess

SCRIPT = os.path.join(ROOT, "examples", "train_lm.py")
SEQ_LEN, LAYERS, HIDDEN = 32, 1, 64
ARGS = ["--steps", "6", "--layers", str(LAYERS), "--hidden", str(HIDDEN), "--seq-len", str(SEQ_LEN)]
# what every worker printed before: DeepSpeed's scheduler warning, torch's deprecation of the
# collective DeepSpeed chose, C++ stack traces, a plural for one
NOISE = (
    "Attempting to get learning rate from scheduler before it has started",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "FutureWarning",
    "frame #",
    " 1 ranks",
    " 1 workers",
)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("records_job")
    with open(os.path.join(ROOT, "configs", "zero3_elastic.json")) as f:
        cfg = json.load(f)
    cfg["scheduler"]["params"]["total_num_steps"] = 6
    cfg["dynatrain"] = {
        "resize_schedule": [{"step": 3, "world_size": 1}],
        "max_world_size": 2,
        "snapshot": {"interval_steps": 2, "dir": str(tmp / "snapshots"), "keep_last": 3},
        "metrics_path": str(tmp / "metrics.jsonl"),
        "log_interval_steps": 2,
    }
    # OMP_NUM_THREADS unset: each worker takes its share of the host's CPUs, again after the resize
    out = launch(tmp, SCRIPT, 2, cfg, ARGS, timeout=220, name="job", unset=["OMP_NUM_THREADS"])
    assert out.returncode == 0, out.output[-5000:]
    return tmp, cfg, out.output, read_jsonl(tmp / "metrics.jsonl")


def _type_ok(value, hint) -> bool:
    """``value`` fits the field's type ``hint`` as JSON gives it back (a float field may hold an
    int, a bool is no number, a sequence is a list)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return any(_type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin in (list, tuple, typing.Sequence, __import__("collections.abc").abc.Sequence):
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def test_type_check_of_the_test_refuses_wrong_values():
    assert _type_ok(3, int) and not _type_ok(True, int) and not _type_ok(3.5, int)
    assert _type_ok(3, float) and _type_ok(None, typing.Optional[float]) and not _type_ok("x", float)
    assert _type_ok([1, 2], typing.List[int]) and not _type_ok([1, "2"], typing.List[int])
    assert _type_ok(["a"], typing.Sequence[str]) and not _type_ok("a", typing.Sequence[str])


def test_every_record_has_the_documented_fields_and_types(job):
    _, _, _, recs = job
    classes = {cls.EVENT: cls for cls in RECORDS}
    seen = set()
    for rec in recs:
        cls = classes[rec["event"]]
        seen.add(rec["event"])
        hints = typing.get_type_hints(cls)
        fields = {f.metadata.get("key") or f.name: f for f in record_fields(cls)}
        assert set(rec) - {"event", "time"} <= set(fields), (rec["event"], set(rec) - set(fields))
        for key, f in fields.items():
            if not f.metadata.get("optional"):
                assert key in rec, (rec["event"], key)
            if key in rec:
                assert _type_ok(rec[key], hints[f.name]), (rec["event"], key, rec[key], hints[f.name])
        assert isinstance(rec["time"], float)
    assert seen == {"step", "resize", "snapshot"}, seen


def test_throughput_agrees_with_step_time_and_batch(job):
    _, cfg, _, recs = job
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert [r["world_size"] for r in steps] == [2, 2, 2, 1, 1, 1]
    for prev, r in zip([None] + steps, steps):
        assert r["samples"] == cfg["train_batch_size"]
        assert r["step_s"] > 0
        assert math.isclose(r["samples_per_s"] * r["step_s"], r["samples"], rel_tol=1e-9)
        # a batch of the loader is [samples, SEQ_LEN] token ids
        assert math.isclose(r["tokens_per_s"], r["samples_per_s"] * SEQ_LEN, rel_tol=1e-9)
        if prev is not None:  # the step ran between the two records' writes
            assert r["step_s"] < r["time"] - prev["time"], (prev, r)


def test_snapshot_records_count_the_files_written(job):
    tmp, _, _, recs = job
    snaps = [r for r in recs if r["event"] == "snapshot"]
    assert [(r["step"], r["ok"]) for r in snaps] == [(2, True), (4, True), (6, True)]
    for r in snaps:
        d = tmp / "snapshots" / r["tag"]
        assert r["bytes"] == sum(os.path.getsize(d / f) for f in os.listdir(d) if f.endswith(".pt")), r
        assert r["capture_s"] >= 0 and r["flush_s"] >= 0
        assert math.isclose(r["bytes_per_s"], r["bytes"] / (r["capture_s"] + r["flush_s"]), rel_tol=1e-9)


def test_console_is_quiet_and_informative(job):
    _, _, output, _ = job
    for line in NOISE:
        assert line not in output, (line, output[-3000:])
    # one step line every log_interval_steps (2), with step time and throughput
    lines = re.findall(
        r"\[dynatrain\] step +(\d+) \|.*\| ([\d.]+) s/step \| ([\d.,]+) samples/s \| ([\d,]+) tokens/s", output
    )
    assert [int(s) for s, *_ in lines] == [2, 4, 6], output[-3000:]


def test_parameter_count_under_zero3(job):
    """The example counts ZeRO-3's partitioned parameters by their full size (ds_numel)."""
    _, _, output, _ = job
    import sys

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from train_lm import build_model

    n = sum(p.numel() for p in build_model(SEQ_LEN, LAYERS, HIDDEN).parameters())
    assert f"model: Llama, {n / 1e6:.2f} M parameters" in output and n > 10_000, output[:3000]
    assert "ZeRO stage 3" in output


def test_plot_of_the_job(job, tmp_path):
    """``dynatrain plot`` draws the real metrics file: the loss panel and one bar per resize."""
    pytest.importorskip("matplotlib")
    from ds_dynatrain.cli.main import main
    from ds_dynatrain.cli.plot import LOSS_TITLE, PHASES_TITLE, build_figure

    tmp, _, _, recs = job
    fig = build_figure(recs)
    assert [a.get_title(loc="left") for a in fig.axes] == [LOSS_TITLE, PHASES_TITLE]
    (resize,) = [r for r in recs if r["event"] == "resize"]
    plan = next(c for c in fig.axes[1].containers if c.get_label() == "plan")
    assert [p.get_width() for p in plan.patches] == pytest.approx([resize["plan_s"]])
    assert main(["plot", str(tmp / "metrics.jsonl"), "--out", str(tmp_path / "job.png")]) == 0
    assert (tmp_path / "job.png").stat().st_size > 0


def test_workers_share_the_host_cpus_again_after_the_resize(job):
    _, _, _, recs = job
    cpus = len(os.sched_getaffinity(0))
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["world_size"] for r in steps] == [2, 2, 2, 1, 1, 1]
    assert [r["threads"] for r in steps] == [max(1, cpus // r["world_size"]) for r in steps]
