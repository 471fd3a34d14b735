"""TP switch downtime: our online switch of an AutoTP job beside DeepSpeed's universal-checkpoint route.

    python -m benchmarks.tp_reconfig [--params 100M] [--switches 2:1,1:2] [--world 2] [--json] [--dir DIR]

One run, on this machine, ``--world`` processes (2), a Llama-shaped model (vocabulary 8192, hidden
768, MLP 2048, 12 query heads and ``--kv-heads`` 4 key/value heads 64 wide, untied embeddings,
sequence length 64, micro-batch 1; ``--params`` picks the number of layers, 14 for about 101 M
parameters; ``--hidden``/``--layers`` override), AutoTP + ZeRO-2, fp32, AdamW (``torch_adam``
with ``fused``), the same global batch (``--global-batch`` sequences) and the same tokens at every
step in every job. Per switch A->B of the TP degree (DP goes from world/A to world/B):

* ``ours``: ``ds_dynatrain.initialize`` at TP A (``tensor_parallel.autotp_size``; 1: not cut yet
  but switchable), K steps (``--steps-before``), ``engine.resize(world, tensor_parallel=B)``,
  ``--steps-after`` steps at TP B. ``ours_s`` = the record's ``seconds`` + ``first_step_excess_s``
  (how much longer the first iteration at TP B takes than the median of the later ones): the
  downtime between the last step at A and the first normal step at B. Split: ``plan_s``,
  ``transfer_s`` (the point-to-point exchange of the fp32 master and both moments),
  ``rebuild_s`` (the model cut again by AutoTP, the engine rebuilt, the state installed).
* ``deepspeed``: plain ``deepspeed.initialize`` ranks at TP A train K steps and
  ``save_checkpoint`` (``save_s``); ``python -m deepspeed.checkpoint.ds_to_universal
  --inject_missing_state`` (``convert_s``, the whole command; the flag gives a TP-1 checkpoint,
  which carries no ``universal_checkpoint_info``, the version-only one the converter requires; a
  TP-2 checkpoint carries AutoTP's own); fresh ranks at TP B with ``checkpoint.load_universal``
  load it and train one step (``relaunch_s``: from starting the processes to the end of their
  load, plus how much longer their first step takes than a normal iteration at B, ``new_iter_s``,
  measured in our run: the same end point as ours). ``deepspeed_route_s`` = the sum; ``ratio`` =
  ``deepspeed_route_s / ours_s``. ``same_loss``: the first step after the switch has bitwise the
  same loss on both routes.
* a load across TP degrees: fresh ranks at TP B with ``ds_dynatrain.initialize`` load the route's
  saved (unconverted) TP-A checkpoint with ``engine.load_checkpoint`` (``ours_load_s``) and train
  one step; against ``load_route_s`` = ``convert_s`` + ``relaunch_load_s`` (``load_ratio``), and
  ``same_loss_after_load``: their first losses are bitwise equal.
* memory, per rank: ``peak_extra_bytes`` = the peak resident set during ``engine.resize``
  (``VmHWM`` of ``/proc/self/status``, reset to the resident set by writing 5 to
  ``/proc/self/clear_refs`` right before the call) minus the resident set right before it: what
  the switch needed on top of the job as it stood (the largest over the ranks);
  ``transient_bytes``: the peak above both the resident set before and after (the part that is
  gone once the switch returned). ``largest_shard_bytes``: the largest ZeRO partition of one rank
  of the fp32 master and both Adam moments, over the ranks and both layouts; ``peak_ratio`` =
  ``peak_extra_bytes / largest_shard_bytes`` (aim: at most 1.25). The resident set counts what
  the process holds from the OS, torch's CPU tensors and everything else.

Times in seconds, sizes in bytes. ``--json`` prints one JSON object per switch; otherwise a table,
one line per switch. Checkpoints and logs go to a temporary directory under ``--dir`` that is
removed at the end. A failed job stops the run with the tail of its log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import List, Tuple

from benchmarks.layout_switch import SwitchKind, print_switches, switch
from benchmarks.reconfig import (
    VOCAB,
    JobFailed,
    fmt,
    layers_for,
    parse_count,
    parse_transitions,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "tp_reconfig_worker.py")


def parse_switches(text: str) -> List[Tuple[int, int]]:
    """``A:B,...`` TP degrees (``benchmarks.reconfig``'s transitions: A != B, both >= 1)."""
    return parse_transitions(text)


def model_args(a) -> List[str]:
    return [
        *("--hidden", str(a.hidden), "--layers", str(a.layers), "--kv-heads", str(a.kv_heads)),
        *("--seq-len", str(a.seq_len), "--global-batch", str(a.global_batch)),
    ]


KIND = SwitchKind(WORKER, "tp", "TP", "tensor_parallel", ours_load=True)


def print_table(results: List[dict], a) -> None:
    r0 = results[0]
    print(
        f"model: {r0['params'] / 1e6:.1f} M parameters (hidden {a.hidden}, {a.layers} layers, "
        f"{a.hidden // 64} heads / {a.kv_heads} KV heads, vocabulary {VOCAB}, sequence {a.seq_len}), AutoTP + ZeRO-2 "
        f"fp32 AdamW, {a.world} processes, global batch {a.global_batch}, micro-batch 1; switch after step "
        f"{a.steps_before}"
    )
    print_switches(results, "TP", fmt)
    print(f"\n{'load':<9} {'ours':>7} | {'route':>7} {'convert':>7} {'load':>6} | {'ratio':>6} | {'same loss':>9}")
    for r in results:
        print(
            f"{r['switch']:<9} {r['ours_load_s']:>7.3f} | {r['load_route_s']:>7.2f} {r['convert_s']:>7.2f} "
            f"{r['relaunch_load_s']:>6.2f} | {fmt(r['load_ratio'], '.1f', 6)} | "
            f"{'yes' if r['same_loss_after_load'] else 'no':>9}"
        )
    print(
        "\nloading the route's saved checkpoint at the new TP in fresh processes, seconds: ours = "
        "engine.load_checkpoint of the unconverted DeepSpeed checkpoint (a load across TP degrees); route = "
        "ds_to_universal + load_checkpoint with load_universal; same loss = the first step after both loads"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("100M"), help="model size to aim at")
    ap.add_argument("--hidden", type=int, default=768, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (overrides --params)")
    ap.add_argument("--kv-heads", type=int, default=4, help="key/value heads (dividing hidden / 64)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--world", type=int, default=2, help="processes (unchanged by the switch)")
    ap.add_argument("--switches", type=parse_switches, default=parse_switches("2:1,1:2"), help="A:B,... TP degrees")
    ap.add_argument("--global-batch", type=int, default=4, help="global batch, sequences (a multiple of every DP size)")
    ap.add_argument("--steps-before", type=int, default=3, help="optimizer steps at the old TP before the switch (K)")
    ap.add_argument("--steps-after", type=int, default=4, help="optimizer steps at the new TP")
    ap.add_argument("--convert-workers", type=int, default=2, help="ds_to_universal extract and merge workers")
    ap.add_argument("--timeout", type=float, default=1800.0, help="limit of each job, seconds")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint directory goes")
    ap.add_argument("--json", action="store_true", help="one JSON object per switch")
    a = ap.parse_args(argv)
    if a.hidden % 64 or (a.hidden // 64) % a.kv_heads:
        ap.error("--hidden must be a multiple of 64 and its 64-wide heads a multiple of --kv-heads")
    if a.steps_before < 1 or a.steps_after < 2:
        ap.error("--steps-before must be >= 1 and --steps-after >= 2")
    for tp_from, tp_to in a.switches:
        for tp in (tp_from, tp_to):
            if a.world % tp or a.global_batch % (a.world // tp):
                ap.error(f"TP {tp} must divide --world {a.world} and its DP size the --global-batch {a.global_batch}")
    if a.layers is None:
        a.layers = layers_for(a.params, a.hidden, a.kv_heads)
    os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="dynatrain-tp-reconfig-", dir=a.dir)
    results = []
    try:
        for tp_from, tp_to in a.switches:
            r = switch(KIND, tp_from, tp_to, a, work, model_args(a))
            results.append(r)
            if a.json:
                print(json.dumps(r), flush=True)
    except JobFailed as err:
        print(f"benchmarks.tp_reconfig: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not a.json:
        print_table(results, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
