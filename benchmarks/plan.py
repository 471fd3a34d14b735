"""Planning time at 70 B scale: ``python -m benchmarks.plan [--json]``.

Plans a Llama-2-70B-shaped model (``configs/models/llama2_70b.json``, built on the meta device)
under ZeRO-2 and ZeRO-3 from 64 to 48 ranks, with the byte-maximising rank assignment and with
ranks kept in place, and prints the time beside the target (under 1 s; DynaTrain reports whole
70 B re-layouts in under 2 s) and the share of the state that stays in place. ZeRO-2 partitions
the flattened model (one fragment per rank boundary); ZeRO-3 partitions every parameter (about
10^5 fragments), so it is the harder case for the planner.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default=os.path.join(ROOT, "configs", "models", "llama2_70b.json"))
    ap.add_argument("--from", dest="from_ws", type=int, default=64)
    ap.add_argument("--to", dest="to_ws", type=int, default=48)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from ds_dynatrain.cli.plan import plan_report

    out = []
    for stage in (2, 3):
        for assignment in ("best", "keep"):
            rep = plan_report(a.model_config, stage, a.from_ws, a.to_ws, "bfloat16", assignment)
            total = rep["bytes_moved"] + rep["bytes_kept"]
            out.append(
                {
                    "zero_stage": stage,
                    "assignment": assignment,
                    "plan_seconds": rep["plan_seconds"],
                    "target_seconds": 1.0,
                    "ratio_to_target": rep["plan_seconds"] / 1.0,
                    "kept_fraction": rep["bytes_kept"] / total,
                    "bytes_moved": rep["bytes_moved"],
                    "transfers": rep["transfers"],
                    "parameters": rep["parameters"],
                }
            )
    if a.json:
        for r in out:
            print(json.dumps(r))
        return 0
    print(f"{out[0]['parameters'] / 1e9:.1f} B parameters, {a.from_ws} -> {a.to_ws} ranks")
    for r in out:
        print(
            f"ZeRO-{r['zero_stage']} {r['assignment']:>5} assignment: planned in {r['plan_seconds'] * 1e3:6.1f} ms "
            f"(target 1000 ms, ratio {r['ratio_to_target']:.3f}); {100 * r['kept_fraction']:.1f} % of the state "
            f"stays in place, {r['bytes_moved'] / 2**30:.0f} GiB move, {r['transfers']} transfers"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
