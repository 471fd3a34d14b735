"""Test worker: the policy for failed snapshot writes (``dynatrain.snapshot.on_write_error``).

A job of ``--steps`` steps takes a periodic snapshot every ``interval_steps`` (the config). With
``--fail-tag TAG``, every write of this rank's files of snapshot TAG is INJECTED to fail with
ENOSPC, at the io engine's queue seam (the operations complete with -ENOSPC instead of reaching
the file, as on a full disk; the files are told apart by the path their descriptor was opened
with, at the opener seam) on the rank ``--fail-rank`` only; every other snapshot is written as
usual: the storage is back.

Every rank writes ``OUT/result_rank<r>.json``: each snapshot outcome this rank saw (tag, ok,
failed ranks, cause, and what ``latest`` named at that moment), the SnapshotWriteError a save
raised (``"raise"``), and, after the last step, an explicit save into a path under a regular file
(a directory that cannot be created) and a load of the last snapshot: the step it gives and
whether the state equals, bitwise, the state gathered at that step.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from ds_dynatrain.errors import SnapshotWriteError  # noqa: E402
from io_engine import TMP_PREFIX, read_latest  # noqa: E402
from tests.workers.common import TinyLM, Tokens, gather_state  # noqa: E402


def inject_enospc(ce, tag: str) -> None:
    """INJECTED: every write of this rank's files of snapshot ``tag`` completes with -ENOSPC."""
    from io_engine import Flusher, IOConfig, SnapshotFileWriter
    from tests.faults import faulty

    paths = {}

    def opener(path, flags, mode):
        fd = os.open(path, flags, mode)
        paths[fd] = path
        return fd

    marker = f"{os.sep}{TMP_PREFIX}{tag}-"
    flusher = Flusher(
        IOConfig(),
        queue_factory=faulty(lambda fd, offset: marker in paths.get(fd, ""), lambda view: -errno.ENOSPC, []),
        opener=opener,
    )
    ce._ensure_worker()
    ce._writer.close()
    ce._writer = SnapshotFileWriter(flusher=flusher, cache_bytes=16 << 20)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fail-tag", default=None)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()
    torch.manual_seed(0)
    model = TinyLM()
    engine, _o, loader, _s = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=a.deepspeed_config
    )
    with open(a.deepspeed_config) as f:
        snap_dir = json.load(f)["dynatrain"]["snapshot"]["dir"]
    rank, ce = engine.global_rank, engine.checkpoint_engine
    if a.fail_tag and rank == a.fail_rank:
        inject_enospc(ce, a.fail_tag)
    seen = []
    record = ce.on_outcome  # rank 0: the metrics record of each outcome

    def on_outcome(o):
        seen.append({"tag": o.tag, "ok": o.ok, "ranks": list(o.failed_ranks), "error": o.error, "step": o.step})
        seen[-1]["latest"] = read_latest(snap_dir)
        if record is not None:
            record(o)

    ce.on_outcome = on_outcome
    result = {"raised": None, "raised_at": None}
    it = iter(loader)
    try:
        while engine.global_steps < a.steps:
            engine.backward(engine(next(it)))
            engine.step()
    except SnapshotWriteError as err:  # on_write_error "raise": the save after the failed snapshot
        result["raised"], result["raised_at"] = str(err), engine.global_steps
    if result["raised"] is None:
        final = gather_state(engine)
        ce.wait()  # the last periodic snapshot's outcome
        blocker = os.path.join(a.out, "a_file")
        if rank == 0:
            open(blocker, "w").close()
        torch.distributed.barrier()
        engine.save_checkpoint(os.path.join(blocker, "snapshots"), tag="explicit")
        try:
            ce.wait()
            result["explicit"] = None
        except SnapshotWriteError as err:
            result["explicit"] = str(err)
        load_path, _client = engine.load_checkpoint(snap_dir)
        back = gather_state(engine)
        result["loaded"] = load_path
        result["loaded_step"] = engine.global_steps
        result["state_equal"] = all(
            torch.equal(final[k][kind], back[k][kind])
            for k in final
            if not k.startswith("__")
            for kind in ("fp32", "exp_avg", "exp_avg_sq")
        ) and (final["__step__"] == back["__step__"])
    result["outcomes"] = seen
    with open(os.path.join(a.out, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
