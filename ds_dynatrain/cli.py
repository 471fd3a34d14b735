"""The ``dynatrain`` command line.

::

    dynatrain launch --nproc 2 --config configs/zero2_elastic.json examples/train_lm.py [ARGS...]
    dynatrain plan --model-config CONFIG.json --from 64 --to 48 [--zero-stage 2] [--json]
    dynatrain plot runs/demo/metrics.jsonl [--static runs/static/metrics.jsonl] --out loss.png
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .errors import ConfigError


def _cmd_launch(a) -> int:
    from .launcher import launch
    try:
        return launch(a.script, a.script_args, a.nproc, a.config, a.store)
    except ConfigError as err:
        print(f"dynatrain launch: {err}", file=sys.stderr)
        return 2


def _cmd_plot(a) -> int:
    from .plot import plot_losses
    try:
        plot_losses(a.metrics, a.out, static_path=a.static, title=a.title)
    except (OSError, ValueError, KeyError) as err:
        print(f"dynatrain plot: {err}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _cmd_plan(a) -> int:
    from .plan_cli import plan_report, print_report
    try:
        rep = plan_report(a.model_config, a.zero_stage, a.from_ws, a.to_ws, DTYPE_NAMES.get(a.dtype, a.dtype),
                          a.assignment)
    except ConfigError as err:
        print(f"dynatrain plan: {err}", file=sys.stderr)
        return 2
    print_report(rep, a.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dynatrain", description="Elastic DeepSpeed ZeRO training: online resizing "
                                "and resilience snapshots.")
    sub = p.add_subparsers(dest="command", required=True)

    lp = sub.add_parser("launch", help="start a job: host the membership store and the worker processes")
    lp.add_argument("--nproc", type=int, required=True, help="workers at launch (the initial world size)")
    lp.add_argument("--config", required=True, help="DeepSpeed JSON config, with an optional \"dynatrain\" section")
    lp.add_argument("--store", default=None, help="HOST:PORT for the job's TCPStore (default: 127.0.0.1, any port)")
    lp.add_argument("script", help="training script; it receives its arguments plus --deepspeed_config CONFIG")
    lp.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    lp.set_defaults(func=_cmd_launch)

    qp = sub.add_parser("plan", help="print the transition plan of a model between two world sizes (no process starts)")
    qp.add_argument("--model-config", required=True, help="a Hugging Face model config (config.json)")
    qp.add_argument("--zero-stage", type=int, default=2, help="ZeRO stage (1, 2 or 3)")
    qp.add_argument("--from", dest="from_ws", type=int, required=True, help="old data-parallel world size")
    qp.add_argument("--to", dest="to_ws", type=int, required=True, help="new data-parallel world size")
    qp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", *DTYPE_NAMES],
                    help="working dtype of the parameters")
    qp.add_argument("--assignment", default="best", choices=["best", "keep"],
                    help="best: ranks chosen to keep the most bytes in place; keep: old rank r stays rank r")
    qp.add_argument("--json", action="store_true", help="one JSON object")
    qp.set_defaults(func=_cmd_plan)

    pp = sub.add_parser("plot", help="plot loss against step with the resizes marked")
    pp.add_argument("metrics", help="metrics JSON-lines file of the elastic run")
    pp.add_argument("--static", default=None, help="metrics of the same job run without resizes")
    pp.add_argument("--out", required=True, help="PNG to write")
    pp.add_argument("--title", default="Loss of an elastic DeepSpeed ZeRO job")
    pp.set_defaults(func=_cmd_plot)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    if getattr(a, "nproc", 1) is not None and getattr(a, "nproc", 1) < 1:
        print("dynatrain launch: --nproc must be >= 1", file=sys.stderr)
        return 2
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
