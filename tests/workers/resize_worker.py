"""Test worker: trains TinyLM and resizes through ``engine.resize`` at given steps, saving the
gathered state right before and right after each resize (rank 0), and optionally a DeepSpeed
checkpoint before a resize (the input of DeepSpeed's universal-checkpoint route, the oracle).

Started by ``dynatrain launch`` (which appends ``--deepspeed_config``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from ds_dynatrain.errors import ResizeRefusedError  # noqa: E402
from tests.workers.common import TinyLM, Tokens, allow_cpu_fp16, gather_state  # noqa: E402


def main():
    allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--resize", default="", help="STEP:WORLD,... resizes through engine.resize")
    p.add_argument("--ds-ckpt-at", default="", help="STEP,... save a DeepSpeed checkpoint before that resize")
    p.add_argument("--refuse-at", type=int, default=0, help="at this step, ask for impossible world sizes")
    p.add_argument(
        "--prepare",
        action="store_true",
        help="announce each resize with engine.prepare_resize and wait for its memory to be touched",
    )
    p.add_argument(
        "--joiner-width",
        type=int,
        default=0,
        help="a joining process builds TinyLM of this width (a model that does not match the job's)",
    )
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    resize = {int(s): int(w) for s, w in (x.split(":") for x in a.resize.split(",") if x)}
    ds_ckpt_at = {int(s) for s in a.ds_ckpt_at.split(",") if s}

    torch.manual_seed(0)
    joiner = os.environ.get("DYNATRAIN_JOIN") == "1"
    model = TinyLM(a.joiner_width) if joiner and a.joiner_width else TinyLM()
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=a.deepspeed_config
    )

    def save(tag):
        state = gather_state(engine)
        if engine.global_rank == 0:
            torch.save(state, os.path.join(a.out, f"{tag}.pt"))

    prepared = {}  # step -> bytes engine.prepare_resize announced before that step's resize, stayed
    if engine.global_steps > 0:  # a joiner: take part in the survivors' post-resize gather
        engine.wait_transition()
        save(f"after_{engine.global_steps}")
    while engine.is_member and engine.global_steps < a.steps:
        for batch in loader:
            before = engine.global_steps
            engine.backward(engine(batch))
            engine.step()
            s = engine.global_steps
            if s == before:
                continue
            if s == a.refuse_at:
                state0 = gather_state(engine)
                errors, prepare_errors = [], []
                for bad in (0, 5, 99):
                    for call, said in ((engine.prepare_resize, prepare_errors), (engine.resize, errors)):
                        try:
                            call(bad)
                            said.append(None)
                        except ResizeRefusedError as err:
                            said.append(str(err))
                state1 = gather_state(engine)
                same = all(
                    torch.equal(state0[k][kind], state1[k][kind])
                    for k in state0
                    if not k.startswith("__")
                    for kind in state0[k]
                )
                if engine.global_rank == 0:
                    with open(os.path.join(a.out, "refusals.json"), "w") as f:
                        json.dump(
                            {
                                "errors": errors,
                                "prepare_errors": prepare_errors,
                                "state_unchanged": same,
                                "world_size": engine.dp_world_size,
                                "held": engine._dt.switch_hold is not None,
                            },
                            f,
                        )
            if s in resize:
                if s in ds_ckpt_at:  # with DeepSpeed's default engine: ds_to_universal reads torch.save files
                    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

                    ours, engine.checkpoint_engine = engine.checkpoint_engine, TorchCheckpointEngine()
                    engine.save_checkpoint(
                        os.path.join(a.out, f"ds_ckpt_{s}"),
                        tag=f"global_step{s}",
                        client_state={"universal_checkpoint_info": {}},
                    )
                    engine.checkpoint_engine = ours
                save(f"before_{s}")
                if a.prepare:
                    prepared[s] = engine.prepare_resize(resize[s])  # touched in the background
                    hold, deadline = engine._dt.switch_hold, time.monotonic() + 60
                    while hold is not None and hold.touched < prepared[s] and time.monotonic() < deadline:
                        time.sleep(0.01)  # all of it touched: the record's figure is the whole hold
                engine.resize(resize[s])
                if a.prepare:
                    prepared[s] = {"bytes": prepared[s], "stayed": engine.is_member}
                if not engine.is_member:
                    break
                engine.wait_transition()  # the optimizer moments arrive in the background
                save(f"after_{s}")
            if s >= a.steps:
                break
    if engine.is_member:
        save("final")
    if a.prepare:
        with open(os.path.join(a.out, f"prepared_{os.environ['DYNATRAIN_MEMBER']}.json"), "w") as f:
            json.dump(prepared, f)
    return 0


def main_reporting_errors():
    """``main``, with this process's error (type and message) also written to
    ``OUT/error_<member>.txt``: the processes share one pipe, where tracebacks interleave."""
    try:
        return main()
    except ds_dynatrain.DynatrainError as err:
        out = sys.argv[sys.argv.index("--out") + 1]
        member = os.environ.get("DYNATRAIN_MEMBER", "unknown")
        with open(os.path.join(out, f"error_{member}.txt"), "w") as f:
            f.write(f"{type(err).__name__}: {err}")
        raise


if __name__ == "__main__":
    sys.exit(main_reporting_errors())
