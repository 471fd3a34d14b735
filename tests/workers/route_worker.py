"""Test worker: ``deepspeed.initialize`` after ``import ds_dynatrain``, called the ways a DeepSpeed
script calls it, with a config *file* holding a ``"dynatrain"`` section; one process (run_plain).

``--case evaluation``: ``args.deepspeed_config`` names a ZeRO-3 config without an optimizer, no
``model_parameters``: DeepSpeed's own engine. ``--case path``: ``config=PATH`` with an optimizer in
it and no ``model_parameters``. ``--case args``: ``args.deepspeed_config`` with an optimizer in it
and no ``model_parameters``. Writes ``{"engine": class name}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402

import ds_dynatrain  # noqa: E402,F401

# DeepSpeed's own engine (a config without the section) starts deepspeed.comm, which on the CPU
# JIT-builds its shared-memory op (inference only; minutes on a fresh machine): skipped, as
# ds_dynatrain skips it for its engines (ds_dynatrain/zero/comm.py)
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=("evaluation", "path", "args"), required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    stage = 3 if a.case == "evaluation" else 2  # an engine without an optimizer: ZeRO-3 (Trainer's inference path)
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    cfg["dynatrain"] = {}
    if a.case != "evaluation":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    path = a.out + ".config.json"
    with open(path, "w") as f:
        json.dump(cfg, f)
    model = torch.nn.Linear(4, 4)
    if a.case == "path":
        engine, *_ = deepspeed.initialize(model=model, config=path)
    else:
        engine, *_ = deepspeed.initialize(args=argparse.Namespace(deepspeed_config=path), model=model)
    loss = engine(torch.ones(2, 4)).sum()
    if a.case != "evaluation":
        engine.backward(loss)
        engine.step()
    with open(a.out, "w") as f:
        json.dump({"engine": type(engine).__name__, "optimizer": type(engine.optimizer).__name__}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
