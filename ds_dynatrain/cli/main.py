"""The ``dynatrain`` command line.

::

    dynatrain --version
    dynatrain launch --nproc 2 --config configs/zero2_elastic.json examples/train_lm.py [ARGS...]
    dynatrain launch --nnodes 2 --node-rank R --nproc 2 --store HOST:PORT --config CFG script.py [ARGS...]
    srun --ntasks-per-node=1 dynatrain launch --nproc 2 --config CFG script.py [ARGS...]
    dynatrain join --store HOST:PORT --nproc K --config CFG script.py [ARGS...]
    dynatrain resize --store HOST:PORT --world-size N [--tensor-parallel T | --pipeline-parallel P]
                     [--timeout SECONDS]
    dynatrain plan --model-config CONFIG.json --from 64 --to 48 [--zero-stage 2] [--json]
                   [--tensor-parallel-from 8 --tensor-parallel-to 4]
    dynatrain plot runs/demo/metrics.jsonl [--static runs/static/metrics.jsonl] --out loss.png
    dynatrain inspect CKPT_DIR [--tag T] [--json] [--no-checksums]
    dynatrain verify CKPT_DIR [--tag T]
    dynatrain export CKPT_DIR --out model.safetensors [--dtype fp32|bf16] [--tag T]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from ..errors import ConfigError, DynatrainError, ResizeRefusedError, TransitionAbortedError
from ..log import log_to_console, plural
from ..version import version_line

TRAINER_FLAG = "--deepspeed"  # Hugging Face TrainingArguments' flag for the DeepSpeed config


def _config_in(script_args) -> Optional[str]:
    """The path after ``--deepspeed`` (Trainer's flag) or ``--deepspeed_config`` in ``script_args``."""
    for i, arg in enumerate(script_args):
        for flag in (TRAINER_FLAG, "--deepspeed_config"):
            if arg == flag and i + 1 < len(script_args):
                return script_args[i + 1]
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1 :]
    return None


def _cmd_launch(a) -> int:
    from ..elastic.launch import launch

    config, pass_config = a.config, True
    if a.deepspeed_config_file is not None:  # Accelerate's flag: the config reaches Accelerator() by its variables
        if config is not None:
            print(f"dynatrain {a.command}: --config and --deepspeed_config_file both given", file=sys.stderr)
            return 2
        config, pass_config = a.deepspeed_config_file, False
        os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=os.path.abspath(config))
    if config is None:
        config, pass_config = _config_in(a.script_args), False
        if config is None:
            print(
                f"dynatrain {a.command}: no --config, and {a.script}'s arguments name none ({TRAINER_FLAG})",
                file=sys.stderr,
            )
            return 2
    try:
        return launch(
            a.script,
            a.script_args,
            a.nproc,
            config,
            a.store,
            nnodes=getattr(a, "nnodes", None),
            node_rank=getattr(a, "node_rank", None),
            join=a.command == "join",
            slots=getattr(a, "slots", None),
            allow_oversubscribe=a.allow_oversubscribe,
            max_refills=getattr(a, "max_refills", 0),
            pass_config=pass_config,
        )
    except ConfigError as err:
        print(f"dynatrain {a.command}: {err}", file=sys.stderr)
        return 2


def _positive_seconds(text: str) -> float:
    """``--timeout``: a number of seconds above 0 (argparse's error names the flag otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} s: it must be above 0")
    return value


def _at_least_one(text: str) -> int:
    """``--world-size``: a whole number of ranks or processes, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: a job needs at least 1")
    return value


def _cmd_resize(a) -> int:
    from ..elastic.requests import request_resize

    host, _, port = a.store.rpartition(":")
    if not host or not port.isdigit():
        print(f"dynatrain resize: --store {a.store!r}: expected HOST:PORT", file=sys.stderr)
        return 2
    try:
        answer = request_resize(
            host,
            int(port),
            a.world_size,
            a.timeout,
            tensor_parallel=a.tensor_parallel,
            pipeline_parallel=a.pipeline_parallel,
        )
    except ResizeRefusedError as err:
        print(f"dynatrain resize: refused: {err}", file=sys.stderr)
        return 2
    except TransitionAbortedError as err:
        print(f"dynatrain resize: {err}", file=sys.stderr)
        return 1
    print(answer["message"])
    return 0


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
    from .plan import plan_report, print_report

    dtype = DTYPE_NAMES.get(a.dtype, a.dtype)
    pipeline = a.pp_from is not None or a.pp_to is not None
    try:
        if pipeline and (a.tp_from is not None or a.tp_to is not None):
            raise ConfigError("--pipeline-parallel-* with --tensor-parallel-*: plans change one of the two")
        if pipeline:
            from .plan_pp import pp_plan_report

            if a.zero_stage not in (None, 1):
                raise ConfigError(f"--zero-stage {a.zero_stage}: DeepSpeed's pipeline engine runs ZeRO-1 (stage < 2)")
            pp_from, pp_to = (1 if p is None else p for p in (a.pp_from, a.pp_to))
            rep = pp_plan_report(
                a.model_config, a.from_ws, a.to_ws, pp_from, pp_to, dtype, a.assignment, a.partition_method
            )
        elif a.tp_from is None and a.tp_to is None:
            rep = plan_report(
                a.model_config, 2 if a.zero_stage is None else a.zero_stage, a.from_ws, a.to_ws, dtype, a.assignment
            )
        else:
            from .plan_tp import tp_plan_report

            tp_from, tp_to = (1 if t is None else t for t in (a.tp_from, a.tp_to))
            rep = tp_plan_report(
                a.model_config,
                2 if a.zero_stage is None else a.zero_stage,
                a.from_ws,
                a.to_ws,
                tp_from,
                tp_to,
                dtype,
                a.assignment,
            )
    except ConfigError as err:
        print(f"dynatrain plan: {err}", file=sys.stderr)
        return 2
    print_report(rep, a.json)
    return 0


def _cmd_inspect(a) -> int:
    from ..checkpoint.inspect import inspect_report
    from .report import print_inspect

    if not os.path.isdir(a.dir):
        print(f"dynatrain inspect: {a.dir}: not a directory", file=sys.stderr)
        return 2
    try:
        rep = inspect_report(a.dir, a.tag, a.checksums)
    except DynatrainError as err:  # CheckpointIncompleteError: missing or damaged files
        print(f"dynatrain inspect: {err}", file=sys.stderr)
        return 1
    print_inspect(rep, a.json)
    return 0


def _cmd_verify(a) -> int:
    from ..checkpoint.inspect import verify_checkpoint
    from .report import print_verify

    if not os.path.isdir(a.dir):
        print(f"dynatrain verify: {a.dir}: not a directory", file=sys.stderr)
        return 2
    rep = verify_checkpoint(a.dir, a.tag)
    print_verify(rep)
    return 0 if rep.ok else 1


def _world(dp: int, tp: int, pp: int = 1) -> str:
    if pp > 1:
        return f"{dp * pp} ranks (PP {pp} x DP {dp})"
    return plural(dp, "rank") if tp == 1 else f"{dp * tp} ranks (TP {tp} x DP {dp})"


def _cmd_export(a) -> int:
    from ..checkpoint.consolidate import EXPORT_DTYPES, export_safetensors

    if not os.path.isdir(a.dir):
        print(f"dynatrain export: {a.dir}: not a directory", file=sys.stderr)
        return 2
    parent = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(parent):
        print(f"dynatrain export: --out {a.out}: directory {parent} does not exist", file=sys.stderr)
        return 2
    try:
        st = export_safetensors(a.dir, a.out, EXPORT_DTYPES[a.dtype], a.tag)
    except (DynatrainError, ValueError) as err:  # damaged checkpoint; a dtype safetensors cannot name
        print(f"dynatrain export: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"dynatrain export: {err}", file=sys.stderr)
        return 1
    print(
        f"wrote {st.path}: {st.tensors} tensors, {st.elements:,} elements, {st.dtype}, {st.bytes:,} bytes "
        f"(step {st.step}, saved by {_world(st.world_size, st.tp, st.pp)} at ZeRO-{st.stage}) in {st.seconds:.2f} s"
    )
    if st.config:
        print(f"wrote {st.config}: the model's Hugging Face config (from_pretrained loads the directory)")
    return 0


def _job_arguments(p: argparse.ArgumentParser, config_help: str, script_help: str) -> None:
    """The arguments ``launch`` and ``join`` share: oversubscription, the config, the script and its
    arguments."""
    p.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="joiners may start on this host past its slots (several workers on one device)",
    )
    p.add_argument(
        "--config",
        default=None,
        help=config_help + " (default: the path after the script's own --deepspeed or --deepspeed_config)",
    )
    p.add_argument(
        "--deepspeed_config_file",
        default=None,
        help="the config, for a Hugging Face Accelerate script (as `accelerate launch --use_deepspeed "
        "--deepspeed_config_file`): the workers get ACCELERATE_USE_DEEPSPEED=true and "
        "ACCELERATE_DEEPSPEED_CONFIG_FILE, not a --deepspeed_config argument",
    )
    p.add_argument("script", help=script_help)
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_cmd_launch)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` says every flag's default, except where there is none to say (None, a switch
    that is off) or the help text says it already."""

    def _get_help_string(self, action):
        text = action.help or ""
        if any(action.default is d for d in (None, False, argparse.SUPPRESS)) or "default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """The parser of every ``dynatrain`` command (defaults in ``--help``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsHelp)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The ``dynatrain`` argument parser: one sub-command per command of the module docstring."""
    p = _Parser(
        prog="dynatrain", description="Elastic DeepSpeed ZeRO training: online resizing and resilience snapshots."
    )
    p.add_argument("--version", action="version", version=version_line(), help="print the versions and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_job_commands(sub)
    _add_query_commands(sub)
    _add_checkpoint_commands(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Run one ``dynatrain`` command; returns its exit status (0 ok, 1 failed, 2 refused input)."""
    a = build_parser().parse_args(argv)
    log_to_console()
    for flag in ("nproc", "slots", "nnodes"):
        if getattr(a, flag, None) is not None and getattr(a, flag) < 1:
            print(f"dynatrain {a.command}: --{flag} must be >= 1", file=sys.stderr)
            return 2
    if getattr(a, "max_refills", 0) < 0:
        print(f"dynatrain {a.command}: --max-refills must be >= 0", file=sys.stderr)
        return 2
    return a.func(a)


def _add_job_commands(sub) -> None:
    """``launch`` and ``join``: run this host's share of a job."""
    lp = sub.add_parser("launch", help="start a job: host the membership store and the worker processes")
    lp.add_argument("--nproc", type=int, required=True, help="workers this host starts (also its slots unless --slots)")
    lp.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="hosts at launch (world size = nnodes * nproc; default: SLURM's node count under srun, else 1)",
    )
    lp.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this host's index; node 0 hosts the store (default: SLURM_NODEID under srun, "
        "JOB_COMPLETION_INDEX or the pod ordinal on Kubernetes, else 0)",
    )
    lp.add_argument(
        "--store",
        default=None,
        help="HOST:PORT for the job's TCPStore (default: 127.0.0.1, any port; on several hosts an address of "
        "node 0 and a fixed port; under srun the first host of the node list, :PORT names only the port)",
    )
    lp.add_argument(
        "--slots",
        type=int,
        default=None,
        help="workers this host can hold, one per device (default: --nproc); joiners of a grow start in free slots",
    )
    lp.add_argument(
        "--max-refills",
        type=int,
        default=0,
        help="after a worker failure shrank the job (restore_on_failure), grow it back to its slots "
        "at most this many times (default: 0, the job stays smaller)",
    )
    _job_arguments(
        lp,
        'DeepSpeed JSON config, with an optional "dynatrain" section',
        "training script; it receives its arguments plus --deepspeed_config CONFIG",
    )

    jp = sub.add_parser("join", help="add this host's workers to a running job (a grow, served at a step boundary)")
    jp.add_argument("--store", required=True, help="HOST:PORT of the job's store")
    jp.add_argument("--nproc", type=int, required=True, help="workers this host adds")
    _job_arguments(jp, "the job's DeepSpeed JSON config", "the job's training script")


def _add_query_commands(sub) -> None:
    """``resize``, ``plan`` and ``plot``: ask a running job, plan a transition, plot a run."""
    rp = sub.add_parser("resize", help="ask a running job to change its world size (served at a step boundary)")
    rp.add_argument("--store", required=True, help="HOST:PORT of the job's store (dynatrain launch --store)")
    rp.add_argument(
        "--world-size",
        type=_at_least_one,
        required=True,
        help="the new world size (data-parallel; an AutoTP or PipelineModule job's processes, TP x DP, PP x DP)",
    )
    rp.add_argument("--timeout", type=_positive_seconds, default=600.0, help="seconds to wait for the job's answer")
    rp.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        help="an AutoTP job's new TP degree (--world-size is then its number of processes, TP x DP)",
    )
    rp.add_argument(
        "--pipeline-parallel",
        type=int,
        default=None,
        help="a PipelineModule job's new PP degree (--world-size: PP x DP processes, at its world size a switch)",
    )
    rp.set_defaults(func=_cmd_resize)

    qp = sub.add_parser("plan", help="print the transition plan of a model between two world sizes (no process starts)")
    qp.add_argument("--model-config", required=True, help="a Hugging Face model config (config.json)")
    qp.add_argument(
        "--zero-stage", type=int, help="ZeRO stage (1, 2 or 3; default 2, and 1 with --pipeline-parallel-*)"
    )
    qp.add_argument("--from", dest="from_ws", type=int, required=True, help="old world size (data-parallel without TP)")
    qp.add_argument("--to", dest="to_ws", type=int, required=True, help="new world size (data-parallel without TP)")
    qp.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32", *DTYPE_NAMES],
        help="working dtype of the parameters (default bfloat16; fp32 training moves no master)",
    )
    qp.add_argument(
        "--assignment",
        default="best",
        choices=["best", "keep"],
        help="best: ranks chosen to keep the most bytes in place; keep: old rank r stays rank r",
    )
    qp.add_argument(
        "--tensor-parallel-from",
        dest="tp_from",
        type=int,
        help="old AutoTP degree (--from and --to are then world sizes: TP x DP; default 1)",
    )
    qp.add_argument("--tensor-parallel-to", dest="tp_to", type=int, help="new AutoTP degree (default 1)")
    qp.add_argument(
        "--pipeline-parallel-from",
        dest="pp_from",
        type=int,
        help="old pipeline degree: the model as a PipelineModule (embedding, decoder layers, norm, head) "
        "with ZeRO-1 (--from and --to are then world sizes: PP x DP; default 1)",
    )
    qp.add_argument("--pipeline-parallel-to", dest="pp_to", type=int, help="new pipeline degree (default 1)")
    qp.add_argument(
        "--partition-method",
        default="parameters",
        help="how the stages are split, as PipelineModule's partition_method (parameters, uniform, "
        "type:<regex>; default parameters)",
    )
    qp.add_argument("--json", action="store_true", help="one JSON object")
    qp.set_defaults(func=_cmd_plan)

    pp = sub.add_parser(
        "plot",
        help="plot loss against step (resizes and snapshots marked), the difference against a static run "
        "and each resize's phases",
    )
    pp.add_argument("metrics", help="metrics JSON-lines file of the elastic run")
    pp.add_argument("--static", default=None, help="metrics of the same job run without resizes")
    pp.add_argument("--out", required=True, help="PNG to write")
    pp.add_argument("--title", default="Loss of an elastic DeepSpeed ZeRO job", help="the figure's title")
    pp.set_defaults(func=_cmd_plot)


def _add_checkpoint_commands(sub) -> None:
    """``inspect``, ``verify`` and ``export``: read a checkpoint directory."""
    tag_help = "checkpoint tag, a directory under DIR (default: the one DIR/latest names)"
    ip = sub.add_parser("inspect", help="what a checkpoint holds: world size, ZeRO stage, step, parameters, bytes")
    ip.add_argument("dir", metavar="DIR", help="checkpoint directory (what save_checkpoint was given)")
    ip.add_argument("--tag", default=None, help=tag_help)
    ip.add_argument("--json", action="store_true", help="one JSON object")
    ip.add_argument(
        "--no-checksums",
        dest="checksums",
        action="store_false",
        help="read only the metadata the report is made of, not every byte (default: check every checksum first)",
    )
    ip.set_defaults(func=_cmd_inspect)

    vp = sub.add_parser(
        "verify",
        help="check a checkpoint complete and intact: every file, checksum and fragment "
        "(exit status 0: intact, 1: not)",
    )
    vp.add_argument("dir", metavar="DIR", help="checkpoint directory (what save_checkpoint was given)")
    vp.add_argument("--tag", default=None, help=tag_help)
    vp.set_defaults(func=_cmd_verify)

    ep = sub.add_parser("export", help="write the consolidated full weights as one safetensors file")
    ep.add_argument("dir", metavar="DIR", help="checkpoint directory (what save_checkpoint was given)")
    ep.add_argument("--out", required=True, help="safetensors file to write (e.g. model.safetensors)")
    ep.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="dtype of the floating-point tensors (integer buffers keep theirs)",
    )
    ep.add_argument("--tag", default=None, help=tag_help)
    ep.set_defaults(func=_cmd_export)
