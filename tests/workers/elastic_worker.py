"""Test worker: trains TinyLM under ``dynatrain launch`` until ``--steps`` optimizer steps, a
little slowly (``--step-sleep``), so that resize requests and preemption notices arrive during
training. Writes its pid to ``--out/pid_<member>`` and, at the end, rank 0 writes the gathered
state to ``--out/final.pt``.
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
from tests.workers.common import TinyLM, Tokens, gather_state  # noqa: E402


def _record_resources(out: str, engine) -> None:
    import json

    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    rec = {
        "step": engine.global_steps,
        "world_size": engine.dp_world_size,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"]),
        "rss": int(status["VmRSS"].split()[0]) * 1024,
    }
    with open(os.path.join(out, f"res_{os.environ['DYNATRAIN_MEMBER']}"), "a") as f:
        f.write(json.dumps(rec) + "\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument(
        "--slow-while",
        default=None,
        help="while this file exists, sleep 2 s after each step instead of --step-sleep (the test gives "
        "requests from outside wall time that does not depend on how fast its processes start)",
    )
    p.add_argument("--load", default=None, help="DIR:TAG of a snapshot to load right after initialize")
    p.add_argument(
        "--resources",
        action="store_true",
        help="after every step, append this process's open fds, threads and RSS to --out/res_<member>",
    )
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    with open(os.path.join(a.out, f"pid_{os.environ['DYNATRAIN_MEMBER']}"), "w") as f:
        f.write(str(os.getpid()))
    torch.manual_seed(0)
    model = TinyLM()
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=a.deepspeed_config
    )
    if a.load:
        d, tag = a.load.rsplit(":", 1)
        engine.load_checkpoint(d, tag=tag)
    while engine.is_member and engine.global_steps < a.steps:
        for batch in loader:
            engine.backward(engine(batch))
            engine.step()
            if a.resources and engine.is_member:
                _record_resources(a.out, engine)
            time.sleep(2.0 if a.slow_while and os.path.exists(a.slow_while) else a.step_sleep)
            if engine.global_steps >= a.steps:
                break
    if engine.is_member:
        state = gather_state(engine)
        if engine.global_rank == 0:
            torch.save(state, os.path.join(a.out, "final.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
