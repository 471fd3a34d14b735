"""Worker of ``python -m benchmarks.pp_reconfig``: one process of one of its jobs (``--mode``).

Every job is ``WORLD_SIZE`` plain torch.distributed processes (env:// rendezvous, gloo) training
the same pipeline model (:func:`specs`: a token embedding tied to the head, ``--layers``
pre-norm transformer layers, a final norm; no dropout) with DeepSpeed's pipeline engine, ZeRO-1,
fp32 AdamW, micro-batch 1 and a global batch of ``--global-batch`` sequences: at PP ``p`` over
``w`` processes, DP rank ``r`` of ``d = w // p`` takes row ``i * d + r`` of the step's batch at
micro-step ``i``; the batch of step ``s`` comes from a generator seeded with ``s``.

Modes (rank 0 writes ``--out``, JSON; times in seconds, sizes in bytes):

* ``ours``: ``ds_dynatrain.initialize`` at PP ``--pp-from``; ``--steps-before`` steps;
  ``engine.resize(world, pipeline_parallel=--pp-to)``; ``--steps-after`` steps. The record,
  every iteration's time and loss, ``first_step_excess_s`` (the first iteration at the new PP
  minus the median of the later ones, at least 0), and per rank the resident set before and after
  the switch, its peak during it (``VmHWM`` after writing 5 to ``/proc/self/clear_refs``) and
  the rank's ZeRO-1 partition of the fp32 master and both moments before and after.
* ``ds-save``: plain ``deepspeed.initialize`` at PP ``--pp-from``; ``--steps`` steps;
  ``save_checkpoint`` (``save_s`` barrier to barrier).
* ``ds-load``: plain ``deepspeed.initialize`` at PP ``--pp-to`` with ``checkpoint.load_universal``;
  ``load_checkpoint`` of ``--tag``; ``--steps`` steps (the first on the batch of
  ``--first-step``). Wall-clock timestamps of the end of start-up, of the load and of the first
  step, and the losses.
* ``ours-load``: the same with ``ds_dynatrain.initialize`` at PP ``--pp-to`` loading the
  unconverted checkpoint ``ds-save`` wrote (a load across PP degrees).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.switch_worker import (  # noqa: E402
    load_route,
    measure_switch,
    parse_worker_args,
    run_mode_and_exit,
    save_route,
)
from benchmarks.tp_reconfig_worker import no_op_builds  # noqa: E402

VOCAB = 8192


class Embed(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, hidden) * 0.02)

    def forward(self, x):
        return nn.functional.embedding(x, self.weight)


def head(module, x):
    return x @ module.weight.t()


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def specs(hidden: int, layers: int):
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    block = dict(d_model=hidden, nhead=hidden // 64, dim_feedforward=8 * hidden // 3, dropout=0.0)
    return [
        TiedLayerSpec("embed", Embed, hidden),
        *(LayerSpec(nn.TransformerEncoderLayer, batch_first=True, norm_first=True, **block) for _ in range(layers)),
        LayerSpec(nn.LayerNorm, hidden),
        TiedLayerSpec("embed", Embed, hidden, forward_fn=head),
    ]


def build(a, pp: int):
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    return PipelineModule(
        layers=specs(a.hidden, a.layers), num_stages=pp, loss_fn=loss_fn, partition_method="parameters"
    )


def config(a, pp: int, plain: bool) -> dict:
    dp = int(os.environ["WORLD_SIZE"]) // pp
    cfg = {
        "train_batch_size": a.global_batch,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    if plain:
        cfg["gradient_accumulation_steps"] = a.global_batch // dp
    else:
        cfg["dynatrain"] = {}
    return cfg


def train_iteration(engine, step: int, a) -> tuple:
    """One ``train_batch`` on the batch of ``step``: (wall seconds, the loss)."""
    t0 = time.perf_counter()
    dp, d = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    batch = torch.randint(0, VOCAB, (a.global_batch, a.seq_len), generator=torch.Generator().manual_seed(step))
    rows = [batch[i * dp + d : i * dp + d + 1] for i in range(a.global_batch // dp)]
    loss = engine.train_batch(iter([(x, torch.roll(x, -1, 1)) for x in rows]))
    return time.perf_counter() - t0, float(loss.item())


def our_engine(a, pp: int):
    """``ds_dynatrain.initialize`` of the benchmark's pipeline at ``pp`` stages."""
    import ds_dynatrain

    no_op_builds()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    module = build(a, pp)
    engine, *_ = ds_dynatrain.initialize(
        model=module, model_parameters=module.parameters(), config=config(a, pp, False)
    )
    return engine


def run_ours(a) -> None:
    engine = our_engine(a, a.pp_from)
    params = sum(p.numel for p in engine._dt.pp_layout.params)
    world = int(os.environ["WORLD_SIZE"])
    train = lambda e, s: train_iteration(e, s, a)  # noqa: E731
    prepare = (lambda: engine.prepare_resize(world, pipeline_parallel=a.pp_to)) if a.prepare else None
    measure_switch(engine, a, params, train, train, lambda: engine.resize(world, pipeline_parallel=a.pp_to), prepare)


def plain_deepspeed(a, pp: int, load_universal: bool = False):
    import deepspeed

    no_op_builds()
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = config(a, pp, plain=True)
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    module = build(a, pp)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    return engine


def run_ds_save(a) -> None:
    save_route(plain_deepspeed(a, a.pp_from), a, lambda e, s: train_iteration(e, s, a), {})


def run_ds_load(a) -> None:
    if a.mode == "ours-load":  # the unconverted checkpoint, through ds_dynatrain's load across PP
        engine = our_engine(a, a.pp_to)
    else:
        engine = plain_deepspeed(a, a.pp_to, load_universal=True)
    load_route(engine, a, lambda e, s: train_iteration(e, s, a))


def main():
    a = parse_worker_args("pp", "PP", 17)
    run_mode_and_exit(a, {"ours": run_ours, "ds-save": run_ds_save, "ds-load": run_ds_load, "ours-load": run_ds_load})


if __name__ == "__main__":
    main()
