"""Test worker: a small pipeline model (``tests/workers/pipeline_layout_worker.py``: an embedding
tied to the head, blocks of different widths, a norm) trained with DeepSpeed's pipeline engine and
ZeRO-1, whose PP degree is switched online, and the oracle run beside it.

``--mode switch``: ``ds_dynatrain.initialize`` at PP ``--pp-from``; ``--steps-before`` steps;
the gathered logical state (every parameter's fp32 master and Adam moments whole, from every
stage, the tied copies checked equal; the optimizer step) saved to ``before.pt``; resizes it
must refuse (their messages in ``refused``); ``engine.resize(world, pipeline_parallel=--pp-to)``;
the state saved again to ``after.pt``; ``--steps-after`` steps, each step's loss recorded; the
final state to ``final_switch.pt``, the losses and the resize record to ``switch_rank<r>.json``.

``--mode static`` (the oracle): plain ``deepspeed.initialize`` at PP ``--pp-to``, the state of
``before.pt`` set with DeepSpeed's own accessors (``safe_set_full_fp32_param`` /
``safe_set_full_optimizer_state``, the working parameters from the master, the step set on the
optimizer state), then the same ``--steps-after`` steps on the same batches: ``final_static.pt``
and ``static_rank<r>.json``. No code of ds_dynatrain runs in this mode.

``--mode route-save`` / ``route-load`` (the second oracle, DeepSpeed's universal-checkpoint
route): plain DeepSpeed at PP ``--pp-from`` trains ``--steps-before`` steps and saves to
``route/t``; after ``ds_to_universal`` (run by the test into ``route_universal/t``), plain
DeepSpeed at PP ``--pp-to`` with ``checkpoint.load_universal`` loads it and trains the same
``--steps-after`` steps: ``final_route-load.pt`` and ``route-load_rank<r>.json``.

``--mode schedule``: as ``switch``, the change made by the config's ``resize_schedule`` (PP
``--pp-to`` after step ``--steps-before``) inside ``train_batch``, with a snapshot of every step
(``dynatrain.snapshot``, into ``snaps``, all kept); first, schedules it must refuse at
``initialize`` (their messages in ``refused``); ``final_schedule.pt`` and
``schedule_rank<r>.json``.

``--mode load``: ``ds_dynatrain.initialize`` at PP ``--pp-to`` loads the checkpoint ``route-save``
wrote (DeepSpeed's own pipeline files, saved at PP ``--pp-from``; with ``--snapshots``,
``route-save`` is a ``ds_dynatrain`` job taking a snapshot every step; either writes the state it
saved to ``before.pt``); the gathered state to ``after.pt``, then the same
``--steps-after`` steps as ``static``: ``final_load.pt`` and ``load_rank<r>.json``. With
``--refuse`` it first loads a copy missing stage 1's optimizer-state file and layer 1's file, whole
and with ``load_module_only=True``: the errors in ``refusal`` and ``refusal_module_only``, every
rank's fp32 master and working parameters before and after them in ``refused<r>.pt``.

``--mode refuse-start``: ``ds_dynatrain.initialize`` of a layer list with a persistent buffer
on the last stage only: the error each rank gets in ``refuse-start_rank<r>.json``.

``--mode data``: the training data handed to ``ds_dynatrain.initialize`` (16 numbered samples),
``train_batch()`` without a ``data_iter``, the switch between: every sample each rank fetched,
with the step it was fetched in, to ``data_rank<r>.json``.

The global batch is 4 sequences every step, micro-batch 1: DP rank ``r`` of ``d`` takes row
``i * d + r`` at micro-step ``i``. Started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set.

``switch`` and ``schedule`` end through the interpreter's own exit, the names of their OS threads
written after the library's exit hooks to ``threads_<mode>_rank<r>``; the other modes end without
the interpreter's teardown (``exit_without_teardown``: plain DeepSpeed leaves gloo threads to it).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time

import torch
import torch.distributed as tdist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.workers.common import allow_cpu_fp16, exit_without_teardown, record_threads_at_exit  # noqa: E402
from tests.workers.pipeline_layout_worker import VOCAB, loss_fn, specs  # noqa: E402

GLOBAL_BATCH, SEQ = 4, 8


class Scale(torch.nn.Module):
    """A layer with a non-persistent buffer (made by its constructor, in no checkpoint): a layer
    list holding one is rebuilt for real at a switch, not on the meta device."""

    def __init__(self, width: int, persistent: bool = False):
        super().__init__()
        self.register_buffer("factor", torch.linspace(0.5, 1.5, width), persistent=persistent)

    def forward(self, x):
        return x * self.factor


def module_at(pp: int, method: str, buffer: bool = False, persistent: bool = False):
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = specs()
    if buffer:  # before the norm, a layer without parameters
        layers.insert(-2, LayerSpec(Scale, layers[-2].module_args[0], persistent))
    return PipelineModule(
        layers=layers,
        num_stages=pp,
        loss_fn=loss_fn,
        partition_method=method,
        seed_layers=True,
        base_seed=1234,
        seed_fn=lambda s: torch.manual_seed(int(s)),
    )


def config(a, pp: int, plain: bool) -> dict:
    dp = tdist.get_world_size() // pp
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    if not a.groups:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
    if a.dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    if a.dtype == "float16":  # a fixed loss scale: the static run's fresh scaler and the switched job's agree
        allow_cpu_fp16()  # SEAM: DeepSpeed's CPU fp16 check (see tests/workers/common.py)
        cfg["fp16"] = {"enabled": True, "loss_scale": 256}
    if plain:
        cfg["gradient_accumulation_steps"] = GLOBAL_BATCH // dp
    else:
        cfg["dynatrain"] = {"pipeline_partition_method": a.method_to if pp == a.pp_to else a.method}
    return cfg


def optimizer_args(a, module) -> dict:
    """``initialize``'s parameters: the module's (the config's AdamW), or with ``--groups`` a torch
    AdamW of two parameter groups, weight decay 0.1 for the weights and none for the biases and
    the norm (every stage holds some of each)."""
    if not a.groups:
        return {"model_parameters": module.parameters()}
    norms = {id(p) for m in module.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
    plain = [p for n, p in module.named_parameters() if n.endswith(".bias") or id(p) in norms]
    decay = [p for n, p in module.named_parameters() if not (n.endswith(".bias") or id(p) in norms)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]
    return {"optimizer": torch.optim.AdamW(groups, lr=1e-2)}


def train_step(engine, step: int) -> float:
    """One ``train_batch`` on the batch of ``step``; the loss every rank gets back."""
    grid = engine.grid
    dp, d = grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()
    batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    rows = [batch[i * dp + d : i * dp + d + 1] for i in range(GLOBAL_BATCH // dp)]
    return float(engine.train_batch(iter([(x, torch.roll(x, -1, 1)) for x in rows])).item())


def gather_logical(engine) -> dict:
    """Every trainable parameter's fp32 master and Adam moments whole, from every stage (a tied
    parameter's copies must be equal), and the optimizer step (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if not hasattr(engine, "_dt"):  # plain DeepSpeed 0.19.8 links only group 0's state fragments at its first
        opt._hp_optimizer_states_linked = False  # step (ds_dynatrain's engine links them all: not done here)
        opt._lazy_init_hp_params_optimizer_state()
    mine = {}
    for name, p in engine.module.named_parameters():
        mine[name] = {
            "fp32": safe_get_full_fp32_param(p).detach().clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone(),
        }
    mine["__step__"] = [float(opt.optimizer.state[f]["step"]) for f in opt.single_partition_of_fp32_groups]
    every = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, mine)
    out = {}
    for d in every:
        for k, v in d.items():
            if k in out and k != "__step__":
                for kind in v:
                    assert torch.equal(out[k][kind], v[kind]), f"copies of {k} differ in {kind}"
            out.setdefault(k, v)
    return out


def set_logical(engine, state: dict) -> None:
    """DeepSpeed's own setters: the fp32 master and moments, the working parameter from the master."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    opt = engine.optimizer
    for f in opt.single_partition_of_fp32_groups:
        opt.optimizer.state[f] = {
            "step": torch.tensor(state["__step__"][0]),
            "exp_avg": torch.zeros_like(f),
            "exp_avg_sq": torch.zeros_like(f),
        }
    opt._lazy_init_hp_params_optimizer_state()
    for name, p in engine.module.named_parameters():
        safe_set_full_fp32_param(p, state[name]["fp32"])
        with torch.no_grad():
            p.copy_(state[name]["fp32"].to(p.dtype))
        safe_set_full_optimizer_state(p, state[name]["exp_avg"], "exp_avg")
        safe_set_full_optimizer_state(p, state[name]["exp_avg_sq"], "exp_avg_sq")


class Numbered(torch.utils.data.Dataset):
    """Sample ``i``: ``SEQ`` tokens starting with ``i``, the labels those tokens rolled by one;
    every fetch logged as ``(the engine's step, i)``."""

    def __init__(self, n: int):
        self.n, self.engine, self.log = n, None, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(1000 + i))
        x[0] = i
        self.log.append((self.engine.global_steps, int(i)))
        return x, torch.roll(x, -1, 0)


def data_job(a) -> None:
    """The training data handed to ``initialize``: ``--steps-before`` steps of ``train_batch()``,
    the switch, ``--steps-after`` steps; each rank writes the samples it fetched per step."""
    import ds_dynatrain

    world, rank = tdist.get_world_size(), tdist.get_rank()
    data = Numbered(4 * GLOBAL_BATCH)
    module = module_at(a.pp_from, a.method)
    cfg = config(a, a.pp_from, False)
    engine, _, loader, _ = ds_dynatrain.initialize(
        model=module, **optimizer_args(a, module), training_data=data, config=cfg
    )
    data.engine = engine
    losses = [float(engine.train_batch().item()) for _ in range(a.steps_before)]
    engine.resize(world, pipeline_parallel=a.pp_to)
    losses += [float(engine.train_batch().item()) for _ in range(a.steps_after)]
    out = {"log": data.log, "losses": losses, "loader": type(loader).__name__, "steps": engine.global_steps}
    with open(os.path.join(a.out, f"data_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    tdist.destroy_process_group()
    exit_without_teardown(0)


def load_job(a, out: dict):
    """``ds_dynatrain.initialize`` at PP ``--pp-to``, then (``--refuse``) a refused load of an
    incomplete copy, then the load of ``route/t``; the loaded state to ``after.pt``."""
    import shutil

    import ds_dynatrain
    from ds_dynatrain.errors import CheckpointIncompleteError

    rank = tdist.get_rank()
    ds_dynatrain.log_to_console()  # the plugin's [dynatrain] load line in the rank's log
    module = module_at(a.pp_to, a.method_to, a.buffer)
    cfg = config(a, a.pp_to, False)
    if a.refuse:  # an entry at a step the load goes past: a warning names it
        cfg["dynatrain"]["resize_schedule"] = [
            {"step": 1, "world_size": tdist.get_world_size(), "pipeline_parallel": 2}
        ]
    engine, *_ = ds_dynatrain.initialize(model=module, **optimizer_args(a, module), config=cfg)
    with open(os.path.join(a.out, "route", "latest")) as f:
        tag = f.read().strip()
    if a.refuse:
        broken, stale = os.path.join(a.out, "broken"), os.path.join(a.out, "stale")
        if rank == 0:
            shutil.copytree(os.path.join(a.out, "route"), broken)
            os.remove(os.path.join(broken, tag, "zero_pp_rank_0_mp_rank_01_optim_states.pt"))
            os.remove(os.path.join(broken, tag, "layer_01-model_states.pt"))
            # stage 1's model-state file as an earlier save of the job wrote it (its global_steps)
            shutil.copytree(os.path.join(a.out, "route"), stale)
            name = os.path.join(stale, tag, "mp_rank_01_model_states.pt")
            tree = torch.load(name, weights_only=False)
            tree["global_steps"] -= 1
            torch.save(tree, name)
        tdist.barrier()

        def mine():
            master = engine.optimizer.single_partition_of_fp32_groups
            return [t.detach().clone() for t in [*master, *engine.module.parameters()]]

        held = mine()
        refusals = (("refusal", broken, False), ("refusal_module_only", broken, True), ("refusal_stale", stale, False))
        for key, where, only in refusals:  # the module alone too
            try:
                engine.load_checkpoint(where, tag=tag, load_module_only=only)
                out[key] = None
            except CheckpointIncompleteError as err:
                out[key] = str(err)
        torch.save({"before": held, "after": mine()}, os.path.join(a.out, f"refused{rank}.pt"))
    path, _client = engine.load_checkpoint(os.path.join(a.out, "route"))  # the tag `latest` names
    out["path"], out["steps_loaded"] = path, engine.global_steps
    after = gather_logical(engine)
    if rank == 0:
        torch.save(after, os.path.join(a.out, "after.pt"))
    return engine


def schedule_job(a, out: dict):
    """``ds_dynatrain.initialize`` at PP ``--pp-from`` with a schedule switching to ``--pp-to``
    after step ``--steps-before``, the steps before it (the switch inside the last one's
    ``train_batch``); the schedules ``initialize`` must refuse first (``out["refused"]``)."""
    import ds_dynatrain
    from ds_dynatrain.config import ConfigError

    world = tdist.get_world_size()
    module = module_at(a.pp_from, a.method, a.buffer)
    out["refused"] = []
    for bad in (
        {"world_size": world + 1, "pipeline_parallel": 1},
        {"world_size": world},
        {"world_size": world, "pipeline_parallel": world + 1},
    ):
        cfg = config(a, a.pp_from, False)
        cfg["dynatrain"]["resize_schedule"] = [{"step": a.steps_before, **bad}]
        try:
            ds_dynatrain.initialize(model=module, **optimizer_args(a, module), config=cfg)
            out["refused"].append(None)
        except ConfigError as err:
            out["refused"].append(str(err))
    cfg = config(a, a.pp_from, False)
    cfg["dynatrain"]["resize_schedule"] = [{"step": a.steps_before, "world_size": world, "pipeline_parallel": a.pp_to}]
    steps = a.steps_before + a.steps_after  # a snapshot of every step, kept
    cfg["dynatrain"]["snapshot"] = {"interval_steps": 1, "dir": os.path.join(a.out, "snaps"), "keep_last": steps}
    engine, *_ = ds_dynatrain.initialize(model=module, **optimizer_args(a, module), config=cfg)
    del module
    out["before"] = [train_step(engine, s) for s in range(a.steps_before)]
    out["record"] = engine.resize_records[-1] if engine.resize_records else None
    out["stage"] = engine.grid.get_stage_id()
    return engine


def refusals(engine, world: int) -> list:
    """What ``engine.resize`` says of layouts it cannot take (each must change nothing), and
    ``engine.prepare_resize`` of one of them."""
    from ds_dynatrain.errors import ResizeRefusedError

    said = []
    for size, pp, tp in ((world, world + 1, None), (world + 1, 1, None), (world, 0, None), (world, 1, 2)):
        try:
            engine.resize(size, pipeline_parallel=pp, tensor_parallel=tp)
            said.append(None)
        except ResizeRefusedError as err:
            said.append(str(err))
    try:  # a preparation of a layout the switch would refuse: refused the same way
        said.append(engine.prepare_resize(world, pipeline_parallel=world + 1))
    except ResizeRefusedError as err:
        said.append(str(err))
    return said


# modes that end through the interpreter's exit (this project's engines; the plain DeepSpeed ones
# end with exit_without_teardown), their OS threads written to ``threads_<mode>_rank<r>``
OWN_EXIT = ("switch", "schedule")


def main() -> None:
    p = argparse.ArgumentParser()
    modes = ["switch", "schedule", "static", "route-save", "route-load", "load", "data", "refuse-start"]
    p.add_argument("--mode", choices=modes, required=True)
    p.add_argument("--refuse", action="store_true", help="load: first a copy missing a stage's file")
    p.add_argument("--snapshots", action="store_true", help="route-save: ds_dynatrain's snapshots of every step")
    p.add_argument("--groups", action="store_true", help="two optimizer parameter groups (optimizer_args)")
    p.add_argument("--pp-from", type=int, default=2)
    p.add_argument("--pp-to", type=int, default=1)
    p.add_argument("--method", default="parameters")
    p.add_argument("--method-to", default=None, help="the partition method at --pp-to (default: --method)")
    p.add_argument("--buffer", action="store_true", help="a layer with a non-persistent buffer in the list")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps-before", type=int, default=2)
    p.add_argument("--steps-after", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    a.method_to = a.method_to or a.method
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no op build in the tests
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    if a.mode in OWN_EXIT:  # registered before the engine: runs after the library's exit hooks
        atexit.register(record_threads_at_exit, os.path.join(a.out, f"threads_{a.mode}_rank{rank}"))
    out = {}
    if a.mode == "data":
        data_job(a)
    if a.mode == "switch":
        import ds_dynatrain

        module = module_at(a.pp_from, a.method, a.buffer)
        engine, *_ = ds_dynatrain.initialize(
            model=module, **optimizer_args(a, module), config=config(a, a.pp_from, False)
        )
        del module
        out["before"] = [train_step(engine, s) for s in range(a.steps_before)]
        before = gather_logical(engine)
        out["refused"] = refusals(engine, world)
        out["prepared"] = engine.prepare_resize(world, pipeline_parallel=a.pp_to)  # touched in the background
        hold, deadline = engine._dt.switch_hold, time.monotonic() + 60
        while hold is not None and hold.touched < out["prepared"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the whole hold touched before the switch: the record's figure is all of it
        out["record"] = engine.resize(world, pipeline_parallel=a.pp_to)
        after = gather_logical(engine)
        out["parts"] = [int(x) for x in engine.module.parts]
        out["stage"] = engine.grid.get_stage_id()
        if rank == 0:
            torch.save(before, os.path.join(a.out, "before.pt"))
            torch.save(after, os.path.join(a.out, "after.pt"))
    elif a.mode == "route-save" and a.snapshots:  # ds_dynatrain's snapshots of every step instead
        import ds_dynatrain

        module = module_at(a.pp_from, a.method, a.buffer)
        cfg = config(a, a.pp_from, False)
        cfg["dynatrain"]["snapshot"] = {"interval_steps": 1, "dir": os.path.join(a.out, "route"), "keep_last": 1}
        engine, *_ = ds_dynatrain.initialize(model=module, **optimizer_args(a, module), config=cfg)
        out["before"] = [train_step(engine, s) for s in range(a.steps_before)]
        engine.checkpoint_engine.wait()  # the last step's snapshot committed (SnapshotWriteError if not)
        before = gather_logical(engine)
        if rank == 0:
            torch.save(before, os.path.join(a.out, "before.pt"))
        with open(os.path.join(a.out, f"{a.mode}_rank{rank}.json"), "w") as f:
            json.dump(out, f)
        tdist.destroy_process_group()
        exit_without_teardown(0)
    elif a.mode == "route-save":  # DeepSpeed's own route, first half: train at the old PP and save
        module = module_at(a.pp_from, a.method, a.buffer)
        cfg = config(a, a.pp_from, True)
        engine, *_ = deepspeed.initialize(model=module, **optimizer_args(a, module), config=cfg)
        out["before"] = [train_step(engine, s) for s in range(a.steps_before)]
        before = gather_logical(engine)
        if rank == 0:
            torch.save(before, os.path.join(a.out, "before.pt"))
        engine.save_checkpoint(os.path.join(a.out, "route"), tag="t")
        with open(os.path.join(a.out, f"{a.mode}_rank{rank}.json"), "w") as f:
            json.dump(out, f)
        tdist.destroy_process_group()
        exit_without_teardown(0)
    elif a.mode == "route-load":  # ... and after ds_to_universal: relaunch at the new PP, load_universal
        module = module_at(a.pp_to, a.method_to, a.buffer)
        cfg = dict(config(a, a.pp_to, True), checkpoint={"load_universal": True})
        engine, *_ = deepspeed.initialize(model=module, **optimizer_args(a, module), config=cfg)
        engine.load_checkpoint(os.path.join(a.out, "route_universal"), tag="t")
    elif a.mode == "load":
        engine = load_job(a, out)
    elif a.mode == "schedule":
        engine = schedule_job(a, out)
    elif a.mode == "refuse-start":  # a persistent buffer on the last stage only: every rank refuses
        import ds_dynatrain
        from ds_dynatrain.errors import LayoutMismatchError

        module = module_at(a.pp_from, a.method, buffer=True, persistent=True)
        try:
            ds_dynatrain.initialize(model=module, **optimizer_args(a, module), config=config(a, a.pp_from, False))
            out["refusal"] = None
        except LayoutMismatchError as err:
            out["refusal"] = str(err)
        with open(os.path.join(a.out, f"{a.mode}_rank{rank}.json"), "w") as f:
            json.dump(out, f)
        tdist.destroy_process_group()
        exit_without_teardown(0)
    else:
        module = module_at(a.pp_to, a.method_to, a.buffer)
        engine, *_ = deepspeed.initialize(model=module, **optimizer_args(a, module), config=config(a, a.pp_to, True))
        set_logical(engine, torch.load(os.path.join(a.out, "before.pt")))
    out["after"] = [train_step(engine, s) for s in range(a.steps_before, a.steps_before + a.steps_after)]
    if a.mode == "schedule":
        engine.checkpoint_engine.wait()  # the last snapshot committed before the process ends
    final = gather_logical(engine)
    if rank == 0:
        torch.save(final, os.path.join(a.out, f"final_{a.mode}.pt"))
    with open(os.path.join(a.out, f"{a.mode}_rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if a.mode in OWN_EXIT:
        return  # the interpreter's own exit, through the library's exit hooks
    tdist.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
