"""Test worker for DeepSpeed's own route (the oracle): a plain ``deepspeed.initialize`` at a new
world size loads a universal checkpoint made by ``ds_to_universal`` and saves the gathered state.

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment (no dynatrain launcher).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.workers.common import TinyLM, allow_cpu_fp16, exit_without_teardown, gather_state  # noqa: E402


def main():
    allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    import deepspeed
    import deepspeed.ops

    # as ds_dynatrain.initialize does: DeepSpeed's CPU shared-memory op is for inference only, and
    # its JIT build can leave a stale lock behind (see ds_dynatrain/initialize.py)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--load-dir", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    with open(a.config) as f:
        cfg = json.load(f)
    cfg.pop("dynatrain", None)
    ws = int(os.environ["WORLD_SIZE"])
    cfg["gradient_accumulation_steps"] = cfg["train_batch_size"] // (cfg["train_micro_batch_size_per_gpu"] * ws)
    cfg["checkpoint"] = {"load_universal": True}
    torch.manual_seed(123)  # different init: everything must come from the checkpoint
    model = TinyLM()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.load_checkpoint(a.load_dir, tag=a.tag)
    state = gather_state(engine)
    if engine.global_rank == 0:
        torch.save(state, a.out)
    import torch.distributed as tdist

    tdist.destroy_process_group()  # left to interpreter teardown, gloo may abort the process
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
