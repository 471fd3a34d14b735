"""Test worker: checkpoints for ``dynatrain export`` with what TinyLM lacks.

``llama``: a tiny Hugging Face ``LlamaForCausalLM`` with tied input and output embeddings and a
frozen final norm (set to non-trivial values first), trained one step at ZeRO-3 through
``ds_dynatrain.initialize``; writes ``llama/config.json``, a snapshot (``llama/ours/ckpt``), a
DeepSpeed checkpoint (``llama/torch/ckpt``) of the same state and ``llama/state.pt``: the
gathered fp32 masters (``state[name]["fp32"]``) plus ``state["__frozen__"][name]`` (whole values).

``extras``, ``extras_z1``: TinyLM with a frozen parameter and two persistent buffers (fp32 and
int64), trained one step at ZeRO-2 and ZeRO-1; same files under ``extras/`` and ``extras_z1/``
(``state["__buffers__"]`` too).

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment (no launcher).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import ds_dynatrain  # noqa: E402
from tests.workers.common import TinyLM, Tokens, allow_cpu_fp16, base_config, gather_state  # noqa: E402


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.model.norm.weight.requires_grad_(False)
    return model


class TinyLMExtras(TinyLM):
    """TinyLM with a frozen parameter and persistent buffers of two dtypes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))
        self.register_buffer("seen", torch.arange(5, dtype=torch.int64))
        self.bias_frozen = torch.nn.Parameter(torch.linspace(-1, 1, 37), requires_grad=False)

    def forward(self, tokens):
        h = self.norm(torch.tanh(self.mix(self.embed(tokens[:, :-1])))) * self.gain * self.scale
        logits = self.head(h) + self.bias_frozen
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def whole(p) -> torch.Tensor:
    if hasattr(p, "ds_id"):
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([p]):
            return p.detach().float().clone()
    return p.detach().float().clone()


def run(kind: str, out: str, rank: int) -> None:
    torch.manual_seed(0)
    model, stage = {"llama": (tiny_llama, 3), "extras": (TinyLMExtras, 2), "extras_z1": (TinyLMExtras, 1)}[kind]
    model = model()
    cfg = base_config(stage)
    cfg["dynatrain"].pop("max_world_size", None)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=params, training_data=Tokens(), config=cfg
    )
    for batch in loader:  # one optimizer step (several micro-batches)
        loss = engine(input_ids=batch, labels=batch).loss if kind == "llama" else engine(batch)
        engine.backward(loss)
        engine.step()
        if engine.global_steps >= 1:
            break
    d = os.path.join(out, kind)
    engine.save_checkpoint(os.path.join(d, "ours"), tag="ckpt")
    engine.checkpoint_engine.wait()
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ours, engine.checkpoint_engine = engine.checkpoint_engine, TorchCheckpointEngine()
    engine.save_checkpoint(os.path.join(d, "torch"), tag="ckpt")
    engine.checkpoint_engine = ours
    state = gather_state(engine)
    state["__frozen__"] = {n: whole(p) for n, p in engine.module.named_parameters() if not p.requires_grad}
    state["__buffers__"] = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
    if rank == 0:
        torch.save(state, os.path.join(d, "state.pt"))
        if kind == "llama":
            engine.module.config.save_pretrained(d)
    engine.checkpoint_engine.close()
    engine.destroy()


def main():
    allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="llama,extras,extras_z1")
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    rank = int(os.environ["RANK"])
    for kind in a.models.split(","):
        run(kind, a.out, rank)
    import torch.distributed as tdist

    tdist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
