"""Online resizes under Hugging Face Trainer: the training loop is entered anew at the step the
world changed, in memory.

Trainer's loop (transformers 5 ``Trainer._inner_training_loop`` / ``_run_epoch``) keeps the world
it started with in locals and in Accelerate's caches: the data loader's shard (``BatchSamplerShard``
holds the process count and index), the accumulation steps of each update step, the steps per
epoch. None of them can be changed from a callback. What Trainer does know is how to start at any
step on any world: its resume from a checkpoint (skip the batches already trained, recompute the
epoch arithmetic for this world). So a resize under Trainer ends the running loop and resumes it,
from memory rather than from disk:

1. right after a resize (inside ``engine.step()``, before Trainer issues another collective), the
   elastic engine raises :class:`FrontendRestart`; a joiner raises it as soon as it has joined;
2. the wrapped ``Trainer.train`` catches it, sets Accelerate's cached process count and index, the
   accumulation steps (Trainer's, Accelerate's and the DeepSpeed config's) to the new world, writes
   Trainer's state at the engine's step (``trainer_state.json``; a joiner gets rank 0's through the
   job's store) into a directory of its own, and calls ``train`` again with it as the checkpoint;
3. the resumed ``train`` builds its data loader for the new world, skips what was trained, and
   ``accelerator.prepare`` gets the same engine back (the route of :mod:`.route` keeps it); the
   engine's state is not loaded from anywhere (``deepspeed_load_checkpoint`` is skipped there).

A process that left at the resize ends there (``SystemExit(0)`` from ``train``): what the script does
after ``train`` (its metrics, ``save_model``, a final ``evaluate``) is for the processes that stay.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional, Tuple

from ..elastic.keys import TRAINER_STATE_KEY
from ..engine.frontend import Catching, FrontendRestart
from ..log import logger
from .accelerate_state import set_accumulation, set_world

IN_MEMORY = ".dynatrain-in-memory"  # marks a resume directory whose engine state is already live
_engines = {}  # id(module) -> the elastic engine built for it (what a resumed prepare gets back)


def remember(engine) -> None:
    _engines[id(engine.module)] = engine


def engine_for(model) -> Optional[object]:
    """The live elastic engine already built for ``model``, or None."""
    engine = _engines.get(id(model))
    if engine is None or engine.module is not model or not engine.is_member:
        return None
    return engine


def _realign(trainer, engine) -> None:
    """Accelerate's and Trainer's cached world and accumulation steps set to ``engine``'s."""
    set_world(engine.dp_world_size, engine.global_rank)
    trainer.model_wrapped = trainer.model  # so that the loop prepares it again: the route gives the engine back
    trainer.args.gradient_accumulation_steps = set_accumulation(trainer.accelerator, engine)
    # the batch rule may take a smaller micro-batch at the new world (24 over 4 ranks of at most 4:
    # 3 x 2): the resumed loop's data loader must cut batches of that size
    micro = engine.train_micro_batch_size_per_gpu()
    trainer.args.per_device_train_batch_size = micro
    trainer._train_batch_size = micro * max(1, trainer.args.n_gpu)


def _state_dir(trainer, engine) -> Tuple[str, Optional[float]]:
    """A directory holding Trainer's state at ``engine``'s step, and the loss Trainer's next log
    reports (:func:`_window_loss`): rank 0's, shared through the store (a joiner has neither)."""
    dt = engine._dt
    key = TRAINER_STATE_KEY.format(dt.generation)
    store = dt.membership.store
    where = tempfile.mkdtemp(prefix=f"dynatrain-resume-g{dt.generation}-")
    path = os.path.join(where, "trainer_state.json")
    if engine.global_rank == 0:
        trainer.state.global_step = engine.global_steps
        trainer.state.save_to_json(path)  # Trainer's own serialisation
        with open(path) as f:
            loss = _window_loss(engine, _last_logged(trainer.state))
            store.set(key, json.dumps({"trainer_state": f.read(), "window_loss": loss}))
    got = json.loads(store.get(key).decode())
    with open(path, "w") as f:
        f.write(got["trainer_state"])
    with open(os.path.join(where, IN_MEMORY), "w") as f:
        json.dump({"step": engine.global_steps, "generation": dt.generation}, f)
    return where, got["window_loss"]


def _last_logged(state) -> int:
    return max((e.get("step", 0) for e in state.log_history if "loss" in e), default=0)


def _window_loss(engine, since: int) -> Optional[float]:
    """The mean of the job's step losses after step ``since`` up to the engine's step (what
    Trainer's next log reports), from the engine's record of recent steps; None when it has none."""
    got = [loss for step, loss in engine._dt.step_losses if since < step <= engine.global_steps]
    return sum(got) / len(got) if got else None


def _step_end(trainer, engine, state_path: str, loss: Optional[float]) -> None:
    """What Trainer's loop does at the end of a step, for the step the world changed in (the loop
    ended inside it): the callbacks' ``on_step_end``, then the log, evaluation (and the best
    metric) and save they ask for (``DefaultFlowCallback``: ``logging_steps``, ``eval_steps``,
    ``save_steps``), on every member of the new world at the same point, with rank 0's state. The
    logged ``loss`` is rank 0's :func:`_window_loss`, logged also off the logging steps (the
    resumed loop's window starts at this step). A stop a callback asks for ends training here.
    Not replayed: ``on_epoch_end`` when this step ends an epoch."""
    from transformers.trainer_callback import TrainerState

    trainer.state = TrainerState.load_from_json(state_path)
    trainer.current_flos = float(getattr(trainer, "current_flos", 0))  # one dtype on every rank: it is gathered
    state = trainer.state
    control = trainer.callback_handler.on_step_end(trainer.args, state, trainer.control)
    trainer.model_wrapped = trainer.deepspeed = engine
    try:
        # logged also when this is no logging step: the resumed loop counts its loss window from here
        if loss is not None and (control.should_log or state.global_step > _last_logged(state)):
            trainer.store_flos()
            lr = engine.get_lr()  # the engine's scheduler: a joiner's Trainer has not taken it yet
            trainer.log({"loss": loss, "learning_rate": float(lr[0]) if lr else float("nan")})
        if control.should_evaluate:
            metrics = trainer._evaluate(None, None)
            best = trainer._determine_best_metric(metrics=metrics, trial=None)
            if str(trainer.args.save_strategy).split(".")[-1].lower() == "best":
                control.should_save = best
        if control.should_save:
            trainer._save_checkpoint(engine, trial=None)
            trainer.control = trainer.callback_handler.on_save(trainer.args, state, trainer.control)
    finally:
        trainer.model_wrapped = trainer.model
    if trainer.control.should_training_stop:  # a callback ended training at this step (early stopping)
        trainer.args.max_steps = state.global_step
    trainer.control.should_log = trainer.control.should_evaluate = trainer.control.should_save = False
    state.save_to_json(state_path)  # what the resumed loop loads: the log entries made here kept


def train_resuming_after_resizes(wrapped, trainer, args, kwargs):
    """``Trainer.train`` entered anew after each change of the world (module docstring)."""
    made = []
    try:
        while True:
            try:
                with Catching():
                    return wrapped(*args, **kwargs)
            except FrontendRestart as restart:
                engine = restart.engine
                if not engine.is_member:
                    # the rest of the script (its metrics, save_model, a final evaluate) is for the
                    # processes that stay: this one ends here, as a finished worker
                    logger.info(
                        f"member {engine._dt.member} left the job at a resize; this process ends (exit status 0)"
                    )
                    raise SystemExit(0) from None
                _realign(trainer, engine)
                resume, loss = _state_dir(trainer, engine)
                made.append(resume)
                _step_end(trainer, engine, os.path.join(resume, "trainer_state.json"), loss)
                logger.info(
                    f"the training loop resumes at step {engine.global_steps} on {engine.dp_world_size} processes "
                    f"({engine.gradient_accumulation_steps()} accumulation steps)"
                )
                args, kwargs = (), {**kwargs, "resume_from_checkpoint": resume}
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


def skip_live_load(original):
    """Trainer's ``deepspeed_load_checkpoint``, skipped for a resume directory of ours."""

    def deepspeed_load_checkpoint(engine, checkpoint_path, *args, **kwargs):
        if os.path.isfile(os.path.join(checkpoint_path, IN_MEMORY)):
            return None
        return original(engine, checkpoint_path, *args, **kwargs)

    return deepspeed_load_checkpoint


def _launch_context():
    from ..elastic.launch_env import LaunchContext

    return LaunchContext.from_environ()


def generation_view(wrapped, instance, args, kwargs):
    """Accelerate's ``PartialState.__init__``; in a joiner of ``dynatrain launch`` (whose own
    process group is a group of one until it joins) the process count and index it reports are
    its generation's, so that Trainer sizes batches and shards data for the world it will join."""
    out = wrapped(*args, **kwargs)
    ctx = _launch_context()
    shared = type(instance)._shared_state
    if ctx is not None and ctx.joiner and "num_processes" in shared:
        shared["num_processes"], shared["process_index"] = ctx.world_size, ctx.rank
    return out


def accumulation_for_world(wrapped, instance, args, kwargs):
    """``TrainingArguments.__post_init__``; under ``dynatrain launch`` with a DeepSpeed config that
    gives ``train_batch_size`` and ``train_micro_batch_size_per_gpu``, the accumulation steps and
    the per-device batch are those the engine's batch rule (:func:`~ds_dynatrain.batch.split_global_batch`)
    takes at this process's world size (a joiner's is its generation's, not the launch command's)."""
    from ..batch import split_global_batch
    from .configs import parsed_config

    ctx = _launch_context()
    cfg = parsed_config(getattr(instance, "deepspeed", None)) if ctx is not None else None
    if cfg is not None:
        tb, micro = cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu")
        if isinstance(tb, int) and isinstance(micro, int):
            try:
                split = split_global_batch(tb, micro, ctx.world_size)
            except ValueError:
                split = None  # the engine's build names the problem
            if split is not None and (split.gradient_accumulation_steps, split.micro_batch) != (
                instance.gradient_accumulation_steps,
                instance.per_device_train_batch_size,
            ):
                was = f"{instance.per_device_train_batch_size} x {instance.gradient_accumulation_steps}"
                now = f"{split.micro_batch} x {split.gradient_accumulation_steps}"
                logger.info(
                    f"per-device batch x accumulation steps {was} -> {now}: the global batch {tb} at "
                    f"{ctx.world_size} processes (micro-batch at most {micro})"
                )
                instance.gradient_accumulation_steps = split.gradient_accumulation_steps
                instance.per_device_train_batch_size = split.micro_batch
                # Trainer checks the config's micro-batch against its per-device batch; the job's
                # largest stays with the job (the engine of a joiner takes it from the job's store)
                instance.deepspeed = {**cfg, "train_micro_batch_size_per_gpu": split.micro_batch}
    return wrapped(*args, **kwargs)
