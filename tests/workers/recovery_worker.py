"""Test worker: TinyLM under ``dynatrain launch`` with peer replicas on; one member kills itself with
SIGKILL at a chosen moment, or (the oracle) the job resizes 4 -> 3 removing that member.

* ``--kill MEMBER:STEP:POINT``: the process MEMBER (``g0r2``: launch rank 2) dies (SIGKILL, real) at POINT of the
  step after optimizer step STEP: ``between`` (right after step STEP returned), ``forward``
  (inside the model's forward of its second micro-batch), ``backward`` (inside the autograd of
  its last micro-batch, where ZeRO reduces gradients), ``step`` (inside the optimizer step, after
  its own partition was updated and before the all-gather: a torch optimizer step post-hook);
  at these three the process first lets its replica refresh of step STEP end (on this tiny model a
  step is shorter than a refresh, on a real one it is the other way round);
  ``refresh`` (in the replica refresh of step STEP, before the payload is sent: the replica
  transport's fault seam); ``transfer`` (in the transfer of a resize at step STEP, before its first
  chunk is posted: the transition's fault seam). Several kills: the option repeated.
* ``--oracle STEP:RANK[,RANK]``: right after step STEP every member calls
  ``engine.resize(4 - number of RANKs, must_leave=(their members))``.

Writes ``--out/losses_<member>.json`` (step -> loss, the vote's mean over ranks) and, at the end,
rank 0 writes the gathered state (``save_final_state``) to ``--out/final.pt``. With ``--rss`` every
member appends ``(step, RSS bytes)`` to ``--out/rss_<member>``. Every process that ends normally
writes, from an exit hook registered before ``initialize`` (so it runs after the library's own),
the names of its OS threads to ``--out/threads_<member>``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from tests.workers.common import TinyLM, Tokens, record_threads_at_exit, save_final_state  # noqa: E402

_ENGINE = []


def _die(settled: bool = True) -> None:
    """SIGKILL this process; ``settled``: first let this rank's replica refresh end (its holder then
    has the step's replica, as on a model whose step outlasts the refresh)."""
    if settled and _ENGINE and _ENGINE[0]._dt.replicas is not None:
        _ENGINE[0]._dt.replicas.settle(30.0)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(engine, model, point: str, step: int) -> None:
    """SEAMS: where this process kills itself (the kill is real)."""
    state = {"micro": 0}
    if point == "forward":

        def pre(_m, _inp):
            if engine.global_steps == step:
                state["micro"] += 1
                if state["micro"] == 2:
                    _die()

        model.register_forward_pre_hook(pre)
    elif point == "step":

        def post(_opt, _args, _kwargs):
            if engine.global_steps == step:
                _die()

        engine.optimizer.optimizer.register_step_post_hook(post)
    elif point == "refresh":
        import ds_dynatrain.transition.replicas as replicas

        def hook(at_step: int) -> None:
            if at_step == step:
                _die(settled=False)  # in the refresh thread itself, before the payload is posted

        replicas.fault_hook = hook
    elif point == "transfer":
        import ds_dynatrain.transition.execute as execute

        def in_transfer(_plan_step: int, _chunk: int) -> None:
            if engine.global_steps == step:
                _die()

        execute.fault_hook = in_transfer


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--kill", action="append", default=[], help="MEMBER:STEP:POINT")
    p.add_argument("--oracle", default=None, help="STEP:RANK")
    p.add_argument("--rss", action="store_true")
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()
    member = os.environ["DYNATRAIN_MEMBER"]
    atexit.register(record_threads_at_exit, os.path.join(a.out, f"threads_{member}"))  # after the library's
    torch.manual_seed(0)
    model = TinyLM()
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=a.deepspeed_config
    )
    _ENGINE.append(engine)
    kill_at = {}
    for k in a.kill:
        who, s, point = k.split(":")
        if who == member:
            kill_at = {"step": int(s), "point": point}
            _arm(engine, model, point, int(s))
    oracle = None
    if a.oracle:
        at, ranks = a.oracle.split(":")
        oracle = (int(at), tuple(f"g0r{x}" for x in ranks.split(",")))
    losses = {}
    while engine.is_member and engine.global_steps < a.steps:
        for batch in loader:
            loss = engine(batch)
            if kill_at.get("point") == "backward" and engine.global_steps == kill_at["step"]:
                if engine.is_gradient_accumulation_boundary():
                    loss.register_hook(lambda g: _die())
            engine.backward(loss)
            engine.step()
            if engine._dt.step_losses:
                s, value = engine._dt.step_losses[-1]
                losses[s] = value
            if kill_at.get("point") == "between" and engine.global_steps == kill_at["step"]:
                _die(settled=False)  # at once: the refresh of the step may be cut
            if a.rss:
                with open(os.path.join(a.out, f"rss_{member}"), "a") as f:
                    f.write(json.dumps([engine.global_steps, _rss()]) + "\n")
            if oracle and engine.global_steps == oracle[0] and engine.dp_world_size == 4:
                engine.resize(4 - len(oracle[1]), must_leave=oracle[1])
            if not engine.is_member or engine.global_steps >= a.steps:
                break
    if engine.is_member:
        with open(os.path.join(a.out, f"losses_{member}.json"), "w") as f:
            json.dump(losses, f)
        save_final_state(engine, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
