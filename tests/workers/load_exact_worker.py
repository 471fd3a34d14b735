"""Test worker: the client state of a checkpoint comes back exactly, and a checkpoint of another
model is refused at any world size with the engine left as it was.

``save`` (2 ranks): TinyLM trained 3 steps, saved with :func:`client_state` as ``client_state``
in both formats (this project's snapshot, DeepSpeed's ``torch.save`` engine), to
``OUT/<format>_std`` (ZeRO-2) and ``OUT/<format>_std_z3`` (ZeRO-3); then each model of
:data:`VARIANTS` (another model: a wider embedding, an extra parameter, a parameter fewer, the
same parameters registered in another order) trained one step and saved the same way (ZeRO-2) to
``OUT/<format>_<variant>``.

``load`` (any world size): a fresh TinyLM engine of each stage loads ``<format>_std[_z3]`` and
every rank writes the client state it got back to ``OUT/client_<format>_z<stage>_rank<r>.pt``
(the metrics ``OUT/metrics_client_<format>_z<stage>.jsonl`` hold a ``load`` record when the load
was resharded). Then a reference engine trains
:data:`TRIAL_STEPS` + 1 steps; a trial engine trains :data:`TRIAL_STEPS` steps, tries to load
every variant checkpoint (each must fail), and trains one step more. Every rank writes its
errors and both engines' losses of the last step to ``OUT/trial_rank<r>.json``, rank 0 both
engines' gathered state to ``OUT/state_{reference,trial}.pt``.

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment (no launcher).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from tests.workers.common import VOCAB, TinyLM, Tokens, allow_cpu_fp16, base_config, gather_state  # noqa: E402

FORMATS = ("ours", "torch")
VARIANTS = ("wide", "extra", "fewer", "reordered")
SAVE_STEPS = 3
TRIAL_STEPS = 2


class ExtraLM(TinyLM):
    """TinyLM with one parameter more (``extra``, 3 elements)."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Parameter(torch.zeros(3))

    def forward(self, tokens):
        return super().forward(tokens) + 0.0 * self.extra.sum()


class FewerLM(TinyLM):
    """TinyLM whose ``gain`` is a constant buffer instead of a parameter."""

    def __init__(self):
        super().__init__()
        del self.gain
        self.register_buffer("gain", torch.ones(1))


class ReorderedLM(TinyLM):
    """TinyLM's parameters (names and shapes) registered in another order: ``head`` first."""

    def __init__(self, width: int = 13):
        torch.nn.Module.__init__(self)
        self.head = torch.nn.Linear(7, VOCAB)
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.mix = torch.nn.Linear(width, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.gain = torch.nn.Parameter(torch.ones(1))


def model_of(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    models = {"std": TinyLM, "wide": lambda: TinyLM(width=14), "extra": ExtraLM, "fewer": FewerLM}
    return {**models, "reordered": ReorderedLM}[variant]()


def client_state() -> dict:
    """The client state saved with every checkpoint (deterministic): tensors of many dtypes and
    sizes, most far above the 64 KiB a snapshot file's skeleton carries, 0-d and empty ones,
    a non-contiguous one, nested in dicts, lists and tuples beside plain values."""
    g = torch.Generator().manual_seed(11)
    return {
        "fp32_1mib": torch.randn(1 << 18, generator=g),
        "bf16": torch.randn(300, 200, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(50_000, generator=g).to(torch.float16),
        "int64": torch.randint(-(2**40), 2**40, (20_000,), generator=g),
        "bool": torch.rand(100_000, generator=g) > 0.5,
        "fp64_0d": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 7),
        "small_int32": torch.arange(10, dtype=torch.int32),
        "transposed": torch.randn(200, 300, generator=g).t(),
        "nested": {
            "list": [torch.randn(40_000, generator=g), {"deep_uint8": torch.full((70_000,), 200, dtype=torch.uint8)}],
            "tuple": (torch.full((3, 9000), -7, dtype=torch.int16), 5),
            "step": 17,
            "name": "client",
        },
    }


def config(metrics: str, stage: int = 2) -> dict:
    cfg = base_config(stage, metrics)
    cfg["dynatrain"].pop("max_world_size", None)
    return cfg


def build(variant: str, metrics: str, stage: int = 2):
    model = model_of(variant)
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=Tokens(), config=config(metrics, stage)
    )
    return engine, iter(loader)


def train(engine, it, until: int) -> list:
    """Train to step ``until``; returns this rank's micro-batch losses of the last step."""
    losses = []
    while engine.global_steps < until:
        loss = engine(next(it))
        losses.append(loss.item())
        engine.backward(loss)
        before = engine.global_steps
        engine.step()
        if engine.global_steps != before and engine.global_steps < until:
            losses = []
    return losses


def save(out: str) -> None:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    for variant, stage in [("std", 2), ("std", 3)] + [(v, 2) for v in VARIANTS]:
        name = f"{variant}_z3" if stage == 3 else variant
        engine, it = build(variant, os.path.join(out, f"metrics_save_{name}.jsonl"), stage)
        train(engine, it, SAVE_STEPS if variant == "std" else 1)
        engine.save_checkpoint(os.path.join(out, f"ours_{name}"), tag="ckpt", client_state=client_state())
        engine.checkpoint_engine.wait()
        ours, engine.checkpoint_engine = engine.checkpoint_engine, TorchCheckpointEngine()
        engine.save_checkpoint(os.path.join(out, f"torch_{name}"), tag="ckpt", client_state=client_state())
        engine.checkpoint_engine = ours
        engine.checkpoint_engine.close()
        engine.destroy()


def load(out: str, load_from: str, rank: int) -> None:
    for fmt in FORMATS:
        for stage in (2, 3):
            name = "std_z3" if stage == 3 else "std"
            engine, _it = build("std", os.path.join(out, f"metrics_client_{fmt}_z{stage}.jsonl"), stage)
            _path, client = engine.load_checkpoint(os.path.join(load_from, f"{fmt}_{name}"), tag="ckpt")
            torch.save(client, os.path.join(out, f"client_{fmt}_z{stage}_rank{rank}.pt"))
            engine.checkpoint_engine.close()
            engine.destroy()
    engine, it = build("std", os.path.join(out, "metrics_reference.jsonl"))
    result = {"reference_losses": train(engine, it, TRIAL_STEPS + 1)}
    reference = gather_state(engine)
    engine.checkpoint_engine.close()
    engine.destroy()
    engine, it = build("std", os.path.join(out, "metrics_trial.jsonl"))
    train(engine, it, TRIAL_STEPS)
    errors = {}
    # every other model in both formats, then our snapshot with one bit flipped (the test did it)
    for case in [f"{fmt}_{variant}" for fmt in FORMATS for variant in VARIANTS] + ["ours_damaged"]:
        try:
            engine.load_checkpoint(os.path.join(load_from, case), tag="ckpt")
            errors[case] = None
        except Exception as err:  # noqa: BLE001 - the test checks the type and message
            errors[case] = {"type": type(err).__name__, "message": str(err)}
    result["errors"] = errors
    result["trial_losses"] = train(engine, it, TRIAL_STEPS + 1)
    trial = gather_state(engine)
    with open(os.path.join(out, f"trial_rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if rank == 0:
        torch.save(reference, os.path.join(out, "state_reference.pt"))
        torch.save(trial, os.path.join(out, "state_trial.pt"))
    engine.checkpoint_engine.close()
    engine.destroy()


def main():
    allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["save", "load"])
    p.add_argument("--out", required=True)
    p.add_argument("--load-from", default=None, help="directory the save job wrote (load mode)")
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    rank = int(os.environ["RANK"])
    if a.mode == "save":
        save(a.out)
    else:
        load(a.out, a.load_from, rank)
    import torch.distributed as tdist

    tdist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
