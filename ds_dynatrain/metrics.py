"""Step and resize records: one console line each, and JSON lines in ``metrics_path`` (rank 0).

Records (one JSON object per line):

* ``{"event": "step", "step", "world_size", "loss", "lr", "time"}``
* ``{"event": "resize", "step", "from", "to", "bytes_moved", "bytes_kept", "seconds", "plan_s",
  "group_s", "transfer_s", "rebuild_s", "time"}`` (seconds; ``group_s`` is forming the new
  process group, joiners' start-up included)
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Optional

logger = logging.getLogger("ds_dynatrain")
if not logger.handlers:
    _h = logging.StreamHandler(sys.stdout)
    _h.setFormatter(logging.Formatter("[dynatrain] %(message)s"))
    logger.addHandler(_h)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class MetricsWriter:
    """Appends records to a JSON-lines file (flushed per record). ``path`` None: console only."""

    def __init__(self, path: Optional[str]):
        self.path = path
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, record: dict) -> None:
        record = {**record, "time": time.time()}
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def format_step(step: int, world_size: int, loss: float, lr: float) -> str:
    return f"step {step:5d} | world {world_size} | loss {loss:.4f} | lr {lr:.3e}"


def format_resize(r: dict) -> str:
    return (f"resize {r['from']} \u2192 {r['to']} after step {r['step']}: {r['bytes_moved'] / 2**20:.2f} MiB moved, "
            f"{r['bytes_kept'] / 2**20:.2f} MiB kept in place, {r['seconds']:.2f} s "
            f"(plan {r['plan_s']:.3f} s, group {r['group_s']:.2f} s, transfer {r['transfer_s']:.3f} s, "
            f"rebuild {r['rebuild_s']:.2f} s)")
