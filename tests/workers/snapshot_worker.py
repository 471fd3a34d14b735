"""Test worker: snapshots through the plugin's checkpoint engine.

Step 2: a snapshot is committed. Step 4: a write error (ENOSPC) is INJECTED halfway into rank 1's
file, at the io queue seam of ``io_engine`` (writes at file offsets >= 8 KiB complete with
-ENOSPC instead of reaching the file) - every rank must get SnapshotWriteError and ``latest``
must stay on step 2. Then the step-2 snapshot is loaded back (same world size) and the
state must equal, bitwise, the state gathered at step 2. Results go to OUT/result.json (rank 0).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from ds_dynatrain.errors import SnapshotWriteError  # noqa: E402
from tests.workers.common import TinyLM, Tokens, allow_cpu_fp16, gather_state, train_to  # noqa: E402


def main():
    allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    out, cfg_path = sys.argv[1], sys.argv[sys.argv.index("--deepspeed_config") + 1]
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    torch.manual_seed(0)
    model = TinyLM()
    engine, _o, loader, _s = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=cfg_path
    )
    snap = os.path.join(out, "snapshots")
    result = {}
    it = iter(loader)

    train_to(engine, it, 2)
    engine.save_checkpoint(snap)
    at_2 = gather_state(engine)
    train_to(engine, it, 4)
    ce = engine.checkpoint_engine
    ce._ensure_worker()
    real_writer = ce._writer
    if engine.global_rank == 1:
        from io_engine import Flusher, IOConfig, SnapshotFileWriter
        from tests.faults import faulty

        ce._writer = SnapshotFileWriter(
            flusher=Flusher(
                IOConfig(), queue_factory=faulty(lambda fd, offset: offset >= 8192, lambda view: -errno.ENOSPC, [])
            )
        )
    engine.save_checkpoint(snap)  # returns at once: the write fails in the background
    try:
        ce.wait()
        result["error"] = None
    except SnapshotWriteError as err:
        result["error"] = str(err)
    ce._writer = real_writer
    result["latest_after_failure"] = open(os.path.join(snap, "latest")).read()
    result["dirs_after_failure"] = sorted(os.listdir(snap))
    load_path, _client = engine.load_checkpoint(snap)
    result["loaded"] = load_path
    back = gather_state(engine)
    result["state_equal"] = all(
        torch.equal(at_2[k][kind], back[k][kind])
        for k in at_2
        if not k.startswith("__")
        for kind in ("fp32", "exp_avg", "exp_avg_sq")
    )
    result["steps"] = [at_2["__step__"], back["__step__"], engine.global_steps]
    train_to(engine, it, engine.global_steps + 1)
    errors = [None] * 2
    import torch.distributed as tdist

    tdist.all_gather_object(errors, result["error"])
    result["errors_all_ranks"] = errors
    if engine.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
