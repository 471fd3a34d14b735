"""Test worker: trains TinyLM under ``dynatrain launch`` until ``--steps`` optimizer steps, a
little slowly (``--step-sleep``), so that resize requests and preemption notices arrive during
training. Writes its pid to ``--out/pid_<member>`` and, at the end, rank 0 writes the gathered
state to ``--out/final.pt``.

Holds, so that a test never races the job's progress:

* ``--hold STEP:FILE``: right after step STEP every process waits while FILE exists (the test
  removes it once it has done what it does at that step: a signal, a kill);
* ``--until FILE``: the job does not end while FILE exists: past ``--steps`` it trains on, and the
  members decide together, at each step boundary, whether to stop (one all-reduce), so they stop
  at the same step (the test removes FILE once every request it sends is answered).
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
from tests.workers.common import TinyLM, Tokens, allow_cpu_fp16, save_final_state  # noqa: E402


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


_DECIDED: dict = {}  # step -> this process's decision at that step boundary (made once)


def _go_on(engine, steps: int, until) -> bool:
    """Whether to train another step: below ``steps``, yes; past it, while ``until`` exists on some
    member. Collective then, once per step boundary (a second call at the same step, where an epoch
    ends, answers from the first): every member decides at the same boundary."""
    if engine.global_steps < steps:
        return True
    if until is None:
        return False
    if engine.global_steps not in _DECIDED:
        import torch.distributed as tdist

        flag = torch.tensor([1.0 if os.path.exists(until) else 0.0])
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        _DECIDED[engine.global_steps] = bool(flag.item() > 0)
    return _DECIDED[engine.global_steps]


def main():
    allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hold", default=None, help="STEP:FILE: right after step STEP, wait while FILE exists")
    p.add_argument("--until", default=None, help="FILE: past --steps, train on while FILE exists")
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
    hold_step, hold_file = (int(a.hold.split(":", 1)[0]), a.hold.split(":", 1)[1]) if a.hold else (None, None)
    # one call per process and step boundary: a joiner makes its first at the top of the loop, at the
    # step its survivors make theirs right after the step that resized
    while engine.is_member and _go_on(engine, a.steps, a.until):
        for batch in loader:
            engine.backward(engine(batch))
            engine.step()
            if a.resources and engine.is_member:
                _record_resources(a.out, engine)
            while engine.global_steps == hold_step and os.path.exists(hold_file):
                time.sleep(0.05)  # held: the test acts at this step, then removes the file
            time.sleep(a.step_sleep)
            if not engine.is_member or not _go_on(engine, a.steps, a.until):
                break
    if engine.is_member:
        save_final_state(engine, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
