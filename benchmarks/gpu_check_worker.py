"""Worker of ``python -m benchmarks.gpu_check``: one process of one of its jobs (``--part``).

The model (:class:`CheckLM`) is a small residual-MLP language model, fp32, trained with ZeRO-2 and
torch's AdamW (``torch_adam``: no fused kernel is compiled), on the device DeepSpeed's accelerator
names (``DS_ACCELERATOR``: ``cuda`` or ``cpu``). Gathered states hold CPU copies of every
parameter's full fp32 master, Adam moments and working value (``deepspeed.utils.safe_get_full_*``,
collective), the Adam step of each partition and ``global_steps``; rank 0 writes them with
``torch.save`` to ``--out``/``<tag>.pt``.

* ``--part train`` (started by ``dynatrain launch --nproc 2``): trains until ``--steps`` optimizer
  steps are done. ``--resize STEP:WORLD,...`` resizes through ``engine.resize`` after those steps,
  with the state gathered right before (``before_<step>``) and right after (``after_<step>``);
  ``--gather-at STEP,...`` gathers ``at_<step>``; the last state is ``final``. ``--snapshot-at
  STEP,...`` takes a snapshot after each of those steps with the plugin's snapshot engine and times
  what the training loop waits for it: ``save_checkpoint`` plus the capture wait before the next
  optimizer step (the first snapshot also allocates the pinned staging memory; later ones reuse it). Rank 0
  then measures torch's pinned device-to-host copy bandwidth (CUDA only) and writes
  ``train.json`` (step times in seconds, the stall, ``pinned_gbps`` in GB/s = 1e9 bytes/s).
* ``--part reload`` (a process of its own, no launcher: the accelerator's backend, NCCL on CUDA):
  trains K = ``--snapshot-at``'s first step's steps, snapshots, gathers ``saved``, trains on to ``--steps``, gathers
  ``moved``, loads the snapshot back, gathers ``loaded``, trains one more step; writes
  ``reload.json`` (backend, device, save and load seconds, the loss after the load).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ds_dynatrain  # noqa: E402


class CheckLM(torch.nn.Module):
    """Embedding, ``layers`` residual MLP blocks (LayerNorm, ``hidden -> 4 hidden -> hidden``),
    LayerNorm and an untied head; returns the next-token cross-entropy of ``tokens`` (``long``,
    ``(batch, seq_len)``)."""

    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(hidden),
                torch.nn.Linear(hidden, 4 * hidden),
                torch.nn.GELU(),
                torch.nn.Linear(4 * hidden, hidden),
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1])
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class Tokens(torch.utils.data.Dataset):
    """Deterministic pseudo-random token sequences (``long``, ``(seq_len,)``), on the CPU."""

    def __init__(self, vocab: int, n: int = 512, seq_len: int = 33, seed: int = 7):
        self.data = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, i):
        return self.data[i]


def gather_state(engine) -> dict:
    """The full training state as CPU tensors (collective: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from ds_dynatrain.zero.geometry import fp32_partitions

    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {
            "fp32": safe_get_full_fp32_param(p).detach().cpu().clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().cpu().clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().cpu().clone(),
            "param": p.detach().float().cpu().clone(),
        }
    opt = engine.optimizer
    out["__step__"] = [float(opt.optimizer.state[f]["step"]) for f in fp32_partitions(opt)]
    out["__global_steps__"] = engine.global_steps
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_copy_gbps(nbytes: int, device: torch.device, repeat: int = 4) -> float | None:
    """torch's device-to-host copy bandwidth into pinned memory, GB/s (1e9 bytes/s), best of
    ``repeat`` copies of ``nbytes`` after one warm-up; None off CUDA (no pinned copies there) or
    for ``nbytes`` 0 (not asked for)."""
    if device.type != "cuda" or nbytes <= 0:
        return None
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _one_step(engine, batch) -> float:
    """One optimizer step's worth of micro-steps from ``batch`` (reused), its last loss."""
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(batch.to(engine.device))
        engine.backward(loss)
        engine.step()
    return float(loss)


def _parse_pairs(text: str) -> dict:
    return {int(s): int(w) for s, w in (x.split(":") for x in text.split(",") if x)}


def _steps(text: str) -> set:
    return {int(s) for s in text.split(",") if s}


def train(a, engine, loader) -> None:
    """``--part train`` (see the module docstring)."""
    resize, gather_at = _parse_pairs(a.resize), _steps(a.gather_at)
    snapshot_at = _steps(a.snapshot_at)
    step_s, snap = [], {}

    def save(tag):
        state = gather_state(engine)
        if engine.global_rank == 0:
            torch.save(state, os.path.join(a.out, f"{tag}.pt"))

    if engine.global_steps > 0:  # a joiner: take part in the survivors' gather after the grow
        engine.wait_transition()
        save(f"after_{engine.global_steps}")
    t_prev = time.perf_counter()
    while engine.is_member and engine.global_steps < a.steps:
        for batch in loader:
            before = engine.global_steps
            engine.backward(engine(batch.to(engine.device)))
            engine.step()
            if engine.global_steps == before:
                continue
            s = engine.global_steps
            _sync(engine.device)
            now = time.perf_counter()
            step_s.append(now - t_prev)
            last = snap.get(s - 1)
            if last is not None and "stall_s" not in last:  # the step after a snapshot
                last["stall_s"] = last["save_s"] + engine.checkpoint_engine.stats["capture_wait_s"] - last["wait0"]
            if s in gather_at:
                save(f"at_{s}")
            if s in snapshot_at:
                snap[s] = {"wait0": engine.checkpoint_engine.stats["capture_wait_s"]}
                t0 = time.perf_counter()
                engine.save_checkpoint(os.path.join(a.out, "snapshots"), tag=f"global_step{s}")
                snap[s]["save_s"] = time.perf_counter() - t0
            if s in resize:
                save(f"before_{s}")
                engine.resize(resize[s])
                if not engine.is_member:
                    break
                engine.wait_transition()
                save(f"after_{s}")
            t_prev = time.perf_counter()
            if s >= a.steps:
                break
    if not engine.is_member:
        return
    save("final")
    _finish_train(a, engine, step_s, snap)


def _finish_train(a, engine, step_s, snap) -> None:
    """Wait for the snapshot's outcome, measure the pinned-copy bound beside it, write ``train.json``."""
    engine.checkpoint_engine.wait()
    torch.distributed.barrier()  # the other ranks idle while rank 0 measures
    pinned = pinned_copy_gbps(a.pinned_mib << 20, engine.device) if engine.global_rank == 0 else None
    torch.distributed.barrier()
    if engine.global_rank == 0:
        later = step_s[1:] or step_s
        stats = engine.checkpoint_engine.stats
        out = {
            "step_s": step_s,
            "median_step_s": statistics.median(later),
            "snapshots": {str(k): {"save_s": v["save_s"], "stall_s": v.get("stall_s")} for k, v in snap.items()},
            "pinned_gbps": pinned,
            # share of rank 0's snapshot bytes written from the pinned stage itself (no host-cache copy)
            "snapshot_from_source_share": stats["from_source_bytes"] / stats["bytes"] if stats["bytes"] else None,
            "device": str(engine.device),
            "backend": torch.distributed.get_backend(),
            "params": sum(p.numel() for p in engine.module.parameters()),
        }
        with open(os.path.join(a.out, "train.json"), "w") as f:
            json.dump(out, f)


def reload(a, engine, loader) -> None:
    """``--part reload`` (see the module docstring)."""
    batches = iter(loader)
    while engine.global_steps < min(_steps(a.snapshot_at)):
        _one_step(engine, next(batches))
    snapshots, tag = os.path.join(a.out, "snapshots"), f"global_step{engine.global_steps}"
    t0 = time.perf_counter()
    engine.save_checkpoint(snapshots, tag=tag)
    save_s = time.perf_counter() - t0
    engine.checkpoint_engine.wait()
    torch.save(gather_state(engine), os.path.join(a.out, "saved.pt"))
    while engine.global_steps < a.steps:
        _one_step(engine, next(batches))
    torch.save(gather_state(engine), os.path.join(a.out, "moved.pt"))
    _sync(engine.device)
    t0 = time.perf_counter()
    engine.load_checkpoint(snapshots, tag=tag)
    _sync(engine.device)
    load_s = time.perf_counter() - t0
    torch.save(gather_state(engine), os.path.join(a.out, "loaded.pt"))
    loss = _one_step(engine, next(batches))
    with open(os.path.join(a.out, "reload.json"), "w") as f:
        json.dump(
            {
                "backend": torch.distributed.get_backend(),
                "device": str(engine.device),
                "save_s": save_s,
                "load_s": load_s,
                "loss_after_load": loss,
            },
            f,
        )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=["train", "reload"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--resize", default="", help="STEP:WORLD,... resizes through engine.resize")
    p.add_argument("--gather-at", default="", help="STEP,... gather the state after those steps")
    p.add_argument("--snapshot-at", default="", help="STEP,... take a snapshot after those steps (reload: the first)")
    p.add_argument("--pinned-mib", type=int, default=256, help="size of the pinned-copy measurement")
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)  # the bitwise comparisons with the static run
    model = CheckLM(a.vocab, a.hidden, a.layers)
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(a.vocab), config=a.deepspeed_config
    )
    (train if a.part == "train" else reload)(a, engine, loader)
    return 0


if __name__ == "__main__":
    sys.exit(main())
