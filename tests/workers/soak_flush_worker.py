"""Soak worker: one snapshot after another through the plugin's snapshot engine, for SIGKILLs at
random moments of a flush (``tests/soak/test_soak_snapshot_kills.py``).

The engine is the one a training job uses (``ds_dynatrain.checkpoint.snapshot.
SnapshotCheckpointEngine``: ``DictStateProvider`` items, the ``io_engine`` ``SnapshotFileWriter``
with io_uring and O_DIRECT, ``publish_dir``, the atomic write of ``latest``, pruning), driven the
way DeepSpeed's ``save_checkpoint`` drives it (``makedirs``, ``create``, one ``save`` per file,
``commit``, then ``wait`` for the outcome), on one rank, with its own store; no DeepSpeed engine,
so a process starts in well under a second. The state of step ``N`` is a deterministic function
of ``N`` (:func:`state_of`), so whoever reads a snapshot back knows what it must hold.
"""

from __future__ import annotations

import inspect
import os
import time
from typing import Any, Dict, Optional

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from ds_dynatrain.checkpoint.snapshot import SnapshotCheckpointEngine

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
KEEP_LAST = 2
CACHE_BYTES = 8 << 20  # smaller than one snapshot: the host cache's back-pressure is exercised too


def state_of(step: int) -> Dict[str, Any]:
    """``{file name: state dict}`` of step ``step`` (about 7.5 MiB in all): float32, bfloat16,
    float16, int64 and bool tensors (an empty one too), nested dicts with int keys, lists and
    scalars, all a function of ``step`` alone."""
    g = torch.Generator().manual_seed(7919 * step + 1)
    model = {
        "module": {
            "w": torch.randn(512, 1024, generator=g),
            "b16": torch.randn(3001, generator=g).bfloat16(),
            "ids": torch.randint(-(2**40), 2**40, (777,), generator=g, dtype=torch.int64),
            "mask": torch.rand(129, generator=g) > 0.5,
            "empty": torch.empty(0, 3),
        },
        "global_steps": step,
        "lr": 1e-3 * step,
        "ds_version": "soak",
        "names": [f"p{step}", "w", "b16"],
    }
    optim = {
        "optimizer_state_dict": {
            "state": {
                0: {"exp_avg": torch.randn(512, 1024, generator=g), "step": step},
                1: {"exp_avg_sq": torch.rand(512, 1024, generator=g), "step": step},
            },
            "fp32_groups": [torch.randn(300_001, generator=g), torch.randn(12_345, generator=g)],
            "half": torch.randn(1000, generator=g).half(),
        },
        "step": step,
    }
    return {MODEL_FILE: model, OPTIM_FILE: optim}


def load_snapshot(snapshot_dir: str) -> Dict[str, Any]:
    """``{file name: state dict}`` of one snapshot directory, read by the engine's own ``load``
    (every item's checksum checked)."""
    engine = SnapshotCheckpointEngine()
    return {name: engine.load(os.path.join(snapshot_dir, name)) for name in (MODEL_FILE, OPTIM_FILE)}


def difference(got: Any, want: Any, where: str = "") -> Optional[str]:
    """None when ``got`` equals ``want`` bitwise (tensors: dtype, shape and every byte), else
    where the first difference is."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: {type(got).__name__}, not a tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{where}: {got.dtype}{list(got.shape)}, not {want.dtype}{list(want.shape)}"
        a, b = got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)
        return None if torch.equal(a, b) else f"{where}: bytes differ"
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where}: keys {sorted(map(str, got)) if isinstance(got, dict) else got!r}"
        for k in want:
            d = difference(got[k], want[k], f"{where}/{k}")
            if d:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return f"{where}: {got!r}"
        for i, (a, b) in enumerate(zip(got, want)):
            d = difference(a, b, f"{where}/{i}")
            if d:
                return d
        return None
    return None if type(got) is type(want) and got == want else f"{where}: {got!r} != {want!r}"


def run(save_dir: str, first_step: int, conn, count: Optional[int] = None) -> None:
    """Snapshot steps ``first_step, first_step + 1, ...`` into ``save_dir`` (``count`` of them;
    None: until killed). Sends ``("start", step)`` right before each ``save_checkpoint``'s calls,
    ``("done", step, seconds)`` once its outcome is "committed", ``("error", message)`` on a
    failed snapshot."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    policy = {}
    if "on_write_error" in inspect.signature(SnapshotCheckpointEngine).parameters:
        policy["on_write_error"] = "raise"  # a failed snapshot must be loud here, not a warning
    engine = SnapshotCheckpointEngine(
        ("127.0.0.1", store.port),
        rank=0,
        world_size=1,
        keep_last=KEEP_LAST,
        timeout_s=60,
        cache_bytes=CACHE_BYTES,
        **policy,
    )
    step, done = first_step, 0
    try:
        while count is None or done < count:
            tag = f"global_step{step}"
            files = state_of(step)
            info = CheckpointCommitInfo(tag=tag, save_dir=save_dir, save_latest=True)
            conn.send(("start", step))
            t0 = time.perf_counter()
            engine.makedirs(save_dir, exist_ok=True)
            engine.create(info)
            engine.makedirs(os.path.join(save_dir, tag), exist_ok=True)
            for name, sd in files.items():
                engine.save(sd, os.path.join(save_dir, tag, name))
            engine.commit(info)
            engine.wait()
            conn.send(("done", step, time.perf_counter() - t0))
            step, done = step + 1, done + 1
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        engine.close()
