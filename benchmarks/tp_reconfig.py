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
  The switch is announced two steps ahead with ``engine.prepare_resize(world, tensor_parallel=B)`` and
  also run without notice (``cold_*``), as :func:`benchmarks.layout_switch.switch` describes.
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
* memory, per rank: ``peak_extra_bytes`` = the peak resident set during the cold ``engine.resize``
  (``VmHWM`` of ``/proc/self/status``, reset to the resident set by writing 5 to
  ``/proc/self/clear_refs`` right before the call) minus the resident set right before it: what
  the switch needed on top of the job as it stood (the largest over the ranks;
  ``prepared_peak_extra_bytes``: the same for the announced switch with the memory it held, part
  of the resident set before it, added back);
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
import os
import sys
from typing import List

from benchmarks.layout_switch import (
    SwitchKind,
    check_arguments,
    common_arguments,
    print_loads,
    print_switches,
    run_switches,
)
from benchmarks.reconfig import (
    VOCAB,
    fmt,
    layers_for,
    parse_count,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "tp_reconfig_worker.py")


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
    print_loads(results, "TP", fmt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("100M"), help="model size to aim at")
    ap.add_argument("--hidden", type=int, default=768, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (overrides --params)")
    ap.add_argument("--kv-heads", type=int, default=4, help="key/value heads (dividing hidden / 64)")
    common_arguments(ap, "TP")
    a = ap.parse_args(argv)
    if a.hidden % 64 or (a.hidden // 64) % a.kv_heads:
        ap.error("--hidden must be a multiple of 64 and its 64-wide heads a multiple of --kv-heads")
    check_arguments(ap, a, "TP")
    if a.layers is None:
        a.layers = layers_for(a.params, a.hidden, a.kv_heads)
    return run_switches(KIND, a, model_args(a), print_table)


if __name__ == "__main__":
    sys.exit(main())
