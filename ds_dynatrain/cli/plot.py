"""``dynatrain plot``: a run's metrics file as one figure (matplotlib, the ``examples`` extra).

Panels, top to bottom:

* **loss** against step, the static run's (when given) under it; every resize a dashed line and a
  label ``old→new`` with its seconds, the labels put in rows so that close resizes do not collide
  (:func:`label_rows`); every snapshot a triangle on the step axis (filled: committed; a cross:
  failed);
* **difference** elastic − static loss per step (only with a static run): the two lines of the
  first panel lie on top of each other, their difference does not;
* **resize phases**: one horizontal bar per resize, its seconds split into planning, forming the
  group (waiting for joiners included), the transition group, rebuilding the engine, waiting for
  the transfer after the rebuild, and the rest; the transfer itself runs beside the rebuild and is
  drawn as a thin bar under it.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence

# (record field, label, colour) of the phases a resize record's seconds are made of, in order
PHASES = (
    ("plan_s", "plan", "C0"),
    ("group_s", "group", "C1"),
    ("xfer_group_s", "transition group", "C4"),
    ("rebuild_s", "rebuild", "C2"),
    ("transfer_wait_s", "transfer wait", "C3"),
)
LOSS_TITLE, DIFF_TITLE, PHASES_TITLE = "loss", "elastic − static loss", "resize phases"


# the fields each drawn event needs (a record of another event is left out of the figure)
NEEDED = {
    "step": ("step", "loss", "world_size"),
    "resize": ("step", "from", "to", "seconds"),
    "snapshot": ("step", "ok"),
}


def read_metrics(path: str) -> List[dict]:
    """The records of a metrics file (JSON lines; blank lines skipped).

    Raises:
        OSError: the file cannot be read.
        ValueError: a line is not a JSON object, or a step, resize or snapshot record lacks a field
            the figure needs (the message names the file, the line and the field).
    """
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{path}: line {n} is not JSON ({err})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}: line {n} is not a JSON object")
            missing = [k for k in NEEDED.get(rec.get("event"), ()) if k not in rec]
            if missing:
                raise ValueError(f"{path}: line {n}: a {rec['event']} record without {', '.join(missing)}")
            out.append(rec)
    return out


def label_rows(xs: Sequence[float], min_gap: float) -> List[int]:
    """A row for each label at position ``xs[i]`` so that two labels in one row are at least
    ``min_gap`` apart: each label, from left to right, takes the lowest row whose last label is far
    enough (row 0 for resizes far apart; close ones step down)."""
    last: List[float] = []  # the x of the last label of each row
    rows = [0] * len(xs)
    for i in sorted(range(len(xs)), key=lambda k: xs[k]):
        row = next((r for r, x in enumerate(last) if xs[i] - x >= min_gap), len(last))
        if row == len(last):
            last.append(xs[i])
        last[row] = xs[i]
        rows[i] = row
    return rows


def _steps(recs: List[dict]) -> Dict[int, float]:
    return {r["step"]: r["loss"] for r in recs if r.get("event") == "step"}


def _loss_panel(ax, recs: List[dict], static: Optional[List[dict]]) -> None:
    from matplotlib.transforms import blended_transform_factory

    if static is not None:
        st = _steps(static)
        ws = next((r["world_size"] for r in static if r.get("event") == "step"), "?")
        ax.plot(list(st), list(st.values()), color="0.6", lw=2.5, label=f"static run (world size {ws})")
    el = _steps(recs)
    ax.plot(list(el), list(el.values()), color="C0", lw=1.2, marker=".", ms=3, label="elastic run")
    top = blended_transform_factory(ax.transData, ax.transAxes)
    resizes = [r for r in recs if r.get("event") == "resize"]
    span = (max(el) - min(el)) if len(el) > 1 else 1.0
    rows = label_rows([r["step"] for r in resizes], min_gap=0.09 * span)
    for r, row in zip(resizes, rows):
        x = r["step"] + 0.5
        ax.axvline(x, color="C3", ls="--", lw=1)
        ax.text(x, 0.98 - 0.13 * row, f" {r['from']}\u2192{r['to']}\n {r['seconds']:.1f} s", transform=top,
                color="C3", va="top", fontsize=8, gid="resize-label")  # fmt: skip
    snaps = [r for r in recs if r.get("event") == "snapshot"]
    for ok, marker, label in ((True, "^", "snapshot"), (False, "x", "failed snapshot")):
        xs = [r["step"] for r in snaps if bool(r.get("ok")) == ok]
        if xs:
            ax.scatter(xs, [0.02] * len(xs), transform=top, marker=marker, color="C2" if ok else "C3",
                       s=30, zorder=3, clip_on=False, label=label)  # fmt: skip
    ax.set_ylabel("training loss")
    ax.set_title(LOSS_TITLE, loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)


def _diff_panel(ax, recs: List[dict], static: List[dict]) -> None:
    el, st = _steps(recs), _steps(static)
    common = sorted(set(el) & set(st))
    ax.plot(common, [el[s] - st[s] for s in common], color="C0", lw=1, marker=".", ms=3)
    ax.axhline(0.0, color="0.4", lw=0.8)
    for r in recs:
        if r.get("event") == "resize":
            ax.axvline(r["step"] + 0.5, color="C3", ls="--", lw=1)
    ax.set_ylabel("difference")
    ax.set_title(DIFF_TITLE, loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))


def _phases_panel(ax, resizes: List[dict]) -> None:
    names = [f"step {r['step']}: {r['from']}\u2192{r['to']}" for r in resizes]
    ys = list(range(len(resizes)))
    left = [0.0] * len(resizes)
    for key, label, color in PHASES:
        widths = [float(r.get(key, 0.0)) for r in resizes]
        ax.barh(ys, widths, left=left, height=0.5, color=color, label=label)
        left = [a + b for a, b in zip(left, widths)]
    rest = [max(0.0, float(r["seconds"]) - done) for r, done in zip(resizes, left)]
    ax.barh(ys, rest, left=left, height=0.5, color="0.8", label="other")
    start = [float(r.get("plan_s", 0)) + float(r.get("group_s", 0)) + float(r.get("xfer_group_s", 0)) for r in resizes]
    ax.barh([y + 0.33 for y in ys], [float(r.get("transfer_s", 0.0)) for r in resizes], left=start, height=0.12,
            color="k", label="transfer (beside the rebuild)")  # fmt: skip
    ax.set_yticks(ys, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(PHASES_TITLE, loc="left", fontsize=10)
    ax.grid(alpha=0.3, axis="x")


def build_figure(recs: List[dict], static: Optional[List[dict]] = None, title: str = ""):
    """The figure of a run's records (``static``: the records of the same job without resizes):
    its panels in the order of the module docstring, each titled with :data:`LOSS_TITLE`,
    :data:`DIFF_TITLE` or :data:`PHASES_TITLE`.

    Raises:
        ValueError: the records hold no step.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not _steps(recs):
        raise ValueError("the metrics hold no step record")
    resizes = [r for r in recs if r.get("event") == "resize"]
    panels = ["loss"] + (["diff"] if static is not None else []) + (["phases"] if resizes else [])
    heights = {"loss": 3.0, "diff": 1.4, "phases": 0.6 + 0.35 * len(resizes)}
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, 1.6 + sum(heights[p] for p in panels)), squeeze=False, layout="constrained",
        gridspec_kw={"height_ratios": [heights[p] for p in panels]},
    )  # fmt: skip
    axes = list(axes[:, 0])
    _loss_panel(axes[0], recs, static)
    if static is not None:
        _diff_panel(axes[1], recs, static)
        axes[1].sharex(axes[0])
    if resizes:
        _phases_panel(axes[-1], resizes)
        # the phases' legend below the figure (constrained layout makes room; in the panel it hides bars)
        fig.legend(*axes[-1].get_legend_handles_labels(), loc="outside lower center", fontsize=7, ncol=4)
    (axes[1] if static is not None else axes[0]).set_xlabel("optimizer step")
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    return fig


def plot_losses(
    metrics_path: str,
    out_path: str,
    static_path: Optional[str] = None,
    title: str = "Loss of an elastic DeepSpeed ZeRO job",
) -> None:
    """Write the PNG of :func:`build_figure` for the metrics file ``metrics_path`` (and the static
    run's ``static_path``).

    Raises:
        ImportError: matplotlib is not installed (``pip install ds_dynatrain[examples]``).
        OSError, ValueError, KeyError: a metrics file cannot be read, is not JSON lines, holds no
            step, or a record lacks a field.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    static = read_metrics(static_path) if static_path else None
    fig = build_figure(recs, static, title)
    try:
        fig.savefig(out_path, dpi=120)
    finally:
        plt.close(fig)
