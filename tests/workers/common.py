"""Shared pieces of the test worker scripts: a small model with awkward sizes, synthetic tokens,
and a gather of the full training state through DeepSpeed's own accessors (the oracle)."""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

VOCAB = 37

# Reproduces a CPU without fp16 kernels in mkldnn on any CPU: "0" makes torch's probe
# (torch.ops.mkldnn._is_mkldnn_fp16_supported) answer False in the process importing this module.
MKLDNN_FP16_ENV = "DT_TEST_MKLDNN_FP16"
# "0" leaves DeepSpeed's fp16 check of the CPU accelerator as it is (to see the error it raises).
CPU_FP16_SEAM_ENV = "DT_TEST_CPU_FP16_SEAM"


class _NoFp16:
    """torch's mkldnn fp16 probe answering False; everything else of the op (its overloads, which
    torch's own op tables look up) is the real one's."""

    def __init__(self, real):
        self._real = real

    def __call__(self, *args, **kwargs):
        return False

    def __getattr__(self, name):
        return getattr(self._real, name)


def allow_cpu_fp16() -> None:
    """SEAM (tests only): DeepSpeed's CPU accelerator reports fp16 as supported only where mkldnn has
    fp16 kernels (``deepspeed/accelerator/cpu_accelerator.py`` ``is_fp16_supported``, and through it
    ``supported_dtypes``), and ``DeepSpeedEngine`` then refuses an fp16 config ("Type fp16 is not
    supported on your device."). torch computes fp16 on any CPU without those kernels, so the fp16
    tests override that check here, in every worker process that builds engines (the test
    processes build none); a CPU on which torch itself cannot run the fp16 model is skipped by
    the test, naming the reason. Applies to the CPU accelerator only."""
    if os.environ.get(MKLDNN_FP16_ENV) == "0" and not isinstance(torch.ops.mkldnn._is_mkldnn_fp16_supported, _NoFp16):
        torch.ops.mkldnn._is_mkldnn_fp16_supported = _NoFp16(torch.ops.mkldnn._is_mkldnn_fp16_supported)
    if os.environ.get(CPU_FP16_SEAM_ENV) == "0" or os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True


class TinyLM(torch.nn.Module):
    """Odd sizes on purpose: 37-token vocabulary, width 13, a 1-element parameter; the total
    parameter count (890) is not a multiple of 4, 6 or 8, so DeepSpeed pads its flat ZeRO-1/2
    partitions (to a multiple of 2 x world size) at 2, 3 and 4 ranks."""

    def __init__(self, width: int = 13):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.mix = torch.nn.Linear(width, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.gain = torch.nn.Parameter(torch.ones(1))
        self.head = torch.nn.Linear(7, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.mix(self.embed(tokens[:, :-1])))) * self.gain
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class Tokens(Dataset):
    """Deterministic pseudo-random token sequences (``torch.long``, shape ``(seq_len,)``)."""

    def __init__(self, n: int = 600, seq_len: int = 9, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, seq_len), generator=g)

    def __len__(self):
        return self.data.shape[0]

    def __getitem__(self, i):
        return self.data[i]


def train_to(engine, batches, step: int) -> None:
    """Forward, backward and ``engine.step()`` on the next batch of the iterator ``batches`` until
    ``engine.global_steps`` reaches ``step`` (every micro-batch of each accumulation)."""
    while engine.global_steps < step:
        engine.backward(engine(next(batches)))
        engine.step()


def gather_state(engine) -> dict:
    """Full fp32 master weights, Adam moments and step of every trainable parameter, gathered with
    ``deepspeed.utils.safe_get_full_*`` (collective: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out[name] = {
            "fp32": safe_get_full_fp32_param(p).detach().clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone(),
            "param": _whole(p),
        }
    from ds_dynatrain.zero.geometry import fp32_partitions

    opt = engine.optimizer
    steps = [opt.optimizer.state[f]["step"] for f in fp32_partitions(opt)]
    out["__step__"] = [float(s) for s in steps]
    out["__lr__"] = [g["lr"] for g in opt.optimizer.param_groups]
    out["__global_steps__"] = engine.global_steps
    return out


def save_final_state(engine, out: str) -> None:
    """Collective over the engine's world: :func:`gather_state`, written by rank 0 to
    ``out/final.pt`` (what the tests compare with an oracle's)."""
    state = gather_state(engine)
    if engine.global_rank == 0:
        torch.save(state, os.path.join(out, "final.pt"))


def _whole(p) -> torch.Tensor:
    """The working parameter whole, as fp32 (a ZeRO-3 parameter is gathered: collective)."""
    if hasattr(p, "ds_id"):
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([p]):
            return p.detach().float().clone()
    return p.detach().float().clone()


def base_config(stage: int, metrics_path: str | None = None) -> dict:
    return {
        "train_batch_size": 12,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.01, "torch_adam": True, "fused": True}},
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": 40, "warmup_num_steps": 3, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "dynatrain": {
            "metrics_path": metrics_path,
            "collective_timeout_s": 60,
            "join_timeout_s": 120,
            "max_world_size": 6,
        },
    }


def record_threads_at_exit(path: str) -> None:
    """Write the names of this process's OS threads (``/proc/self/task/*/comm``), one a line, to
    ``path``. Registered with ``atexit`` before ``ds_dynatrain`` is initialized, it runs after the
    library's own exit hooks: a gloo thread still listed there outlives the interpreter."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # a thread that ended meanwhile
    with open(path, "w") as f:
        f.write("\n".join(names) + "\n")


def exit_without_teardown(code: int) -> None:
    """End a plain DeepSpeed worker whose results are written and whose process group is
    destroyed, without the interpreter's teardown: there, a gloo thread torch left running
    intermittently aborts the process ("terminate called without an active exception", about one
    run in six of ``tests/test_layout_vs_deepspeed.py``, before and after this project's own
    changes), which would fail a test whose assertions all hold."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
