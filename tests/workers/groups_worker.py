"""Test worker: a model with two optimizer parameter groups of different hyperparameters, a
frozen embedding and tied input/output embeddings, trained with ZeRO stage 1, 2 or 3 in bf16 or
fp16 and resized through ``engine.resize`` at given steps or by the config's ``resize_schedule``.

Right before and right after each resize it writes:

* ``OUT/<tag>.pt`` (rank 0): the gathered fp32 master, Adam moments and step
  (:func:`~tests.workers.common.gather_state`, collective);
* ``OUT/<tag>_rank<r>.pt`` (every rank, joiners included): what this rank sees of the
  non-tensor state (:func:`rank_facts`, collective at stage 3): which optimizer group each
  parameter sits in and that group's hyperparameters, whether the tied parameters are one
  Parameter, the frozen embedding, the loss scaler.

``<tag>`` is ``before_<step>`` or ``after_<step>``; a joiner writes its ``after_<step>`` files
once it has joined. ``start_rank<r>.pt`` (no gather: Adam has no state yet) and ``final*`` frame
the run. Rank 0 also writes ``OUT/steps.jsonl``: per optimizer step, every group's LR, the
skipped steps and the loss scale.

Started by ``dynatrain launch`` (which appends ``--deepspeed_config``).
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
from ds_dynatrain.zero.geometry import fp32_partitions, is_zero3, trainable_groups, working_partitions  # noqa: E402
from ds_dynatrain.zero.state import relink_optimizer_state  # noqa: E402
from tests.workers.common import VOCAB, Tokens, allow_cpu_fp16, gather_state  # noqa: E402

# per group: the hyperparameters the client sets (they override the config's optimizer params)
GROUP_HPARAMS = (
    {"lr": 2e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)},  # "decay": matrices and embeddings
    {"lr": 5e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},  # "no_decay": biases, norms, gains
)


class GroupsLM(torch.nn.Module):
    """Odd sizes (width 11, a 1-element gain, 37-token vocabulary); ``frozen`` is a fixed
    embedding (never trained); ``head.weight`` *is* ``tok.weight`` (tied input/output
    embedding, one Parameter under two names)."""

    def __init__(self, width: int = 11, frozen_width: int = 5):
        super().__init__()
        self.frozen = torch.nn.Embedding(VOCAB, frozen_width)
        self.frozen.weight.requires_grad_(False)
        self.tok = torch.nn.Embedding(VOCAB, width)
        self.proj = torch.nn.Linear(frozen_width, width)
        self.mix = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.gain = torch.nn.Parameter(torch.ones(1))
        self.head = torch.nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens[:, :-1]
        h = self.tok(x) + self.proj(self.frozen(x))
        h = self.norm(torch.tanh(self.mix(h))) * self.gain
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


# GroupsLM's trainable parameters as DeepSpeed names them: frozen.weight is never trained, and the
# tied head.weight is tok.weight (named_parameters lists it once)
TRAINABLE_NAMES = (
    "gain",
    "tok.weight",
    "proj.weight",
    "proj.bias",
    "mix.weight",
    "mix.bias",
    "norm.weight",
    "norm.bias",
)


def group_of(name: str) -> int:
    """The client's group of a parameter: 0 for matrices and embeddings, 1 for the rest."""
    return 0 if name.endswith("weight") and not name.startswith("norm") else 1


def param_groups(model: torch.nn.Module) -> list:
    """Two groups whose members interleave in model order; the frozen embedding is in group 0
    (DeepSpeed leaves it out of the flat group)."""
    groups = [{"params": [], **hp} for hp in GROUP_HPARAMS]
    for name, p in model.named_parameters():
        groups[group_of(name)]["params"].append(p)
    return groups


def whole(p: torch.nn.Parameter) -> torch.Tensor:
    """A copy of the working parameter, whole, in its working dtype (a ZeRO-3 parameter is
    gathered with DeepSpeed's ``GatheredParameters``: collective)."""
    if hasattr(p, "ds_id"):
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([p]):
            return p.data.detach().clone()
    return p.detach().clone()


def state_in_group(zopt) -> list:
    """Per optimizer parameter group: whether the Adam state sits on that group's own fp32
    partitions, partition-shaped.

    Stages 1/2: the torch group holds exactly its one fp32 partition, which has state. Stage 3:
    the torch groups are empty between steps (DeepSpeed puts one sub-group's partition in at a
    time), so every fp32 sub-group partition that ``sub_group_to_group_id`` maps to the group
    has state, and the group has at least one.
    """
    basic = zopt.optimizer
    parts = fp32_partitions(zopt)

    def has_state(t):
        st = basic.state.get(t, {})
        return all(k in st and st[k].shape == t.shape for k in ("exp_avg", "exp_avg_sq"))

    if not is_zero3(zopt):
        return [
            len(g["params"]) == 1 and g["params"][0] is parts[gi] and has_state(parts[gi])
            for gi, g in enumerate(basic.param_groups)
        ]
    owned = [
        [b for b in range(len(parts)) if zopt.sub_group_to_group_id[b] == gi] for gi in range(len(basic.param_groups))
    ]
    return [bool(subs) and all(has_state(parts[b]) for b in subs) for subs in owned]


def rank_facts(engine, model, returned_opt) -> dict:
    """This rank's view of the non-tensor state (see the module docstring)."""
    zopt = engine.optimizer
    basic = zopt.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = trainable_groups(zopt)
    membership = {}
    for gi, params in enumerate(groups):
        for p in params:
            membership[names[id(p)]] = gi
    hparams = [
        {"lr": g["lr"], "weight_decay": g["weight_decay"], "betas": tuple(g["betas"]), "eps": g["eps"]}
        for g in basic.param_groups
    ]
    scaler = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(zopt.loss_scaler).items()}
    all_names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        all_names.setdefault(id(p), []).append(n)
    return {
        "rank": engine.global_rank,
        "world_size": engine.dp_world_size,
        "zero3": is_zero3(zopt),
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "membership": membership,
        "partition_keys": [tuple(names[id(p)] for p in ps) for ps in working_partitions(zopt)],
        "hparams": hparams,
        "returned_hparams": [
            {k: g[k] for k in ("lr", "weight_decay")} | {"betas": tuple(g["betas"])} for g in returned_opt.param_groups
        ],
        "returned_is_engine_optimizer": returned_opt is engine.optimizer,
        "state_in_group": state_in_group(zopt),
        "tied": model.head.weight is model.tok.weight and engine.module is model,
        "tied_names": sorted(ns for ns in all_names.values() if len(ns) > 1),
        "tied_working": whole(model.head.weight),
        "frozen": whole(model.frozen.weight),
        "frozen_requires_grad": model.frozen.weight.requires_grad,
        "frozen_in_optimizer": any(p is model.frozen.weight for ps in groups for p in ps),
        "scaler_class": type(zopt.loss_scaler).__name__,
        "scaler": scaler,
        "dynamic_loss_scale": zopt.dynamic_loss_scale,
    }


def main():
    allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument(
        "--resize",
        default="",
        help="STEP:WORLD,... resizes through engine.resize (the config's resize_schedule works too)",
    )
    p.add_argument("--deepspeed_config", required=True)
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] lines on stdout
    resize = {int(s): int(w) for s, w in (x.split(":") for x in a.resize.split(",") if x)}

    torch.manual_seed(0)
    model = GroupsLM()
    torch.save(model.frozen.weight.detach().clone(), os.path.join(a.out, f"frozen_init_{os.environ['RANK']}.pt"))
    engine, opt, loader, _sched = ds_dynatrain.initialize(
        model=model, model_parameters=param_groups(model), training_data=Tokens(), config=a.deepspeed_config
    )

    def save(tag, gather=True):
        if gather:  # torch's Adam has no state before the first step
            # DeepSpeed 0.19.8 links the optimizer-state fragments of every group right after the
            # first group's first step, when the later groups have no state yet, and never again:
            # safe_get_full_optimizer_state fails for groups > 0 until they are linked again
            relink_optimizer_state(engine)
            state = gather_state(engine)
            if engine.global_rank == 0:
                torch.save(state, os.path.join(a.out, f"{tag}.pt"))
        torch.save(rank_facts(engine, model, opt), os.path.join(a.out, f"{tag}_rank{engine.global_rank}.pt"))

    resize_now = engine.resize

    def resize_saving_state(world_size):
        """``engine.resize`` with the state saved right before and right after it; installed on
        the engine, so the config's ``resize_schedule`` (which calls it from ``step``) saves too."""
        s = engine.global_steps
        save(f"before_{s}")
        record = resize_now(world_size)
        if engine.is_member:
            engine.wait_transition()  # the optimizer moments arrive in the background
            save(f"after_{s}")
        return record

    engine.resize = resize_saving_state
    if engine.global_steps == 0:
        save("start", gather=False)
    else:  # a joiner: take part in the survivors' post-resize gather
        engine.wait_transition()
        save(f"after_{engine.global_steps}")
    while engine.is_member and engine.global_steps < a.steps:
        for batch in loader:
            before = engine.global_steps
            engine.backward(engine(batch))
            engine.step()
            s = engine.global_steps
            if s == before:
                continue
            if engine.global_rank == 0:
                with open(os.path.join(a.out, "steps.jsonl"), "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "step": s,
                                "lrs": [g["lr"] for g in engine.optimizer.optimizer.param_groups],
                                "skipped_steps": engine.skipped_steps,
                                "loss_scale": engine.optimizer.loss_scaler.cur_scale,
                            }
                        )
                        + "\n"
                    )
            if s in resize:
                engine.resize(resize[s])
            if not engine.is_member or s >= a.steps:
                break
    if engine.is_member:
        save("final")
    return 0


if __name__ == "__main__":
    sys.exit(main())
