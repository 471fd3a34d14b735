"""A pipeline job under ``dynatrain launch`` (``tests/test_pp_launch.py``).

The script starts ``torch.distributed`` itself (``deepspeed.init_distributed()``), builds the
``PipelineModule`` of :mod:`pp_switch_worker` at PP 2 when its world is even, else PP 1, and trains
``--steps`` steps with ``train_batch`` on the batch of each step (DP rank ``r`` of ``d`` takes row
``i * d + r`` at micro-step ``i``), one snapshot a step (the config's). Rank 0 appends
``{"step", "loss", "world", "pp", "generation"}`` per step to ``--out``/``steps.jsonl``
(rank 0 before and after the step: a grow may give rank 0 to a joiner, a shrink take it from a
leaver; a step may so be written twice).

``--request``: rank 0 asks ``dynatrain resize --world-size W --tensor-parallel 1`` after step 1
and ``dynatrain resize --world-size W --pipeline-parallel 1`` after step 2 (``W``: its world),
each in a process of its own, queued before the next step, whose boundary answers it (the first
refused, the second served), and writes each requester's exit status and output to
``request.json``.

``--hold-at K --flag F``: every rank writes ``held_<rank>`` after step ``K`` and waits for ``F``.

``--preempt-at K``: the last rank of the first generation sends itself SIGTERM after step ``K``
(a preemption notice). ``--shrink-at K``: rank 0 asks ``dynatrain resize --world-size 1`` (or
``--shrink-to W``) after step ``K`` (answered at the next step's boundary; rank 0 does not wait for the requester).

``--grow-at K --grow-to W [--grow-pp P] --shrink-after N``: rank 0 asks ``dynatrain resize
--world-size W [--pipeline-parallel P]`` after step ``K`` (a grow: the launcher starts the new
processes, each builds the module at PP 1 in its world of one; the job prepares the new world
while it trains and switches once it is ready, at a step the test does not know), writes the
requester's exit status and output to ``grow.json`` once the world has grown, and (the same
process, wherever its rank went) asks for ``--shrink-to`` processes ``N`` steps after that; the
job ends one step after that shrink (``--steps``: at most). While a grow is being prepared every
step sleeps 1 s after it (as long as a real step, so the joiners' start-up spans a few steps, not
dozens).

``--data``: the training data is handed to ``initialize`` (:class:`pp_switch_worker.Numbered`, 16
samples: an epoch of 4 steps, each shuffled anew) and ``train_batch()`` reads it, in the global sample order whatever
the layout; else each step's batch is made here and passed as ``data_iter``.

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
from tests.workers.pp_switch_worker import GLOBAL_BATCH, SEQ, Numbered, module_at  # noqa: E402


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
    p.add_argument("--switch-at", type=int, default=0, help="rank 0 asks for PP 1 at the world size after this step")
    p.add_argument("--request", action="store_true")
    p.add_argument("--data", action="store_true", help="the training data handed to initialize")
    p.add_argument("--grow-at", type=int, default=0, help="rank 0 asks for --grow-to processes after this step")
    p.add_argument("--grow-to", type=int, default=0)
    p.add_argument("--grow-pp", type=int, default=0)
    p.add_argument("--shrink-to", type=int, default=1)
    p.add_argument("--shrink-after", type=int, default=0, help="ask for --shrink-to this many steps after a grow")
    p.add_argument("--hold-at", type=int, default=0, help="after this step, wait for --flag to exist")
    p.add_argument("--flag", default="")
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    import deepspeed

    import ds_dynatrain

    ds_dynatrain.log_to_console()
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    module = module_at(2 if world % 2 == 0 else 1, "parameters")
    with open(a.deepspeed_config) as f:
        cfg = json.load(f)
    data = Numbered(4 * GLOBAL_BATCH) if a.data else None
    engine, *_ = ds_dynatrain.initialize(
        model=module, model_parameters=module.parameters(), config=cfg, training_data=data
    )
    if data is not None:
        data.engine = engine  # it logs the step of each fetch
    generation = int(os.environ["DYNATRAIN_GEN"])
    requests, answers, grow, switch = [], [], None, None
    grown_at = 0 if generation == 0 else 1  # a joiner comes into the grown world
    shrunk_at = 0
    while engine.is_member and engine.global_steps < a.steps and not (shrunk_at and engine.global_steps > shrunk_at):
        s = engine.global_steps
        dp, d = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
        batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(s))
        rows = [batch[i * dp + d : i * dp + d + 1] for i in range(GLOBAL_BATCH // dp)]
        before = tdist.get_rank()  # rank 0 before and after the step write its record (a change may move rank 0)
        given = None if a.data else iter([(x, torch.roll(x, -1, 1)) for x in rows])
        loss = float(engine.train_batch(given))
        if not engine.is_member:  # it left the job at this step's boundary (a shrink without it)
            break
        step, rank = engine.global_steps, tdist.get_rank()
        if 0 in (before, rank):
            with open(os.path.join(a.out, "steps.jsonl"), "a") as f:
                rec = {"step": step, "loss": loss, "world": tdist.get_world_size(), "pp": engine._dt.pp_layout.pp}
                f.write(json.dumps({**rec, "generation": generation}) + "\n")
        if rank == 0:
            if a.request and step in (1, 2):  # a TP degree (refused), then PP 1 at its world (served)
                degree = ["--tensor-parallel", "1"] if step == 1 else ["--pipeline-parallel", "1"]
                requests.append(_request(engine, ["--world-size", str(world), *degree], step - 1))
            answered_at = (2, 3 + engine._dt.config.warm_switch_steps)  # the switch is prepared that many steps
            if a.request and step in answered_at:
                i = answered_at.index(step)
                out, _ = requests[i].communicate(timeout=90)
                answers.append({"returncode": requests[i].returncode, "output": out})
                with open(os.path.join(a.out, "request.json"), "w") as f:
                    json.dump(answers, f)
        if step == a.hold_at:  # held until the test has signalled the launcher
            open(os.path.join(a.out, f"held_{rank}"), "w").close()
            while not os.path.exists(a.flag):
                time.sleep(0.1)
        if generation == 0 and rank == world - 1 and step == a.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice: taken at the next step's boundary
        if rank == 0 and step == a.grow_at:
            degree = ["--pipeline-parallel", str(a.grow_pp)] if a.grow_pp else []
            grow = _request(engine, ["--world-size", str(a.grow_to), *degree], engine._dt.membership.served())
        if engine._dt.preparing is not None:
            time.sleep(1.0)  # a step as long as a real one while the joiners start
        world_now = tdist.get_world_size()
        if a.grow_to and not grown_at and world_now == a.grow_to:
            grown_at = step
            if grow is not None:
                out, _ = grow.communicate(timeout=90)
                with open(os.path.join(a.out, "grow.json"), "w") as f:
                    json.dump({"returncode": grow.returncode, "output": out}, f)
        if grown_at and not shrunk_at and a.shrink_after and world_now == a.shrink_to:
            shrunk_at = step
        if grow is not None and grown_at and a.shrink_after and step == grown_at + a.shrink_after:  # its requester
            requests.append(_request(engine, ["--world-size", str(a.shrink_to)], engine._dt.membership.served()))
        if rank == 0 and step == a.switch_at:
            switch = _request(engine, ["--world-size", str(world), "--pipeline-parallel", "1"], step - 1)
        if rank == 0 and step == a.shrink_at:
            requests.append(_request(engine, ["--world-size", str(a.shrink_to)], engine._dt.membership.served()))
        if generation == 0 and rank == 1 and step == a.kill_at:
            engine.checkpoint_engine.wait()  # the snapshot of this step is committed
            os.kill(os.getpid(), signal.SIGKILL)  # FAULT: a worker dies without notice
    if switch is not None:  # its answer, in the process that asked
        out, _ = switch.communicate(timeout=90)
        with open(os.path.join(a.out, "switch.json"), "w") as f:
            json.dump({"returncode": switch.returncode, "output": out}, f)
    if not engine.is_member:  # what a process that left is told when it asks for a change
        said = []
        for call in (lambda: engine.prepare_resize(1, pipeline_parallel=1), lambda: engine.resize(1)):
            try:
                said.append(repr(call()))
            except Exception as err:  # noqa: BLE001 - the type is what the test reads
                said.append(f"{type(err).__name__}: {err}")
        with open(os.path.join(a.out, f"left_{os.getpid()}.json"), "w") as f:
            json.dump(said, f)


if __name__ == "__main__":
    main()
