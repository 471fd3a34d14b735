"""Shared pieces of the soak and fuzz suite (``make soak``; not part of ``make test``).

Every part reads its counts from the environment (``SOAK_CYCLES``, ``SOAK_KILLS``,
``SOAK_CORRUPTIONS``, ``SOAK_JOBS``; ``SOAK_SEED`` for the random ones), so a short run while
developing is ``SOAK_CYCLES=5 make soak``, prints its figures at the end and writes them to
``runs/soak/<part>.json``. Each part's pytest timeout grows with its count, so a hang fails that
part, not the whole run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(ROOT, "tests", "workers")
RUNS = os.path.join(ROOT, "runs", "soak")


def count(name: str, default: int) -> int:
    """The positive integer in the environment variable ``name``, else ``default``."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = int(raw)
    if value < 1:
        raise ValueError(f"{name}={raw}: expected a positive integer")
    return value


def seed() -> int:
    """The seed of the random parts (``SOAK_SEED``, default 20240601); printed with the figures."""
    return int(os.environ.get("SOAK_SEED", "20240601"))


def env(**extra: str) -> dict:
    """The environment of a worker process: the CPU accelerator, this checkout on the path."""
    out = dict(os.environ)
    out["DS_ACCELERATOR"] = "cpu"
    out["PYTHONPATH"] = ROOT + os.pathsep + out.get("PYTHONPATH", "")
    out.setdefault("OMP_NUM_THREADS", "1")
    out.update(extra)
    return out


def write_figures(part: str, figures: dict, text: str) -> str:
    """Print ``text`` (the part's human-readable figures) and write ``figures`` (JSON-ready) to
    ``runs/soak/<part>.json``; returns that path."""
    os.makedirs(RUNS, exist_ok=True)
    path = os.path.join(RUNS, f"{part}.json")
    figures = dict(figures, part=part, written=time.strftime("%Y-%m-%d %H:%M:%S"))
    with open(path, "w") as f:
        json.dump(figures, f, indent=1, sort_keys=True)
    print(f"\n=== soak {part} ===\n{text}\n(figures in {os.path.relpath(path, ROOT)})", flush=True)
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A plain-text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def resources(pid: int) -> Dict[str, int]:
    """Open file descriptors (``/proc/PID/fd``), OS threads (``/proc/PID/task``) and resident set
    (``VmRSS``, bytes) of process ``pid``. Raises ``OSError`` when it is gone."""
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "rss": int(status["VmRSS"].split()[0]) * 1024,
    }


class Proc:
    """A process in its own session whose whole group is killed by :meth:`stop` (no strays)."""

    def __init__(self, cmd: List[str], log_path: str, err_path: Optional[str] = None, extra_env=None):
        self.log_path, self.err_path = log_path, err_path
        self._out = open(log_path, "w")
        self._err = open(err_path, "w") if err_path else None
        self.popen = subprocess.Popen(
            cmd,
            stdout=self._out,
            stderr=self._err or subprocess.STDOUT,
            cwd=ROOT,
            env=env(**(extra_env or {})),
            start_new_session=True,
        )
        self.pid = self.popen.pid

    def wait(self, timeout: float) -> Optional[int]:
        """The exit status, or None when it is still running after ``timeout`` seconds."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def stop(self) -> None:
        """SIGKILL to the whole process group (a no-op once everything exited), then reap."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()
        for f in (self._out, self._err):
            if f is not None and not f.closed:
                f.close()

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def errors(self) -> str:
        if not self.err_path:
            return ""
        with open(self.err_path, errors="replace") as f:
            return f.read()


def dynatrain(*args: str) -> List[str]:
    """The argv of ``dynatrain ARGS...`` in this interpreter."""
    return [sys.executable, "-m", "ds_dynatrain.cli", *args]


def read_jsonl(path: str) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
