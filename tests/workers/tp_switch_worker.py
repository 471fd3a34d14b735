"""Test worker: a tiny Hugging Face Llama trained under AutoTP + ZeRO whose TP degree is switched
online, and the oracle run beside it.

``--mode switch``: ``ds_dynatrain.initialize`` at TP ``--tp-from``; ``--steps-before`` steps;
the gathered logical state (every parameter's fp32 master and Adam moments whole, the optimizer
step) saved to ``before.pt``; ``engine.resize(world, tensor_parallel=--tp-to)``; the state saved
again to ``after.pt``; ``--steps-after`` steps, each step's loss recorded; the final state to
``final_switch.pt`` and the losses to ``losses_switch.json``.

``--mode static`` (the oracle): plain ``deepspeed.initialize`` at TP ``--tp-to``, the state of
``before.pt`` set with DeepSpeed's own accessors (each TP shard cut by the layer's own affine map,
``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state``, the step set on the optimizer
state), then the same ``--steps-after`` steps on the same batches: ``final_static.pt`` and
``losses_static.json``. No code of ds_dynatrain runs in this mode.

``--mode schedule``: as ``switch``, but the switch is the config's ``resize_schedule`` entry
``{"step": --steps-before, "world_size": W, "tensor_parallel": --tp-to}``, served inside
``engine.step()``: ``final_schedule.pt`` and ``losses_schedule.json`` (with the resize records).

The global batch is 4 sequences every step; micro-batch 1, so a DP rank ``r`` of ``d`` takes row
``i * d + r`` at micro-step ``i`` (every TP rank of a DP rank the same rows).

``switch`` and ``schedule`` end through the interpreter's own exit, the names of their OS threads
written after the library's exit hooks to ``threads_<mode>_rank<r>``; the other modes end without
the interpreter's teardown (``exit_without_teardown``: plain DeepSpeed leaves gloo threads to it).

Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.workers.common import allow_cpu_fp16, exit_without_teardown, record_threads_at_exit  # noqa: E402

GLOBAL = 4


def fp32_partitions(engine) -> list:
    """The ZeRO optimizer's fp32 master partitions (stages 1/2: per group; stage 3: per sub-group)."""
    opt = engine.optimizer
    return list(getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat)


SEQ = 12
VOCAB = 96
Q = "model.layers.0.self_attn.q_proj.weight"  # 6 heads of 8 in 3 KV groups: rows 32 + 16 at TP 2


def model_and_config(a):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    # Qwen3: its q_norm/k_norm are replicated with a TP all-reduce of their gradients (a hook)
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if a.qwen3 else (LlamaConfig, LlamaForCausalLM)
    cfg = config_class(
        hidden_size=48,
        head_dim=8,
        intermediate_size=101,
        num_attention_heads=6,
        num_key_value_heads=3,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        tie_word_embeddings=a.tie,
    )
    model = model_class(cfg)
    for name in filter(None, a.freeze.split(",")):  # frozen: not in the optimizer
        model.get_parameter(name).requires_grad_(False)
    ds = {
        "train_batch_size": GLOBAL,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "zero_optimization": {"stage": a.stage},
        "steps_per_print": 10**9,
    }
    if a.fp16:  # a fixed loss scale: the static run's fresh scaler and the switched job's agree
        allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
        ds["fp16"] = {"enabled": True, "loss_scale": 256}
    if a.bf16:
        ds["bf16"] = {"enabled": True}
    return model, ds


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g) for _ in range(n)]


def train_step(engine, batch, tp: int) -> float:
    """One optimizer step on the global ``batch``; returns the global mean loss."""
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dp, dp_rank = world // tp, rank // tp
    gas = GLOBAL // dp
    total = torch.zeros(())
    for i in range(gas):
        x = batch[i * dp + dp_rank : i * dp + dp_rank + 1]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        total += loss.detach().float()
        if i == gas - 1:  # over the world that trained: the last step() may resize it (the schedule)
            tdist.all_reduce(total)  # every TP rank of a DP rank holds the same loss
        engine.step()
    return (total / (gas * world)).item()


def gather_logical(engine) -> dict:
    """Every trainable parameter's fp32 master and Adam moments whole (the TP shards joined with
    the layer's own affine map), every frozen parameter's value, and the optimizer step
    (collective)."""
    from deepspeed.checkpoint.affine import ParamAffineMap
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

    tp = groups.get_tensor_model_parallel_world_size() if groups._TENSOR_MODEL_PARALLEL_GROUP is not None else 1
    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:  # frozen: no optimizer state; its value (never cut) is compared
            out[name] = {"param": p.detach().clone()}
            continue
        if getattr(p, "ds_numel", p.numel()) == 0:  # an empty shard (TP above the KV heads): no fragment
            local = {k: torch.empty(p.shape) for k in ("fp32", "exp_avg", "exp_avg_sq")}
        else:
            local = {
                "fp32": safe_get_full_fp32_param(p),
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq"),
            }
        meta = getattr(p, DS_AUTOTP_UC_META, None)
        amap = meta and meta["conversion"].get("affine_map")
        if tp > 1 and amap:
            shards = [None] * tp
            tdist.all_gather_object(shards, local, group=groups.get_tensor_model_parallel_group())
            m = ParamAffineMap.from_dict(amap)
            local = {k: m.rebuild({t: shards[t][k] for t in range(tp)}) for k in local}
        out[name] = {k: v.detach().clone() for k, v in local.items()}
    out["__step__"] = [float(engine.optimizer.optimizer.state[f]["step"]) for f in fp32_partitions(engine)]
    return out


def set_logical(engine, state: dict) -> None:
    """DeepSpeed's own route: cut each whole tensor by the layer's affine map and set it (the fp32
    master and moments with DeepSpeed's setters, the working parameter from the master)."""
    from deepspeed.checkpoint.affine import ParamAffineMap
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from deepspeed.utils import groups, safe_set_full_fp32_param, safe_set_full_optimizer_state

    opt = engine.optimizer
    zero3 = not hasattr(opt, "single_partition_of_fp32_groups")
    for f in fp32_partitions(engine):
        opt.optimizer.state[f] = {
            "step": torch.tensor(state["__step__"][0]),
            "exp_avg": torch.zeros_like(f),
            "exp_avg_sq": torch.zeros_like(f),
        }
    if not zero3:
        opt._lazy_init_hp_params_optimizer_state()
    tp_rank = groups.get_tensor_model_parallel_rank() if groups._TENSOR_MODEL_PARALLEL_GROUP is not None else 0
    for name, p in engine.module.named_parameters():
        meta = getattr(p, DS_AUTOTP_UC_META, None)
        amap = meta and meta["conversion"].get("affine_map")

        if getattr(p, "ds_numel", p.numel()) == 0 or not p.requires_grad:  # frozen: as the model was built
            continue

        def cut(t, amap=amap):
            return ParamAffineMap.from_dict(amap).extract(t, tp_rank) if amap else t

        safe_set_full_fp32_param(p, cut(state[name]["fp32"]))
        if not zero3:
            with torch.no_grad():  # the working parameter (ZeRO-1/2: whole on every DP rank), as a step leaves it
                p.copy_(cut(state[name]["fp32"]).to(p.dtype))
        safe_set_full_optimizer_state(p, cut(state[name]["exp_avg"]), "exp_avg")
        safe_set_full_optimizer_state(p, cut(state[name]["exp_avg_sq"]), "exp_avg_sq")
    if zero3:  # the working partitions from the master, as DeepSpeed's ZeRO-3 step leaves them
        with torch.no_grad():
            for flat, fp32 in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat):
                flat.copy_(fp32)


def q_shape(engine) -> list:
    """This rank's shape of the first q_proj (ZeRO-3: the TP shard's, not the local partition's)."""
    p = dict(engine.module.named_parameters())[Q]
    return list(getattr(p, "ds_shape", p.shape))


def tdist_world() -> int:
    return int(os.environ["WORLD_SIZE"])


def current_tp() -> int:
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_world_size() if groups._TENSOR_MODEL_PARALLEL_GROUP is not None else 1


def launched(a) -> None:
    """Under ``dynatrain launch``: train ``--steps``; after step K of ``--resize-at K:W:T`` every
    process calls ``engine.resize(W, tensor_parallel=T)`` (the state gathered before and after);
    with ``--preempt K:R`` the process of rank R sends itself SIGTERM as step K starts (a
    preemption notice, served at that step's boundary). A process the launcher starts for a grow
    enters at the job's step. Rank 0 of the last world writes ``final_launch.pt`` and
    ``losses_launch.json`` (losses of the steps after K, the records)."""
    import signal

    import ds_dynatrain

    ds_dynatrain.log_to_console()
    model, _ = model_and_config(a)
    with open(a.deepspeed_config) as f:
        ds = json.load(f)
    data = batches(a.steps)
    engine, _, _, _ = ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=ds)
    k, world, tp = (int(x) for x in a.resize_at.split(":")) if a.resize_at else (0, 0, 0)
    pk, pr = (int(x) for x in a.preempt.split(":")) if a.preempt else (0, -1)
    losses = []
    first = engine.global_steps + 1  # a joiner enters at the job's step, after the grow
    if first > 1 and a.resize_at and not a.by_schedule:
        gather_logical(engine)  # the survivors' gather after the resize (collective)
    for s in range(first, a.steps + 1):
        if s == pk and tdist.get_rank() == pr:
            os.kill(os.getpid(), signal.SIGTERM)
        loss = train_step(engine, data[s - 1], current_tp())
        time.sleep(a.step_sleep)  # time for a request from outside to arrive
        if not engine.is_member:
            return
        if s > max(k, pk):
            losses.append(loss)
        if s == k and not a.by_schedule:
            before = gather_logical(engine)
            if tdist.get_rank() == 0:
                torch.save(before, os.path.join(a.out, "before.pt"))
            engine.resize(world, tensor_parallel=tp)
            if not engine.is_member:
                return
            after = gather_logical(engine)
            if tdist.get_rank() == 0:
                torch.save(after, os.path.join(a.out, "after.pt"))
    final = gather_logical(engine)
    if tdist.get_rank() == 0:
        torch.save(final, os.path.join(a.out, "final_launch.pt"))
        with open(os.path.join(a.out, "losses_launch.json"), "w") as f:
            json.dump({"losses": losses, "records": engine.resize_records, "tp": current_tp()}, f)


def saved_and_loaded(a, model, ds, data, rank: int) -> None:
    """``--mode save``: ``--steps-before`` steps at TP ``--tp-from``, the gathered state to
    ``before.pt`` and a checkpoint to ``ckpt/`` (``--save-with deepspeed``: plain DeepSpeed's own
    ``save_checkpoint``, no code of ds_dynatrain; ``ours``: the snapshot engine's files;
    ``snapshots``: ``dynatrain.snapshot`` every step, the first step at TP ``--tp-to``, then a TP
    switch to ``--tp-from``; the snapshot of the last step is loaded). ``--mode
    load``: ``ds_dynatrain.initialize`` at TP ``--tp-to``, ``load_checkpoint(ckpt/)``, the state to
    ``after.pt``, then ``--steps-after`` steps: ``losses_switch.json`` and ``final_switch.pt``."""
    import deepspeed

    import ds_dynatrain

    ckpt = os.path.join(a.out, "ckpt")
    if a.mode == "save":
        ds["tensor_parallel"] = {"autotp_size": a.tp_from}
        if a.save_with == "snapshots":  # written every step, with a TP switch between the two
            ds["tensor_parallel"] = {"autotp_size": a.tp_to}
            ds["dynatrain"] = {"snapshot": {"interval_steps": 1, "dir": ckpt, "keep_last": 3}}
            engine, _, _, _ = ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=ds)
            train_step(engine, data[0], a.tp_to)
            engine.resize(tdist_world(), tensor_parallel=a.tp_from)
            for s in range(1, a.steps_before):
                train_step(engine, data[s], a.tp_from)
            before = gather_logical(engine)
            engine.checkpoint_engine.wait()
            tdist.barrier()  # as for "ours"
            if rank == 0:
                torch.save(before, os.path.join(a.out, "before.pt"))
            return
        if a.save_with == "deepspeed":
            del ds["train_batch_size"]  # as the static run: plain DeepSpeed counts TP ranks in the batch
            ds["gradient_accumulation_steps"] = GLOBAL // (tdist_world() // a.tp_from)
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        else:
            engine, _, _, _ = ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=ds)
        for s in range(a.steps_before):
            train_step(engine, data[s], a.tp_from)
        before = gather_logical(engine)
        engine.save_checkpoint(ckpt)  # no client state: see benchmarks.tp_reconfig
        if a.save_with == "ours":
            engine.checkpoint_engine.wait()  # committed before the process exits
            tdist.barrier()  # rank 0 hosts the store every rank reads the outcome from: it exits last
        if rank == 0:
            torch.save(before, os.path.join(a.out, "before.pt"))
        return
    ds_dynatrain.log_to_console()
    if not a.no_autotp:
        ds["tensor_parallel"] = {"autotp_size": a.tp_to}
    engine, _, _, _ = ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=ds)
    refusal = ""
    if a.refuse:  # a copy of the checkpoint without one TP rank's optimizer file: refused, nothing changed
        from ds_dynatrain.errors import CheckpointIncompleteError

        broken = os.path.join(a.out, "broken")
        if rank == 0:
            shutil.copytree(ckpt, broken)
            tag = open(os.path.join(broken, "latest")).read().strip()
            victim = sorted(f for f in os.listdir(os.path.join(broken, tag)) if "mp_rank_01_optim" in f)[-1]
            os.remove(os.path.join(broken, tag, victim))
        tdist.barrier()

        def local_state():  # before any step there are no moments: the master and the working parameters
            return [f.clone() for f in fp32_partitions(engine)] + [p.detach().clone() for p in engine.parameters()]

        untouched = local_state()
        try:
            engine.load_checkpoint(broken)
        except CheckpointIncompleteError as err:
            refusal = str(err)
        torch.save({"before": untouched, "after": local_state()}, os.path.join(a.out, f"refused{rank}.pt"))
    path, _client = engine.load_checkpoint(ckpt)
    after = gather_logical(engine)
    losses = [train_step(engine, data[a.steps_before + s], a.tp_to) for s in range(a.steps_after)]
    final = gather_logical(engine)
    if rank == 0:
        torch.save(after, os.path.join(a.out, "after.pt"))
        torch.save(final, os.path.join(a.out, "final_switch.pt"))
        with open(os.path.join(a.out, "losses_switch.json"), "w") as f:
            json.dump({"losses": losses, "path": path, "steps": engine.global_steps, "refusal": refusal}, f)


# modes that end through the interpreter's exit (this project's engines; the plain DeepSpeed ones
# end with exit_without_teardown), their OS threads written to ``threads_<mode>_rank<r>``
OWN_EXIT = ("switch", "schedule")


def main() -> None:
    global GLOBAL  # --global-batch sets it
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["switch", "schedule", "static", "launch", "save", "load"], required=True)
    p.add_argument(
        "--save-with",
        choices=["deepspeed", "ours", "snapshots"],
        default="ours",
        help="(save) DeepSpeed's save_checkpoint, ours, or the snapshots of dynatrain.snapshot (a TP switch between)",
    )
    p.add_argument("--deepspeed_config", default=None, help="(launch) appended by dynatrain launch")
    p.add_argument("--steps", type=int, default=5, help="(launch) steps in all")
    p.add_argument("--resize-at", default="", help="(launch) K:W:T engine.resize(W, tensor_parallel=T) after step K")
    p.add_argument(
        "--by-schedule", action="store_true", help="(launch) the resize of --resize-at is the config's schedule's"
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="(launch) seconds slept after each step")
    p.add_argument("--preempt", default="", help="(launch) K:R rank R is sent SIGTERM as step K starts")
    p.add_argument("--tp-from", type=int, required=True)
    p.add_argument("--tp-to", type=int, required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--no-autotp", action="store_true", help="(load) the loading job has no tensor_parallel section")
    p.add_argument("--tie", action="store_true")
    p.add_argument("--qwen3", action="store_true", help="a Qwen3 model instead of Llama")
    p.add_argument("--freeze", default="", help="parameter names, comma-separated, frozen before initialize")
    p.add_argument("--expect-refusal", action="store_true", help="(switch) the switch is refused; train on")
    p.add_argument("--steps-before", type=int, default=2)
    p.add_argument("--steps-after", type=int, default=2)
    p.add_argument("--max-inflight-bytes", type=int, default=0, help="(switch) dynatrain.max_inflight_bytes")
    p.add_argument(
        "--refuse", action="store_true", help="first ask for impossible layouts, or (load) a damaged checkpoint"
    )
    p.add_argument("--global-batch", type=int, default=GLOBAL, help="sequences a step (the config's in launch mode)")
    a = p.parse_args()
    GLOBAL = a.global_batch
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no op build in the tests
    if a.mode == "launch":
        launched(a)
        return
    model, ds = model_and_config(a)
    data = batches(a.steps_before + a.steps_after)
    rank = int(os.environ["RANK"])
    if a.mode in OWN_EXIT:  # registered before the engine: runs after the library's exit hooks
        atexit.register(record_threads_at_exit, os.path.join(a.out, f"threads_{a.mode}_rank{rank}"))
    if a.mode == "schedule":  # the switch inside engine.step() of the last step before it
        import ds_dynatrain

        ds["tensor_parallel"] = {"autotp_size": a.tp_from}
        entry = {"step": a.steps_before, "world_size": tdist_world(), "tensor_parallel": a.tp_to}
        ds["dynatrain"] = {"resize_schedule": [entry]}
        engine, _, _, _ = ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=ds)
        for s in range(a.steps_before):
            train_step(engine, data[s], a.tp_from)
        losses = [train_step(engine, data[a.steps_before + s], a.tp_to) for s in range(a.steps_after)]
        final = gather_logical(engine)
        if rank == 0:
            torch.save(final, os.path.join(a.out, "final_schedule.pt"))
            with open(os.path.join(a.out, "losses_schedule.json"), "w") as f:
                json.dump({"losses": losses, "records": engine.resize_records}, f)
    elif a.mode == "switch":
        import ds_dynatrain
        from ds_dynatrain.errors import ResizeRefusedError

        ds_dynatrain.log_to_console()
        ds["tensor_parallel"] = {"autotp_size": a.tp_from}
        ds["dynatrain"] = {"max_inflight_bytes": a.max_inflight_bytes} if a.max_inflight_bytes else {}
        engine, _, _, _ = ds_dynatrain.initialize(model=model, model_parameters=model.parameters(), config=ds)
        for s in range(a.steps_before):
            train_step(engine, data[s], a.tp_from)
        world = tdist.get_world_size()
        refusals = []
        if a.expect_refusal:  # the switch refused; training goes on at the old TP, nothing changed
            before = gather_logical(engine)
            try:
                engine.resize(world, tensor_parallel=a.tp_to)
            except ResizeRefusedError as err:
                refusals.append(str(err))
            after = gather_logical(engine)
            losses = [train_step(engine, data[a.steps_before + s], a.tp_from) for s in range(a.steps_after)]
            if rank == 0:
                torch.save({"before": before, "after": after}, os.path.join(a.out, "refused.pt"))
                with open(os.path.join(a.out, "refused.json"), "w") as f:
                    json.dump({"losses": losses, "refusals": refusals}, f)
            return
        if a.refuse:
            for kwargs in ({"tensor_parallel": 3}, {"tensor_parallel": world, "world_size": world - 1}):
                try:
                    engine.resize(kwargs.pop("world_size", world), **kwargs)
                except ResizeRefusedError as err:
                    refusals.append(str(err))
        before = gather_logical(engine)
        shapes = {"before": q_shape(engine)}
        record = engine.resize(world, tensor_parallel=a.tp_to)
        shapes["after"] = q_shape(engine)
        after = gather_logical(engine)
        losses = [train_step(engine, data[a.steps_before + s], a.tp_to) for s in range(a.steps_after)]
        final = gather_logical(engine)
        if rank == 0:
            torch.save(before, os.path.join(a.out, "before.pt"))
            torch.save(after, os.path.join(a.out, "after.pt"))
            torch.save(final, os.path.join(a.out, "final_switch.pt"))
            with open(os.path.join(a.out, "losses_switch.json"), "w") as f:
                json.dump({"losses": losses, "record": record, "refusals": refusals, "q_proj": shapes}, f)
    elif a.mode in ("save", "load"):
        saved_and_loaded(a, model, ds, data, rank)
    else:
        if a.tp_to > 1:
            ds["tensor_parallel"] = {"autotp_size": a.tp_to}
        # plain DeepSpeed counts the batch over every process, TP ranks included: the accumulation
        # steps of the DP size are given instead of the global batch
        del ds["train_batch_size"]
        ds["gradient_accumulation_steps"] = GLOBAL // (tdist_world() // a.tp_to)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        set_logical(engine, torch.load(os.path.join(a.out, "before.pt")))
        losses = [train_step(engine, data[a.steps_before + s], a.tp_to) for s in range(a.steps_after)]
        final = gather_logical(engine)
        if rank == 0:
            torch.save(final, os.path.join(a.out, "final_static.pt"))
            with open(os.path.join(a.out, "losses_static.json"), "w") as f:
                json.dump({"losses": losses}, f)
    if a.mode not in OWN_EXIT:
        exit_without_teardown(0)


if __name__ == "__main__":
    main()
