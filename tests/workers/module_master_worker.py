"""Test worker: a ZeRO-1/2 snapshot leaves the working parameters to the fp32 master.

Trains TinyLM (or ``--model groups``: GroupsLM, below) 3 optimizer steps and saves the same step
twice: ``OUT/stripped`` as the plugin writes it (``snapshot.module_from_master``, the default)
and ``OUT/whole`` with the engine's ``module_from_master`` emptied (a SEAM: the same engine writes
every ``module`` entry). Rank 0
writes the working parameters gathered at that step (``OUT/oracle.pt``, torch's format: the test's
oracle). Then it trains to step 5, loads ``OUT/stripped`` at the same world size (DeepSpeed's
own load, the module state read from the stripped file) and writes the gathered state before and
after (``OUT/result.json``: ``equal``); it saves ``OUT/after_load`` at once (tag ``l3``) and after
the next step (``l4``).
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from tests.workers.common import TinyLM, Tokens, allow_cpu_fp16, gather_state, train_to  # noqa: E402
from tests.workers.groups_worker import GroupsLM, param_groups  # noqa: E402


def main():
    out, cfg_path = sys.argv[1], sys.argv[sys.argv.index("--deepspeed_config") + 1]
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    groups = "--model" in sys.argv and sys.argv[sys.argv.index("--model") + 1] == "groups"
    if groups:
        allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    torch.manual_seed(0)
    model = GroupsLM() if groups else TinyLM()
    engine, _o, loader, _s = ds_dynatrain.initialize(
        model=model,
        model_parameters=param_groups(model) if groups else model.parameters(),
        training_data=Tokens(),
        config=cfg_path,
    )
    it = iter(loader)

    train_to(engine, it, 3)
    ce = engine.checkpoint_engine
    listed = dict(ce.module_from_master)  # name -> shape
    engine.save_checkpoint(os.path.join(out, "stripped"), tag="s3")
    ce.wait()
    ce.module_from_master = {}  # SEAM: the same engine writing every module entry
    engine.save_checkpoint(os.path.join(out, "whole"), tag="s3")
    ce.wait()
    ce.module_from_master = listed
    at_3 = gather_state(engine)
    if engine.global_rank == 0:
        torch.save({n: v["param"] for n, v in at_3.items() if not n.startswith("__")}, os.path.join(out, "oracle.pt"))
    train_to(engine, it, 5)
    engine.load_checkpoint(os.path.join(out, "stripped"), tag="s3")
    back, loaded_step = gather_state(engine), engine.global_steps
    # right after a load the module is written whole; after the next step it is left to the master
    engine.save_checkpoint(os.path.join(out, "after_load"), tag="l3")
    train_to(engine, it, 4)
    engine.save_checkpoint(os.path.join(out, "after_load"), tag="l4")
    ce.wait()
    equal = all(
        torch.equal(at_3[n][kind], back[n][kind])
        for n in at_3
        if not n.startswith("__")
        for kind in ("param", "fp32", "exp_avg", "exp_avg_sq")
    )
    if engine.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(
                {"listed": sorted(listed), "equal": equal, "step": loaded_step, "skipped": engine.skipped_steps}, f
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
