"""Oracles shared by the load tests: ``verify``, ``inspect`` and ``export`` of a saved checkpoint,
without a model, checked against the saving job's gathered fp32 master; a refused load that
changed nothing."""

from __future__ import annotations

import contextlib
import io
import os

import torch


def check_offline_tools(ckpt: str, before: dict, world: int, tp: int = 1, pp: int = 1) -> None:
    """``verify`` finds ``ckpt`` intact; ``inspect`` reports its ``world`` processes, TP and PP
    degrees, a rank entry per process and every trainable parameter with its whole shape; the
    weights ``export`` writes equal, bitwise, ``before``'s fp32 master (``{name: {"fp32": ...}}``,
    the saving job's state gathered whole; TP shards joined by DeepSpeed's own affine maps, a
    tied parameter once)."""
    from safetensors.torch import load_file

    from ds_dynatrain.checkpoint.consolidate import export_safetensors
    from ds_dynatrain.checkpoint.inspect import inspect_report, verify_checkpoint
    from ds_dynatrain.cli.report import print_inspect

    rep = verify_checkpoint(ckpt)
    assert rep.ok, rep.problems
    info = inspect_report(ckpt)
    assert (info["world_size"], info["tensor_parallel"], info["pipeline_parallel"]) == (world, tp, pp)
    assert len(info["ranks"]) == world
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_inspect(info, as_json=False)
    shape = (
        f" (PP {pp} x DP {world // pp})"
        if info["layer_files"]
        else (f" (TP {tp} x DP {world // tp})" if tp > 1 else "")
    )
    assert f"world size   {world}{shape}\n" in printed.getvalue(), printed.getvalue()  # a pipeline's at PP 1 too
    shapes = {p["name"]: p["shape"] for p in info["parameters"] if p["trainable"]}
    assert shapes == {n: list(v["fp32"].shape) for n, v in before.items() if not n.startswith("__")}
    out = os.path.join(os.path.dirname(ckpt), "export", "model.safetensors")
    os.makedirs(os.path.dirname(out))
    export_safetensors(ckpt, out)
    weights = load_file(out)
    for name, v in before.items():
        if not name.startswith("__"):
            assert torch.equal(weights[name], v["fp32"]), f"exported {name} differs from the saved master"


def check_refused_unchanged(out_dir, world: int) -> None:
    """Every rank's fp32 master and working parameters before and after a refused load
    (``refused<r>.pt`` of a load worker: ``{"before": [...], "after": [...]}``) are bitwise equal."""
    for r in range(world):
        refused = torch.load(os.path.join(out_dir, f"refused{r}.pt"))
        assert len(refused["before"]) == len(refused["after"]) > 0
        for x, y in zip(refused["before"], refused["after"]):
            assert torch.equal(x, y), f"a refused load changed rank {r}'s master or parameters"
