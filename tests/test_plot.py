"""``dynatrain plot``: the figure's panels and what each holds, read back from the matplotlib objects
(not pixels), for records of a run with resizes close together, snapshots (one failed) and a
static run.

Oracle: the records the figure is drawn from (losses, differences, phase seconds), and the text
extents matplotlib computes for the resize labels (no two may overlap).
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")

from ds_dynatrain.cli.main import main  # noqa: E402
from ds_dynatrain.cli.plot import DIFF_TITLE, LOSS_TITLE, PHASES, PHASES_TITLE, build_figure, label_rows  # noqa: E402

SCHEDULE = {10: 3, 11: 1, 12: 2, 30: 4}  # three resizes one step apart: their labels would collide


def records():
    recs, ws = [], 2
    for s in range(1, 41):
        recs.append({"event": "step", "step": s, "world_size": ws, "loss": 5 - 0.05 * s + 0.01 * (s % 3)})
        if s % 8 == 0:
            recs.append({"event": "snapshot", "step": s, "ok": s != 24})
        if s in SCHEDULE:
            recs.append(
                {
                    "event": "resize",
                    "step": s,
                    "from": ws,
                    "to": SCHEDULE[s],
                    "seconds": 2.0 + s / 100,
                    "plan_s": 0.1,
                    "group_s": 0.5 + s / 100,
                    "xfer_group_s": 0.05,
                    "rebuild_s": 0.6,
                    "transfer_wait_s": 0.1,
                    "transfer_s": 0.4,
                }
            )
            ws = SCHEDULE[s]
    static = [dict(r, loss=r["loss"] + 0.002 * (r["step"] % 5)) for r in recs if r["event"] == "step"]
    return recs, static


def test_label_rows_keep_close_labels_apart():
    assert label_rows([10, 11, 12, 30], min_gap=3) == [0, 1, 2, 0]
    assert label_rows([30, 10, 20], min_gap=5) == [0, 0, 0]
    assert label_rows([5, 5, 9], min_gap=5) == [0, 1, 2]
    assert label_rows([5, 5, 10], min_gap=5) == [0, 1, 0]
    assert label_rows([], min_gap=1) == []


def test_figure_panels_hold_the_records():
    recs, static = records()
    fig = build_figure(recs, static, "t")
    loss, diff, phases = fig.axes[:3]
    assert [a.get_title(loc="left") for a in fig.axes[:3]] == [LOSS_TITLE, DIFF_TITLE, PHASES_TITLE]

    steps = {r["step"]: r["loss"] for r in recs if r["event"] == "step"}
    lines = {ln.get_label(): ln for ln in loss.get_lines()}
    el = lines["elastic run"]
    assert list(el.get_xdata()) == list(steps) and list(el.get_ydata()) == list(steps.values())
    assert list(lines["static run (world size 2)"].get_ydata()) == [r["loss"] for r in static]
    # a dashed line at every resize, in both step panels
    for ax in (loss, diff):
        dashed = sorted(ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_linestyle() == "--")
        assert dashed == [s + 0.5 for s in sorted(SCHEDULE)]
    # snapshots: three committed, one failed
    offsets = {c.get_label(): [p[0] for p in c.get_offsets()] for c in loss.collections}
    assert offsets == {"snapshot": [8, 16, 32, 40], "failed snapshot": [24]}

    (d,) = [ln for ln in diff.get_lines() if ln.get_marker() == "."]
    want = [steps[r["step"]] - r["loss"] for r in static]
    assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(d.get_ydata(), want)) and len(want) == 40

    # phases: one bar per resize and phase, widths the record's seconds, then the rest
    resizes = [r for r in recs if r["event"] == "resize"]
    bars = {c.get_label(): [p.get_width() for p in c.patches] for c in phases.containers}
    for key, label, _ in PHASES:
        assert bars[label] == pytest.approx([r[key] for r in resizes], abs=1e-12), label
    rest = [r["seconds"] - sum(r[k] for k, _, _ in PHASES) for r in resizes]
    assert bars["other"] == pytest.approx(rest, abs=1e-12)
    assert bars["transfer (beside the rebuild)"] == pytest.approx([0.4] * 4, abs=1e-12)
    names = [f"step {r['step']}: {r['from']}\u2192{r['to']}" for r in resizes]
    assert [t.get_text() for t in phases.get_yticklabels()] == names

    # the resize labels: text as recorded, no two overlapping on the canvas
    fig.canvas.draw()
    labels = [t for t in loss.texts if t.get_gid() == "resize-label"]
    assert [t.get_text().split()[0] for t in labels] == ["2\u21923", "3\u21921", "1\u21922", "2\u21924"]
    boxes = [t.get_window_extent() for t in labels]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), (labels[i].get_text(), labels[j].get_text())


def test_figure_without_static_run_or_resizes():
    recs, _ = records()
    fig = build_figure(recs)
    assert [a.get_title(loc="left") for a in fig.axes] == [LOSS_TITLE, PHASES_TITLE]
    fig = build_figure([r for r in recs if r["event"] == "step"])
    assert [a.get_title(loc="left") for a in fig.axes] == [LOSS_TITLE]
    with pytest.raises(ValueError, match="no step record"):
        build_figure([r for r in recs if r["event"] != "step"])


def test_cli_writes_the_png_and_refuses_bad_input(tmp_path, capsys):
    recs, static = records()
    m, s = tmp_path / "m.jsonl", tmp_path / "s.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in recs))
    s.write_text("".join(json.dumps(r) + "\n" for r in static))
    out = tmp_path / "loss.png"
    assert main(["plot", str(m), "--static", str(s), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    for text, why in [
        ("not json\n", "line 1 is not JSON"),
        ('{"event": "step", "step": 1, "loss": 2.0, "world_size": 2}\n\n{"event": "step", "step": 2}\n',
         "line 3: a step record without loss, world_size"),
        ('{"event": "resize", "step": 1, "from": 2, "to": 3}\n', "line 1: a resize record without seconds"),
        ("[1, 2]\n", "line 1 is not a JSON object"),
    ]:  # fmt: skip
        bad.write_text(text)
        assert main(["plot", str(bad), "--out", str(tmp_path / "b.png")]) == 2
        assert f"dynatrain plot: {bad}: {why}" in capsys.readouterr().err
        assert not (tmp_path / "b.png").exists()
