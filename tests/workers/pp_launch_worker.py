"""A pipeline job under ``dynatrain launch`` (``tests/test_pp_launch.py``).

The script starts ``torch.distributed`` itself (``deepspeed.init_distributed()``), builds the
``PipelineModule`` of :mod:`pp_switch_worker` at PP 2 when its world is even, else PP 1, and trains
``--steps`` steps with ``train_batch`` on the batch of each step (DP rank ``r`` of ``d`` takes row
``i * d + r`` at micro-step ``i``), one snapshot a step (the config's). Rank 0 appends
``{"step", "loss", "world", "pp", "generation"}`` per step to ``--out``/``steps.jsonl``.

``--request``: rank 0 asks ``dynatrain resize --world-size W --tensor-parallel 1`` after step 1
and ``dynatrain resize --world-size W --pipeline-parallel 1`` after step 2 (``W``: its world),
each in a process of its own, queued before the next step, whose boundary answers it (the first
refused, the second served), and writes each requester's exit status and output to
``request.json``.

``--hold-at K --flag F``: every rank writes ``held_<rank>`` after step ``K`` and waits for ``F``.

``--preempt-at K``: the last rank of the first generation sends itself SIGTERM after step ``K``
(a preemption notice). ``--shrink-at K``: rank 0 asks ``dynatrain resize --world-size 1`` after
step ``K`` (answered at the next step's boundary; rank 0 does not wait for the requester).

``--kill-at K``: in the first generation, rank 1 waits for the snapshot of step ``K`` and kills
itself with SIGKILL (a worker dying without notice: the fault injected at this seam);
the launcher restarts the job on the one process left, which restores the snapshot at PP 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as tdist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.workers.pipeline_layout_worker import VOCAB  # noqa: E402
from tests.workers.pp_switch_worker import GLOBAL_BATCH, SEQ, module_at  # noqa: E402


def _request(engine, args, index: int):
    """``dynatrain resize ARGS`` in a process of its own, returned once its request ``index`` is
    queued in the job's store (so the next step's boundary answers it)."""
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "resize", "--store", os.environ["DYNATRAIN_STORE"]]
    proc = subprocess.Popen(
        [*cmd, *args, "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 90
    while engine._dt.membership.pending_request(index) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--preempt-at", type=int, default=0, help="the last rank of generation 0 gets SIGTERM after it")
    p.add_argument("--shrink-at", type=int, default=0, help="rank 0 asks for one process after this step")
    p.add_argument("--request", action="store_true")
    p.add_argument("--hold-at", type=int, default=0, help="after this step, wait for --flag to exist")
    p.add_argument("--flag", default="")
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    import deepspeed

    import ds_dynatrain

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    module = module_at(2 if world % 2 == 0 else 1, "parameters")
    with open(a.deepspeed_config) as f:
        cfg = json.load(f)
    engine, *_ = ds_dynatrain.initialize(model=module, model_parameters=module.parameters(), config=cfg)
    generation = int(os.environ["DYNATRAIN_GEN"])
    requests, answers = [], []
    while engine.is_member and engine.global_steps < a.steps:
        s = engine.global_steps
        dp, d = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
        batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(s))
        rows = [batch[i * dp + d : i * dp + d + 1] for i in range(GLOBAL_BATCH // dp)]
        loss = float(engine.train_batch(iter([(x, torch.roll(x, -1, 1)) for x in rows])))
        if not engine.is_member:  # it left the job at this step's boundary (a shrink without it)
            break
        step, rank = engine.global_steps, tdist.get_rank()
        if rank == 0:
            with open(os.path.join(a.out, "steps.jsonl"), "a") as f:
                rec = {"step": step, "loss": loss, "world": tdist.get_world_size(), "pp": engine._dt.pp_layout.pp}
                f.write(json.dumps({**rec, "generation": generation}) + "\n")
            if a.request and step in (1, 2):  # a TP degree (refused), then PP 1 at its world (served)
                degree = ["--tensor-parallel", "1"] if step == 1 else ["--pipeline-parallel", "1"]
                requests.append(_request(engine, ["--world-size", str(world), *degree], step - 1))
            if a.request and step in (2, 3):
                out, _ = requests[step - 2].communicate(timeout=90)
                answers.append({"returncode": requests[step - 2].returncode, "output": out})
                with open(os.path.join(a.out, "request.json"), "w") as f:
                    json.dump(answers, f)
        if step == a.hold_at:  # held until the test has signalled the launcher
            open(os.path.join(a.out, f"held_{rank}"), "w").close()
            while not os.path.exists(a.flag):
                time.sleep(0.1)
        if generation == 0 and rank == world - 1 and step == a.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice: taken at the next step's boundary
        if rank == 0 and step == a.shrink_at:
            requests.append(_request(engine, ["--world-size", "1"], engine._dt.membership.served()))
        if generation == 0 and rank == 1 and step == a.kill_at:
            engine.checkpoint_engine.wait()  # the snapshot of this step is committed
            os.kill(os.getpid(), signal.SIGKILL)  # FAULT: a worker dies without notice


if __name__ == "__main__":
    main()
