"""The printed reports of ``dynatrain inspect`` and ``dynatrain verify``."""

from __future__ import annotations

import json
import sys

from ..checkpoint.inspect import FORMAT_DEEPSPEED, FORMAT_OURS, VerifyReport
from ..log import plural


def print_inspect(rep: dict, as_json: bool) -> None:
    """Print :func:`inspect_report`'s dict: one JSON object, or a table."""
    if as_json:
        print(json.dumps(rep))
        return
    fmt = {
        FORMAT_OURS: "dynatrain snapshot (checksummed)",
        FORMAT_DEEPSPEED: "DeepSpeed torch.save (no checksums)",
        "mixed": "mixed (dynatrain and DeepSpeed files)",
    }[rep["format"]]
    print(f"checkpoint   {rep['dir']}")
    print(f"format       {fmt}")
    tp, pp = rep.get("tensor_parallel", 1), rep.get("pipeline_parallel", 1)
    shape = f" (TP {tp} x DP {rep['world_size'] // tp})" if tp > 1 else ""
    pipeline = pp > 1 or bool(rep.get("layer_files"))  # a pipeline's checkpoint at PP 1 too
    shape = f" (PP {pp} x DP {rep['world_size'] // pp})" if pipeline else shape
    print(f"world size   {rep['world_size']}{shape}")
    print(f"ZeRO stage   {rep['zero_stage']}")
    print(f"step         {rep['step']} ({rep['global_samples']:,} samples)")
    print(f"dtype        {rep['working_dtype']} (working), fp32 master")
    ntrain = sum(1 for p in rep["parameters"] if p["trainable"])
    print(
        f"parameters   {rep['num_parameters']:,} elements in {len(rep['parameters'])} tensors "
        f"({rep['num_trainable']:,} trainable in {ntrain})"
    )
    width = max([len(p["name"]) for p in rep["parameters"]] + [4])
    print(f"  {'name':<{width}}  {'shape':<16} {'elements':>14}")
    for p in rep["parameters"]:
        frozen = "" if p["trainable"] else "  frozen"
        print(f"  {p['name']:<{width}}  {str(p['shape']):<16} {p['numel']:>14,}{frozen}")
    for alias, name in rep["tied"].items():
        print(f"  {alias} is tied to {name}")
    if rep["buffers"]:
        print(f"buffers      {', '.join(rep['buffers'])}")
    print("bytes per rank")
    for r in rep["ranks"]:
        print(f"  rank {r['rank']:<4} {r['bytes']:>14,}  {', '.join(r['files'])}")
    if rep.get("layer_files"):
        layers = rep["layer_files"]
        print(f"  {len(layers)} layer files of the pipeline's module ({layers[0]} ... {layers[-1]})")
    print(f"  total      {rep['total_bytes']:>14,}")


def print_verify(rep: VerifyReport) -> None:
    """Notes on stdout; problems on stderr, then ``FAILED`` or ``OK``."""
    for n in rep.notes:
        print(n)
    for p in rep.problems:
        print(f"error: {p}", file=sys.stderr)
    if rep.ok:
        print(f"OK: {rep.dir} is complete and intact")
    else:
        print(f"FAILED: {rep.dir}: {plural(len(rep.problems), 'problem')}", file=sys.stderr)
