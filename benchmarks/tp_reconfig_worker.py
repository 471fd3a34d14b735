"""Worker of ``python -m benchmarks.tp_reconfig``: one process of one of its jobs (``--mode``).

Every job is ``WORLD_SIZE`` plain torch.distributed processes (env:// rendezvous, gloo). The
global batch is ``--global-batch`` sequences a step, micro-batch 1: at TP ``t`` over ``w``
processes, DP rank ``r = rank // t`` of ``d = w // t`` takes row ``i * d + r`` of the step's batch
at micro-step ``i`` (every TP rank of a DP rank the same rows); the batch of step ``s`` is drawn
from a generator seeded with ``s``, so every job trains on the same tokens at the same step.

Modes (rank 0 writes ``--out``, JSON; times in seconds, sizes in bytes):

* ``ours``: ``ds_dynatrain.initialize`` at TP ``--tp-from`` (``tensor_parallel.autotp_size``;
  1: not cut, still switchable); ``--steps-before`` steps; ``engine.resize(world,
  tensor_parallel=--tp-to)``; ``--steps-after`` steps. Writes the switch's record, every
  iteration's time and loss, ``first_step_excess_s`` (the first iteration at the new TP minus the
  median of the later ones, at least 0), and per rank: the resident set before and after the
  switch and its peak during it (``VmHWM`` after resetting it with ``/proc/self/clear_refs`` right
  before the call, as ``ds_dynatrain.engine.pending.start_peak_rss`` does), and the rank's ZeRO
  partition of the fp32 master and both Adam moments before and after (``state_bytes``).
* ``ds-save``: plain ``deepspeed.initialize`` at TP ``--tp-from`` (DeepSpeed counts the batch over
  every process, TP ranks included, so the accumulation steps of the DP size are given, not the
  global batch); ``--steps`` steps; ``save_checkpoint`` with no client state (AutoTP's own
  ``universal_checkpoint_info`` goes into the checkpoint); ``save_s`` barrier to barrier.
* ``ds-load``: plain ``deepspeed.initialize`` at TP ``--tp-to`` with ``checkpoint.load_universal``;
  ``load_checkpoint`` of ``--tag``; ``--steps`` steps (the first on the batch of step
  ``--first-step``). Wall-clock timestamps (``time.time()``) of the end of start-up, of the load
  and of the first step, and the losses.
* ``ours-load``: the same with ``ds_dynatrain.initialize`` at TP ``--tp-to`` loading the
  unconverted checkpoint of ``ds-save`` (a load across TP degrees, no ``ds_to_universal``).
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.reconfig_worker import VOCAB, build_model  # noqa: E402
from benchmarks.switch_worker import (  # noqa: E402
    load_route,
    measure_switch,
    parse_worker_args,
    run_mode_and_exit,
    save_route,
)


def step_batch(step: int, rows: int, seq_len: int) -> torch.Tensor:
    """The global batch of optimizer step ``step`` (0-based): the same in every job and rank."""
    return torch.randint(0, VOCAB, (rows, seq_len), generator=torch.Generator().manual_seed(step))


def train_iteration(engine, step: int, a, tp: int) -> tuple:
    """One optimizer step on the batch of ``step``. Returns (wall seconds, mean loss over the
    global batch)."""
    import torch.distributed as tdist

    t0 = time.perf_counter()
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dp, dp_rank = world // tp, rank // tp
    batch = step_batch(step, a.global_batch, a.seq_len)
    total = torch.zeros(())
    gas = a.global_batch // dp
    for i in range(gas):
        x = batch[i * dp + dp_rank : i * dp + dp_rank + 1]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    dt = time.perf_counter() - t0
    tdist.all_reduce(total)  # every TP rank of a DP rank holds the same loss
    return dt, (total / (gas * world)).item()


def ds_config(a, tp: int, plain: bool) -> dict:
    """The benchmark's DeepSpeed config at TP ``tp`` (ZeRO-2, fp32, AdamW, micro-batch 1)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True, "fused": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
    }
    if plain:
        cfg["gradient_accumulation_steps"] = a.global_batch // (int(os.environ["WORLD_SIZE"]) // tp)
        if tp > 1:
            cfg["tensor_parallel"] = {"autotp_size": tp}
    else:
        cfg["train_batch_size"] = a.global_batch
        cfg["tensor_parallel"] = {"autotp_size": tp}
        cfg["dynatrain"] = {}
    return cfg


def no_op_builds() -> None:
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ op build on CPU


def run_ours(a) -> None:
    import ds_dynatrain

    no_op_builds()
    model = build_model(a.hidden, a.layers, a.seq_len, a.kv_heads)
    params = sum(p.numel() for p in model.parameters())
    engine, *_ = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(a, a.tp_from, plain=False)
    )
    del model  # engine.module is the model; after the switch it is a new one
    world = int(os.environ["WORLD_SIZE"])
    measure_switch(
        engine,
        a,
        params,
        lambda e, s: train_iteration(e, s, a, a.tp_from),
        lambda e, s: train_iteration(e, s, a, a.tp_to),
        lambda: engine.resize(world, tensor_parallel=a.tp_to),
        (lambda: engine.prepare_resize(world, tensor_parallel=a.tp_to)) if a.prepare else None,
    )


def plain_deepspeed(a, tp: int, load_universal: bool = False):
    import deepspeed

    no_op_builds()
    cfg = ds_config(a, tp, plain=True)
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    model = build_model(a.hidden, a.layers, a.seq_len, a.kv_heads)
    params = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine, params


def run_ds_save(a) -> None:
    engine, params = plain_deepspeed(a, a.tp_from)
    save_route(engine, a, lambda e, s: train_iteration(e, s, a, a.tp_from), {"params": params})


def run_ds_load(a) -> None:
    if a.mode == "ours-load":  # the unconverted checkpoint, through ds_dynatrain's load across TP
        import ds_dynatrain

        no_op_builds()
        model = build_model(a.hidden, a.layers, a.seq_len, a.kv_heads)
        engine, *_ = ds_dynatrain.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(a, a.tp_to, plain=False)
        )
        del model
    else:
        engine, _params = plain_deepspeed(a, a.tp_to, load_universal=True)
    load_route(engine, a, lambda e, s: train_iteration(e, s, a, a.tp_to))


def main():
    a = parse_worker_args("tp", "TP", 14, [("--kv-heads", int, 4)])
    run_mode_and_exit(a, {"ours": run_ours, "ds-save": run_ds_save, "ds-load": run_ds_load, "ours-load": run_ds_load})


if __name__ == "__main__":
    main()
