"""The main job: a small Llama (Hugging Face transformers) trained on real text with DeepSpeed ZeRO,
resized online by ds_dynatrain.

Run it under the launcher (which adds ``--deepspeed_config``)::

    dynatrain launch --nproc 2 --slots 3 --config configs/zero2_elastic.json examples/train_lm.py --steps 60

or under torchrun, DeepSpeed's launcher or accelerate launch with ``--deepspeed_config`` and a
config without a resize schedule (snapshots, and ``--load`` at any world size; README "Launchers").

The loop below is an ordinary DeepSpeed loop; the resizes happen inside ``engine.step()`` and the
loader returned by ``ds_dynatrain.initialize`` follows them. A process that leaves the job at a
resize sees its loader end and simply returns.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import deepspeed
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from text_data import ByteTextDataset  # noqa: E402

import ds_dynatrain  # noqa: E402


def build_model(seq_len: int, layers: int = 4, hidden: int = 256):
    """A byte-level Llama: vocabulary 256, ``layers`` x ``hidden`` (about 3.3 M parameters at 4 x 256)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875) // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(cfg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None, help="text file or folder (default: the Python standard library sources)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--static", action="store_true", help="ignore the resize schedule (the run to compare with)")
    p.add_argument("--metrics", default=None, help="metrics JSON-lines path (overrides dynatrain.metrics_path)")
    p.add_argument("--snapshot-dir", default=None, help="overrides dynatrain.snapshot.dir")
    p.add_argument(
        "--load", default=None, help="checkpoint directory to start from (a snapshot directory), at any world size"
    )
    p.add_argument("--load-tag", default=None, help="the tag to load from --load (default: the one 'latest' names)")
    # DeepSpeed's launcher (`deepspeed script.py`) passes --local_rank=N; torchrun, accelerate and
    # dynatrain launch set LOCAL_RANK instead (DeepSpeed reads that one itself)
    p.add_argument("--local_rank", type=int, default=-1, help="local rank, passed by DeepSpeed's launcher")
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args(argv)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout

    with open(args.deepspeed_config) as f:
        config = json.load(f)
    section = config.setdefault("dynatrain", {})
    if args.static:
        section["resize_schedule"] = []
    if args.metrics:
        section["metrics_path"] = args.metrics
    if args.snapshot_dir:
        section.setdefault("snapshot", {})["dir"] = args.snapshot_dir

    torch.manual_seed(args.seed)
    model = build_model(args.seq_len, args.layers, args.hidden)
    dataset = ByteTextDataset(args.data, args.seq_len)
    engine, _optimizer, loader, _scheduler = ds_dynatrain.initialize(
        model=model, model_parameters=model.parameters(), training_data=dataset, config=config, seed=args.seed
    )
    if args.load and engine.global_steps == 0:  # a joiner, or a job restored after a failure, has the job's state
        engine.load_checkpoint(args.load, args.load_tag)
    if engine.global_rank == 0 and engine.global_steps == 0:
        # under ZeRO-3 a parameter's own tensor is an empty placeholder: its size is ds_numel
        n = sum(getattr(q, "ds_numel", q.numel()) for q in engine.module.parameters())
        print(
            f"model: Llama, {n / 1e6:.2f} M parameters; data: {dataset.source}, {len(dataset)} samples of "
            f"{args.seq_len} bytes; ZeRO stage {engine.zero_optimization_stage()}, world size "
            f"{engine.dp_world_size}",
            flush=True,
        )

    while engine.is_member and engine.global_steps < args.steps:
        for batch in loader:
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            if engine.global_steps >= args.steps:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
