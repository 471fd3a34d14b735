"""Test worker for jobs started by launchers other than ``dynatrain launch``: ``torchrun``,
DeepSpeed's launcher (``deepspeed``, which passes ``--local_rank=N``) and ``accelerate launch``.

Trains TinyLM with ``ds_dynatrain.initialize`` on the config the launcher's command line names
(``--deepspeed_config``, DeepSpeed's flag), to ``--steps``; the config's snapshot section saves
snapshots and its ``metrics_path`` gets the step records.

* ``--dump-at S``: after step S rank 0 writes the gathered state (DeepSpeed's ``safe_get_full_*``,
  collective) to ``--out/state_step<S>.pt``.
* ``--load DIR:TAG``: load that checkpoint right after ``initialize`` (at this world size,
  whatever the saving one), write the gathered state to ``--out/loaded.pt`` (rank 0), train on.
* ``--try-resize N``: after training every rank calls ``engine.resize(N)`` and records the
  exception it raised (type and message) in ``--out/resize_rank<R>.json``.

Every rank writes what it was started with (its rank, world size, local rank, the
``--local_rank`` argument) to ``--out/started_rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from tests.workers.common import TinyLM, Tokens, gather_state  # noqa: E402


def _write(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def main() -> int:
    import deepspeed
    import torch.distributed as tdist

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dump-at", type=int, default=0)
    p.add_argument("--load", default=None, help="DIR:TAG")
    p.add_argument("--try-resize", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
    p = deepspeed.add_config_arguments(p)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()

    torch.manual_seed(0)
    model = TinyLM()
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=a.deepspeed_config
    )
    rank = tdist.get_rank()
    _write(
        os.path.join(a.out, f"started_rank{rank}.json"),
        {
            "rank": rank,
            "world_size": tdist.get_world_size(),
            "local_rank_env": os.environ.get("LOCAL_RANK"),
            "local_rank_arg": a.local_rank,
        },
    )
    if a.load:
        directory, tag = a.load.rsplit(":", 1)
        engine.load_checkpoint(directory, tag)
        state = gather_state(engine)
        if rank == 0:
            torch.save(state, os.path.join(a.out, "loaded.pt"))
    while engine.global_steps < a.steps:
        for batch in loader:
            engine.backward(engine(batch))
            engine.step()
            if engine.global_steps == a.dump_at:
                state = gather_state(engine)
                if rank == 0:
                    torch.save(state, os.path.join(a.out, f"state_step{a.dump_at}.pt"))
            if engine.global_steps >= a.steps:
                break
    if a.try_resize:
        try:
            engine.resize(a.try_resize)
            err = None
        except Exception as e:  # recorded for the test, which expects a ResizeRefusedError
            err = {"type": type(e).__name__, "message": str(e)}
        _write(os.path.join(a.out, f"resize_rank{rank}.json"), {"error": err, "world_size": engine.dp_world_size})
    if hasattr(engine.checkpoint_engine, "wait"):
        engine.checkpoint_engine.wait()  # the last snapshot committed before the process exits
    return 0


if __name__ == "__main__":
    sys.exit(main())
