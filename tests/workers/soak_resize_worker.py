"""Soak worker: TinyLM at ZeRO-2 under ``dynatrain launch``, resized by the config's schedule, held
at given steps so the test can measure every process there (``tests/soak/test_soak_resize_cycles.py``).

Writes its pid to ``--out/pid_<member>``. Right after each step of ``--hold-at`` every member
writes ``--out/held_<step>_<member>`` and waits until ``--out/release_<step>`` exists (the test
creates it once it has read the processes' file descriptors, threads and memory), so the
measurement never races the job. The losses are in the metrics file of the config.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from tests.workers.common import TinyLM, Tokens  # noqa: E402

HOLD_TIMEOUT_S = 900


def hold(out: str, step: int) -> None:
    """Tell the test this member is at ``step``; wait for its release (exit 3 after
    :data:`HOLD_TIMEOUT_S`: the test is gone)."""
    member = os.environ["DYNATRAIN_MEMBER"]
    with open(os.path.join(out, f"held_{step}_{member}"), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not os.path.exists(os.path.join(out, f"release_{step}")):
        if time.monotonic() > deadline:
            print(f"member {member}: not released at step {step} within {HOLD_TIMEOUT_S} s", flush=True)
            os._exit(3)
        time.sleep(0.05)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--hold-at", default="", help="comma-separated steps to hold at")
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    holds = {int(s) for s in a.hold_at.split(",") if s}
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    with open(os.path.join(a.out, f"pid_{os.environ['DYNATRAIN_MEMBER']}"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = TinyLM()
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=a.deepspeed_config
    )
    while engine.is_member and engine.global_steps < a.steps:
        for batch in loader:
            engine.backward(engine(batch))
            engine.step()
            if engine.is_member and engine.global_steps in holds:
                hold(a.out, engine.global_steps)
            if not engine.is_member or engine.global_steps >= a.steps:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
