"""Test worker for the launcher's life: trains TinyLM under ``dynatrain launch``.

* ``--hold-at S --flag FILE``: after step S every rank writes ``--out/held_<member>`` and waits
  until FILE exists (the test signals the launcher meanwhile: the job never races the test).
* A stop of the job (``engine.step()`` raises ``SystemExit``): rank 0 writes the gathered state to
  ``--out/stopped.pt`` (collective: every rank gathers), then the process goes on exiting.
* ``--init-distributed``: the script starts ``torch.distributed`` itself, as DeepSpeed's docs show
  (``deepspeed.init_distributed()``), before ``ds_dynatrain.initialize``; what it saw is written to
  ``--out/init_<member>.json``.
* ``--load DIR:TAG``: load that snapshot right after ``initialize``, write the gathered state to
  ``--out/loaded.pt`` (rank 0) and end.
* Every process writes, from an exit hook registered before ``initialize`` (so it runs after the
  library's own), the names of its OS threads to ``--out/threads_<member>``.

At the end of training rank 0 writes the gathered state to ``--out/final.pt``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from tests.workers.common import TinyLM, Tokens, gather_state, record_threads_at_exit, save_final_state  # noqa: E402


def _init_distributed(out: str, member: str) -> None:
    import deepspeed
    import torch.distributed as tdist

    deepspeed.init_distributed()
    seen = {"rank": tdist.get_rank(), "world_size": tdist.get_world_size(), "joiner": os.environ["DYNATRAIN_JOIN"]}
    t = torch.ones(1)
    tdist.all_reduce(t)  # the script's own group works: a real one over the processes started together
    seen["all_reduce"] = float(t.item())
    with open(os.path.join(out, f"init_{member}.json"), "w") as f:
        json.dump(seen, f)


def _hold(a, member: str) -> None:
    with open(os.path.join(a.out, f"held_{member}"), "w") as f:
        f.write("")
    deadline = time.monotonic() + 300
    while not os.path.exists(a.flag):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{a.flag} did not appear")
        time.sleep(0.05)


def _step(engine, out: str) -> None:
    try:
        engine.step()
    except SystemExit:
        state = gather_state(engine)  # the state the job stopped with (its process group still works)
        if engine.global_rank == 0:
            torch.save(state, os.path.join(out, "stopped.pt"))
        raise


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hold-at", type=int, default=None)
    p.add_argument("--flag", default=None)
    p.add_argument("--init-distributed", action="store_true")
    p.add_argument("--load", default=None)
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    member = os.environ["DYNATRAIN_MEMBER"]
    atexit.register(
        record_threads_at_exit, os.path.join(a.out, f"threads_{member}")
    )  # runs after the library's exit hooks
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()
    with open(os.path.join(a.out, f"pid_{member}"), "w") as f:
        f.write(str(os.getpid()))
    if a.init_distributed:
        _init_distributed(a.out, member)
    torch.manual_seed(0)
    model = TinyLM()
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=a.deepspeed_config
    )
    if a.load:
        d, tag = a.load.rsplit(":", 1)
        engine.load_checkpoint(d, tag=tag)
        state = gather_state(engine)
        if engine.global_rank == 0:
            torch.save(state, os.path.join(a.out, "loaded.pt"))
        return 0
    while engine.is_member and engine.global_steps < a.steps:
        for batch in loader:
            engine.backward(engine(batch))
            _step(engine, a.out)
            if a.hold_at is not None and engine.global_steps == a.hold_at:
                _hold(a, member)
            if engine.global_steps >= a.steps:
                break
    if engine.is_member:
        save_final_state(engine, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
