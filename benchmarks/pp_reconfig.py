"""PP switch downtime: our online switch of a pipeline job beside DeepSpeed's universal-checkpoint route.

    python -m benchmarks.pp_reconfig [--params 100M] [--switches 2:1,1:2] [--world 2] [--json] [--dir DIR]

One run, on this machine, ``--world`` processes (2), a pipeline model built with DeepSpeed's
``PipelineModule`` (``benchmarks/pp_reconfig_worker.py``: a token embedding of vocabulary 8192
tied to the head, pre-norm transformer layers of hidden 768 with 12 heads and MLP 2048, a final
norm, sequence length 64, micro-batch 1; ``--params`` picks the number of layers, 17 for about
101 M parameters; ``--hidden``/``--layers`` override), ZeRO-1, fp32, AdamW (``torch_adam`` with
``fused``), partition method ``parameters``, the same global batch (``--global-batch``
sequences) and the same tokens at every step in every job. Per switch A->B of the PP degree (DP
goes from world/A to world/B):

* ``ours``: ``ds_dynatrain.initialize`` at PP A, K steps (``--steps-before``),
  ``engine.resize(world, pipeline_parallel=B)``, ``--steps-after`` steps at PP B. ``ours_s`` =
  the record's ``seconds`` + ``first_step_excess_s`` (how much longer the first iteration at PP B
  takes than the median of the later ones): the downtime between the last step at A and the
  first normal step at B. Split: ``plan_s``, ``transfer_s`` (the point-to-point exchange of the
  fp32 master and both moments), ``rebuild_s`` (the new ``PipelineModule`` built, the engine
  rebuilt, the state installed).
  The switch is announced two steps ahead with ``engine.prepare_resize(world, pipeline_parallel=B)`` and
  also run without notice (``cold_*``), as :func:`benchmarks.layout_switch.switch` describes.
* ``deepspeed``: plain ``deepspeed.initialize`` ranks at PP A train K steps and
  ``save_checkpoint`` (``save_s``); ``python -m deepspeed.checkpoint.ds_to_universal
  --inject_missing_state`` (``convert_s``, the whole command; the flag supplies the
  ``universal_checkpoint_info`` a PipelineModule's checkpoint lacks); fresh ranks at PP B with
  ``checkpoint.load_universal`` load it and train one step (``relaunch_s``: from starting the
  processes to the end of their load, plus how much longer their first step takes than a normal
  iteration at B, ``new_iter_s``, measured in our run). ``deepspeed_route_s`` = the sum;
  ``ratio`` = ``deepspeed_route_s / ours_s``. ``same_loss``: the first step after the switch has
  bitwise the same loss on both routes.
* a load across PP degrees: fresh ranks at PP B with ``ds_dynatrain.initialize`` load the route's
  saved (unconverted) PP-A checkpoint with ``engine.load_checkpoint`` (``ours_load_s``) and train
  one step; against ``load_route_s`` = ``convert_s`` + ``relaunch_load_s`` (``load_ratio``), and
  ``same_loss_after_load``: their first losses are bitwise equal.
* memory, per rank: ``peak_extra_bytes`` = the peak resident set during the cold
  ``engine.resize`` minus the resident set right before it (the largest over the ranks);
  ``prepared_peak_extra_bytes``: the same for the announced switch with the memory it held (part
  of the resident set before it) added back; ``largest_shard_bytes``:
  the largest ZeRO-1 partition of one rank of the fp32 master and both Adam moments (its stage's
  state), over the ranks and both layouts; ``peak_ratio`` = ``peak_extra_bytes /
  largest_shard_bytes``.

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
from benchmarks.reconfig import fmt, parse_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "pp_reconfig_worker.py")
VOCAB = 8192


def layers_for(params: int, hidden: int) -> int:
    """Transformer layers of the benchmark's pipeline model closest to ``params`` parameters."""
    ffn = 8 * hidden // 3
    per_layer = 4 * hidden * hidden + 4 * hidden + 2 * hidden * ffn + ffn + hidden + 4 * hidden
    return max(1, round((params - VOCAB * hidden - 2 * hidden) / per_layer))


def model_args(a) -> List[str]:
    return [
        "--hidden",
        str(a.hidden),
        "--layers",
        str(a.layers),
        "--seq-len",
        str(a.seq_len),
        "--global-batch",
        str(a.global_batch),
    ]


KIND = SwitchKind(WORKER, "pp", "PP", "pipeline_parallel", ours_load=True)


def print_table(results: List[dict], a) -> None:
    r0 = results[0]
    print(
        f"model: {r0['params'] / 1e6:.1f} M parameters (pipeline of a tied embedding, {a.layers} transformer layers "
        f"of hidden {a.hidden}, a norm; vocabulary {VOCAB}, sequence {a.seq_len}), ZeRO-1 fp32 AdamW, {a.world} "
        f"processes, global batch {a.global_batch}, micro-batch 1; switch after step {a.steps_before}"
    )
    print_switches(results, "PP", fmt)
    print_loads(results, "PP", fmt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("100M"), help="model size to aim at")
    ap.add_argument("--hidden", type=int, default=768, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=None, help="number of transformer layers (overrides --params)")
    common_arguments(ap, "PP")
    a = ap.parse_args(argv)
    if a.hidden % 64:
        ap.error("--hidden must be a multiple of 64")
    check_arguments(ap, a, "PP")
    if a.layers is None:
        a.layers = layers_for(a.params, a.hidden)
    return run_switches(KIND, a, model_args(a), print_table)


if __name__ == "__main__":
    sys.exit(main())
