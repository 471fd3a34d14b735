"""Soak worker: generated corruptions of a 2-rank snapshot, each put to the four readers.

For trial ``i`` of ``range(--first + --shard, --count, --shards)``: a corruption
(``tests/workers/soak_corrupt.py``, seeded by ``--seed`` and ``i``) is applied to a working copy of
the snapshot directory ``--snapshot``; then

* ``verify``:  ``ds_dynatrain.checkpoint.inspect.verify_checkpoint`` (refused: a report not ok);
* ``export``:  ``ds_dynatrain.checkpoint.consolidate.export_safetensors`` (refused: it raises, and
  leaves no file);
* ``inspect``: ``ds_dynatrain.checkpoint.inspect.inspect_report`` (refused: it raises);
* ``load``:    ``engine.load_checkpoint`` of a 1-rank ZeRO-2 engine (a resharded load of the 2-rank
  snapshot; refused: it raises and the engine's state is what it was before).

"Refused" takes an exception of ours (``ds_dynatrain.errors.DynatrainError``); any other exception
is recorded by its type, a call that outlasts ``--call-timeout`` as a hang. An accepted result is
compared with the pristine snapshot's (the same report, the same file bytes, the same loaded
state: "same" or "differs"). The pristine copy is checked first: every reader must accept it and
the load must give the state the saving job gathered (``--state``), bitwise. One JSON line per
trial is appended to ``--out``; ``fds`` of each reader's result counts the file descriptors the
call left open.

Started with RANK=0, WORLD_SIZE=1, MASTER_ADDR, MASTER_PORT in the environment (no launcher).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import ds_dynatrain  # noqa: E402
from ds_dynatrain.errors import DynatrainError  # noqa: E402
from tests.workers import soak_corrupt  # noqa: E402
from tests.workers.common import TinyLM, Tokens, base_config, gather_state  # noqa: E402
from tests.workers.soak_flush_worker import difference  # noqa: E402

TOOLS = ("verify", "export", "inspect", "load")


CLIENT_KEY = "soak_client"


def client_state() -> dict:
    """Client state saved beside the model: tensors over and under 64 KiB, several dtypes."""
    g = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(40_000, generator=g),  # 160 KiB
        "ids": torch.arange(-7, 9000, dtype=torch.int64),  # 72 KiB
        "half": torch.randn(33, generator=g).half(),
        "nested": [{"mask": torch.tensor([True, False, True])}, 3, "x"],
    }


class Hang(Exception):
    """A reader call outlasted its time limit."""


def _alarm(_signum, _frame):
    raise Hang()


def build():
    """TinyLM at ZeRO-2 on this job's ranks: ``(engine, loader)``."""
    torch.manual_seed(0)
    model = TinyLM()
    cfg = base_config(2)
    cfg["dynatrain"].pop("max_world_size", None)
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=cfg
    )
    return engine, loader


def same_state(a: dict, b: dict) -> bool:
    """Bitwise equality of two loaded states (``gather_state`` and the client state)."""
    return difference(a, b) is None


class Readers:
    """The four readers on one checkpoint directory; ``clean`` holds the pristine results."""

    def __init__(self, engine, ckpt_dir: str, scratch: str, call_timeout: float):
        from ds_dynatrain.checkpoint.consolidate import export_safetensors
        from ds_dynatrain.checkpoint.inspect import inspect_report, verify_checkpoint

        self.engine, self.dir, self.timeout = engine, ckpt_dir, call_timeout
        self.export_path = os.path.join(scratch, "export.safetensors")
        self._verify, self._export, self._inspect = verify_checkpoint, export_safetensors, inspect_report
        self.clean = {}

    def verify(self):
        rep = self._verify(self.dir)
        return rep.ok, (rep.problems[0] if rep.problems else None), rep.ok

    def export(self):
        try:
            self._export(self.dir, self.export_path)
        except BaseException:
            if os.path.exists(self.export_path):
                os.unlink(self.export_path)
                raise AssertionError("export refused the checkpoint but left its output file") from None
            raise
        with open(self.export_path, "rb") as f:
            data = f.read()
        os.unlink(self.export_path)
        return True, None, data

    def inspect(self):
        return True, None, self._inspect(self.dir)

    def load(self):
        # a fresh engine has no optimizer state to gather before its first load (the pristine one)
        before = gather_state(self.engine) if "load" in self.clean else None
        try:
            path, client = self.engine.load_checkpoint(self.dir)
        except DynatrainError:
            if before is not None and not same_state(before, gather_state(self.engine)):
                raise AssertionError("load refused the checkpoint but changed the engine's state") from None
            raise
        if path is None:
            return False, "load_checkpoint returned (None, None): nothing loaded, nothing raised", None
        return True, None, dict(gather_state(self.engine), __client__=(client or {}).get(CLIENT_KEY))

    def run(self, tool: str) -> dict:
        """``{"outcome": refused|accepted|foreign|hang, "cls", "msg", "same"}`` of one reader."""
        signal.alarm(int(self.timeout))
        try:
            ok, msg, result = getattr(self, tool)()
            if tool == "verify" and not ok:
                return {"outcome": "refused", "cls": "VerifyReport", "msg": (msg or "")[:300]}
            if tool == "load" and not ok:
                return {"outcome": "accepted", "cls": "", "msg": msg, "same": False}
            same = None
            if tool in self.clean:
                same = same_state(result, self.clean[tool]) if tool == "load" else result == self.clean[tool]
            return {"outcome": "accepted", "cls": "", "msg": "", "same": same, "_result": result}
        except Hang:
            return {"outcome": "hang", "cls": "", "msg": f"no answer within {self.timeout:.0f} s"}
        except DynatrainError as err:
            return {"outcome": "refused", "cls": type(err).__name__, "msg": str(err)[:300]}
        except Exception as err:  # noqa: BLE001 - another type is what this records
            frame = traceback.extract_tb(err.__traceback__)[-1]
            where = f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno}"
            return {"outcome": "foreign", "cls": type(err).__name__, "msg": f"{str(err)[:300]} (at {where})"}
        finally:
            signal.alarm(0)


def pristine(snapshot: str):
    """``(tag, {file name: bytes})`` of the snapshot-format files of ``snapshot/latest``."""
    with open(os.path.join(snapshot, "latest")) as f:
        tag = f.read().strip()
    d = os.path.join(snapshot, tag)
    files = {}
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            data = f.read()
        if data.startswith(soak_corrupt.MAGIC):
            files[name] = data
    return tag, files


def apply(work: str, tag: str, changes: dict) -> None:
    for name, data in changes.items():
        path = os.path.join(work, name) if name == soak_corrupt.LATEST else os.path.join(work, tag, name)
        if data is None:
            os.unlink(path)
        else:
            with open(path, "wb") as f:
                f.write(data)


def check_clean(readers: Readers, state_path: str) -> None:
    """Every reader accepts the pristine copy; the load gives the saved state bitwise."""
    for tool in TOOLS:
        r = readers.run(tool)
        assert r["outcome"] == "accepted", (tool, r)
        readers.clean[tool] = r["_result"]
    saved = torch.load(state_path)
    got = readers.clean["load"]
    for name, kinds in saved.items():
        if name.startswith("__"):
            continue
        for kind in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][kind], kinds[kind]), (name, kind)
    assert got["__global_steps__"] == saved["__global_steps__"]
    client = difference(got["__client__"], saved["__client__"])
    assert client is None, client


def trial(readers: Readers, work: str, tag: str, files: dict, latest: bytes, seed: int, i: int) -> dict:
    for attempt in range(100):
        c = soak_corrupt.generate(random.Random(f"{seed}:{i}:{attempt}"), files, tag)
        if soak_corrupt.changes_bytes(c, files, latest):
            break
    restore = dict(files, **{soak_corrupt.LATEST: latest})
    for name in c.files:
        if name not in restore:
            raise AssertionError(f"corruption of an unknown file {name}")
    apply(work, tag, c.files)
    t0 = time.perf_counter()
    try:
        tools = {}
        for tool in TOOLS:
            fds = len(os.listdir("/proc/self/fd"))
            r = readers.run(tool)
            r.pop("_result", None)
            r["fds"] = len(os.listdir("/proc/self/fd")) - fds  # open file descriptors left behind
            tools[tool] = r
    finally:
        apply(work, tag, restore)
    rec = {"i": i, "kind": c.kind, "sub": c.sub, "target": c.target, "detail": c.detail, "region": c.region}
    rec.update(tools=tools, seconds=time.perf_counter() - t0)
    return rec


def save(out: str) -> int:
    """The snapshot to corrupt: TinyLM after 3 steps at ZeRO-2 on this job's ranks (2), with a
    client state of tensors over and under 64 KiB, saved through the snapshot engine as
    ``out/snapshot/ckpt`` (``latest`` names it); ``out/state.pt``: the gathered state and the
    client state (rank 0)."""
    engine, loader = build()
    while engine.global_steps < 3:
        for batch in loader:
            engine.backward(engine(batch))
            engine.step()
            if engine.global_steps >= 3:
                break
    engine.save_checkpoint(os.path.join(out, "snapshot"), tag="ckpt", client_state={CLIENT_KEY: client_state()})
    engine.checkpoint_engine.wait()
    state = gather_state(engine)
    if engine.global_rank == 0:
        torch.save(dict(state, __client__=client_state()), os.path.join(out, "state.pt"))
    torch.distributed.barrier()
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "fuzz"])
    p.add_argument("--snapshot", help="the pristine snapshot directory (with latest)")
    p.add_argument("--state", help="the state the saving job gathered (torch.save)")
    p.add_argument("--work", required=True, help="save: where to write; fuzz: a scratch directory")
    p.add_argument("--out", help="fuzz: the JSON-lines results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first", type=int, default=0, help="fuzz: the first trial")
    p.add_argument("--count", type=int, default=0, help="fuzz: the trial to stop before")
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--call-timeout", type=float, default=60.0)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    logging.getLogger("ds_dynatrain").setLevel(logging.ERROR)
    if a.mode == "save":
        return save(a.work)
    signal.signal(signal.SIGALRM, _alarm)
    work = os.path.join(a.work, "ckpt")
    shutil.copytree(a.snapshot, work)
    tag, files = pristine(a.snapshot)
    with open(os.path.join(a.snapshot, "latest"), "rb") as f:
        latest = f.read()
    readers = Readers(build()[0], work, a.work, a.call_timeout)
    check_clean(readers, a.state)
    with open(a.out, "a") as out:
        for i in range(a.first + a.shard, a.count, a.shards):
            rec = trial(readers, work, tag, files, latest, a.seed, i)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            if any(r["outcome"] == "hang" for r in rec["tools"].values()):
                return 3  # the engine may be stuck in a collective: stop here, the test reports it
    check_clean(readers, a.state)  # after every refused load the engine still loads the pristine copy exactly
    return 0


if __name__ == "__main__":
    sys.exit(main())
