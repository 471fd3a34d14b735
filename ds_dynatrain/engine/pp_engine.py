"""The elastic pipeline engine: a real DeepSpeed ``PipelineEngine`` whose PP and DP degrees change
in memory at an unchanged world size, and its first build by ``ds_dynatrain.initialize``.

What a pipeline job gets today: ``engine.train_batch()`` as with DeepSpeed (over the training
data handed to ``initialize``, in the global sample order across changes, or a ``data_iter``),
``engine.resize(world_size, pipeline_parallel=P)`` (:mod:`.pp_switch`) and the resize schedule,
snapshots, and under ``dynatrain launch`` (:mod:`.pp_launch`) requests, a shrink on a preemption
or a request (:mod:`.pp_resize`), a grow by new processes (:mod:`.pp_grow`, a joiner built here),
a stop, and a restart from its snapshots after a worker died.
"""

from __future__ import annotations

import atexit
import time
from typing import List, Optional

import torch
import torch.distributed as tdist
from deepspeed.runtime.pipe.engine import PipelineEngine

from ..checkpoint.snapshot import SnapshotCheckpointEngine
from ..config import ConfigError, DynatrainConfig, check_elastic_config
from ..elastic.collective import raise_on_every_rank
from ..elastic.launch_env import LaunchContext, member_id
from ..elastic.threads import one_thread_unless_fixed
from ..errors import LayoutMismatchError, ResizeRefusedError
from ..log import logger
from ..planner.assignment import import_solver_in_background
from ..zero.pipe_module import check_rebuildable
from ..zero.pipeline import layer_type_names
from ..zero.state import relink_optimizer_state
from . import loading
from .boundary import record_step, spawn_ahead
from .construct import ds_config_for, latest_by_commit
from .join import joined_generation
from .lifecycle import at_thread_shutdown, close_at_exit, shutdown, take_preemption_notices
from .pp_build import check_pipeline_layout, construct_pipeline, gather_optimizer_groups, job_layout
from .pp_grow import grow_pipeline_parallel, join_pipeline_parallel
from .pp_launch import at_step_boundary, launched_membership, publish_launched
from .pp_resize import pp_for_world, shrink_pipeline_parallel
from .pp_switch import check_stage_groups, layout_for, prepare_pipeline_switch, switch_pipeline_parallel
from .records import MetricsWriter
from .restore import restore
from .state import ElasticState, require_integers
from .switch_memory import prepare_scheduled, release_switch_memory, released_on_refusal
from .warmup import publish_inputs, publish_modules, warm_joiner


class ElasticPipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` whose pipeline degree can change while it trains.

    Built by :func:`ds_dynatrain.initialize` from a ``deepspeed.pipe.PipelineModule``, never
    directly. Everything of ``PipelineEngine`` works as usual (``train_batch``, ``eval_batch``);
    in addition :meth:`resize` changes the PP and DP degrees at an unchanged world size.
    """

    _dt: ElasticState

    @property
    def is_member(self) -> bool:
        """False once this process has left the job (a shrink under ``dynatrain launch`` that it
        is not part of: its engine is torn down; the script ends its loop)."""
        return not self._dt.retired

    @property
    def resize_records(self) -> List[dict]:
        """One record per change of layout this process took part in."""
        return [r.to_dict() for r in self._dt.resizes]

    def resize(
        self, world_size: int, pipeline_parallel: Optional[int] = None, tensor_parallel: Optional[int] = None
    ) -> Optional[dict]:
        """Change the pipeline degree to ``pipeline_parallel`` now, in memory (DP becomes
        ``world_size / pipeline_parallel``); the processes stay. Under ``dynatrain launch`` a
        smaller ``world_size`` shrinks the job (:func:`~ds_dynatrain.engine.pp_resize.
        shrink_pipeline_parallel`; the processes left out leave: ``is_member`` False, the
        record None in them) and a larger one grows it (:func:`~ds_dynatrain.engine.pp_grow.
        grow_pipeline_parallel`: the launcher starts the new processes and this call waits for
        their start-up); ``pipeline_parallel`` None: the degree
        :func:`~ds_dynatrain.engine.pp_resize.pp_for_world` picks.

        Collective: every process calls it at the same step boundary (between ``train_batch``
        calls).

        Returns:
            The resize record (``pipeline_parallel_from``/``_to``, ``bytes_moved``,
            ``seconds``, ...); None when the degree does not change.

        Raises:
            ResizeRefusedError: a grow or shrink outside ``dynatrain launch``, a degree that does
                not divide the world size, more stages than layers, a split that leaves a stage
                without a trainable parameter, or a DP size that cannot keep the global batch; a
                ``tensor_parallel`` degree (a pipeline job has no TP axis); nothing has changed.
            TransitionAbortedError: a peer failed during the transfer, or the last change failed.
            NotAMemberError: this process left the job.
        """
        self._dt.require_member()
        with released_on_refusal(self._dt):  # a hold for a switch that will not come goes
            require_integers(world_size, pipeline_parallel=pipeline_parallel, tensor_parallel=tensor_parallel)
            return self._change_layout(world_size, pipeline_parallel, tensor_parallel)

    def _change_layout(self, world_size: int, pipeline_parallel: Optional[int], tensor_parallel: Optional[int]):
        """:meth:`resize`'s work (its arguments, return value and errors)."""
        if tensor_parallel is not None:
            raise ResizeRefusedError(
                f"TP degree {tensor_parallel} refused: a PipelineModule job has no tensor-parallel axis "
                "(its PP and DP degrees change; a PipelineModule with a model axis is not supported)"
            )
        world = tdist.get_world_size()
        if world_size != world and self._dt.membership is not None and world_size >= 1:  # dynatrain launch
            pp = pipeline_parallel or pp_for_world(self, world_size) or self._dt.pp_layout.pp
            if world_size > world:
                return grow_pipeline_parallel(self, world_size, pp).to_dict()
            rec = shrink_pipeline_parallel(self, world_size, pp)
            return rec.to_dict() if rec is not None else None
        if world_size != world:
            raise ResizeRefusedError(
                f"world size {world_size} refused: a pipeline job changes its PP degree over its {world} "
                "processes; it grows and shrinks under `dynatrain launch`"
            )
        pp = self._dt.pp_layout.pp if pipeline_parallel is None else pipeline_parallel
        if pp == self._dt.pp_layout.pp:
            return None
        return switch_pipeline_parallel(self, pp).to_dict()

    def prepare_resize(self, world_size: int, pipeline_parallel: Optional[int] = None) -> int:
        """Prepare a later ``resize(world_size, pipeline_parallel=...)`` that changes the PP degree
        at the job's world size: a background thread touches the memory the new layout will need
        on this process (new partitions, larger working parameters and gradient buffers) while
        training goes on, held until the switch frees it for the new engine
        (:mod:`~ds_dynatrain.engine.switch_memory`). A scheduled switch is prepared by itself
        (``dynatrain.warm_switch_steps`` steps early). Not collective. Nothing is held for another
        world size, an unchanged degree (which also lets go of a hold made before), working
        parameters on an accelerator, or ``warm_switch_steps`` 0; a hold lasts until the next
        change of layout, a ``resize`` that refuses, or the engine's close.

        Returns:
            The bytes the thread will touch (at most half the host's available memory over its
            processes; fewer are touched where the switch comes first).

        Raises:
            ResizeRefusedError: the layout ``resize`` would refuse; nothing has changed.
            NotAMemberError: this process left the job.
        """
        dt = self._dt
        dt.require_member()
        require_integers(world_size, pipeline_parallel=pipeline_parallel)
        if world_size != len(dt.members) or pipeline_parallel in (None, dt.pp_layout.pp):
            release_switch_memory(dt)  # a hold made before: not wanted any more
            return 0
        return prepare_pipeline_switch(self, pipeline_parallel)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        **kwargs,
    ):
        """Load a pipeline checkpoint (DeepSpeed's own: ``layer_XX-model_states.pt``, one
        ``mp_rank_XX`` model-state file per stage, ZeRO-1 ``zero_pp_rank_*`` files) saved at this or
        any other PP and DP degree, with any partition method.

        The saved stage split is read from each stage's ``param_shapes``; every file of the saving
        world is checked against the model before anything is read; each rank then reads only the
        boxes of its new partitions (:mod:`~ds_dynatrain.checkpoint.resharded_bands`) and the
        working parameters are made from the loaded fp32 master. ``load_module_only=True`` is
        DeepSpeed's own load (each layer's file, by layer index). Collective.

        Returns:
            ``(load path, client state)`` as DeepSpeed's; ``(None, None)`` when nothing is found.

        Raises:
            CheckpointIncompleteError: missing or damaged files of the saving world.
            LayoutMismatchError: the checkpoint holds another model or was saved with AutoTP
                (names the stage and parameter).
            Either on every rank, before anything is installed.
        """
        return loading.load_checkpoint(
            self,
            super().load_checkpoint,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_strict=load_module_strict,
            **kwargs,
        )

    def train_batch(self, data_iter=None):
        """DeepSpeed's ``train_batch`` and its step record (rank 0: the ``metrics_path`` line and
        the step log line, as a data-parallel job's); then, under ``dynatrain launch``, the step boundary of
        :func:`~ds_dynatrain.engine.pp_launch.at_step_boundary` (a stop of the job ends the process
        here with ``SystemExit(0)``); every ``snapshot.interval_steps``, a snapshot of this step;
        and at a step the resize schedule names, the switch to its PP degree (every process reaches
        the same step; a snapshot of that step is of the layout before the switch). A step whose
        boundary grew the job takes neither: its joiners enter at the next step."""
        t0 = time.perf_counter()
        loss = super().train_batch(data_iter)
        dt, step = self._dt, self.global_steps
        record_step(self, loss, time.perf_counter() - t0)  # every stage has the last stage's loss
        if not dt.modules_published and dt.membership is not None and self.global_rank == 0:
            dt.modules_published = True  # what a joiner imports before it joins (names only)
            publish_modules(dt.membership.store)
        if not dt.hp_linked:  # DeepSpeed 0.19.8 links group 0's fragments only (boundary.after_optimizer_step)
            relink_optimizer_state(self)
            dt.hp_linked = True
        world = len(dt.members)
        if dt.membership is not None:  # dynatrain launch: a stop (SystemExit), preemptions, requests
            at_step_boundary(self)
            if dt.retired:
                return loss
        if len(dt.members) > world:  # the joiners enter at the next step: no snapshot or switch of this one
            return loss
        snap = dt.config.snapshot
        if snap.interval_steps and step % snap.interval_steps == 0:
            self.save_checkpoint(snap.dir, tag=f"global_step{step}")
        target, pp = dt.schedule.get(step), dt.pp_schedule.get(step)
        if target is not None and (target != len(dt.members) or pp != dt.pp_layout.pp):
            try:  # checked at launch, but a request or a preemption may have changed the world since
                self.resize(target, pipeline_parallel=pp)
            except ResizeRefusedError as err:
                if self.global_rank == 0:
                    logger.warning(f"the change scheduled after step {step} was refused: {err}")
        if dt.membership is not None and not dt.retired:
            spawn_ahead(self)  # the joiners of a scheduled grow start a few steps early
        if self.is_member:
            prepare_scheduled(self)  # a scheduled switch's memory, touched in the background
        return loss

    def _next_batch(self):
        """DeepSpeed's next micro-batch; rank 0 describes its first one's inputs (shapes and dtypes)
        in the job's store under ``dynatrain launch``: what a joiner warms up on
        (:func:`~ds_dynatrain.engine.warmup.warm_joiner`)."""
        batch = super()._next_batch()
        dt = self._dt
        if not dt.inputs_published and dt.membership is not None and self.global_rank == 0 and batch is not None:
            dt.inputs_published = True
            publish_inputs(dt.membership.store, (batch[0] if isinstance(batch, (tuple, list)) else batch,), {})
        return batch

    def _exec_optimizer_step(self, lr_kwargs=None):
        """DeepSpeed's optimizer step, after the capture of a snapshot being taken (the step is the
        first thing that changes the state it captures)."""
        if isinstance(self.checkpoint_engine, SnapshotCheckpointEngine):
            self._dt.snapshot_stall_s += self.checkpoint_engine.wait_captured()
        return super()._exec_optimizer_step(lr_kwargs)

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's ``save_checkpoint`` (its pipeline files: one per layer, one model-state file
        per stage, the ZeRO-1 files) through the snapshot engine, asynchronous: the call returns
        once the files are queued; ``latest`` is replaced atomically by the engine's commit."""
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        return super().save_checkpoint(
            save_dir,
            tag=tag,
            client_state=client_state,
            save_latest=latest_by_commit(self, save_latest),
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    def _broadcast_model(self):
        """DeepSpeed's set-up broadcast of the working parameters, skipped in a rebuild whose
        working parameters are made from the installed master right after."""
        dt = self.__dict__.get("_dt")
        if dt is not None and dt.rebuild_broadcast == "none":
            return None
        return super()._broadcast_model()


def refuse_pipeline_config(ds_config: dict, dt_cfg: DynatrainConfig) -> None:
    """Refuse what a pipeline job cannot have yet, before anything is built.

    Raises:
        ConfigError: a ZeRO stage other than 1 (DeepSpeed's pipeline engine refuses 2 and 3; the
            layout change moves ZeRO partitions), or peer replicas.
    """
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    if stage != 1:
        raise ConfigError(
            f"a PipelineModule job with ZeRO stage {stage}: ds_dynatrain changes the layout of pipeline jobs "
            "at ZeRO-1 (DeepSpeed's pipeline engine refuses stages 2 and 3)"
        )
    if dt_cfg.recovery.peer_replicas:
        raise ConfigError(
            "dynatrain.recovery.peer_replicas: a PipelineModule job has no in-place recovery from peer replicas "
            "yet; under `dynatrain launch` a dead worker restarts it from its snapshots (snapshot.restore_on_failure)"
        )


def start_pipeline_engine(module, optimizer, model_parameters, lr_scheduler, ds_config: dict, dt_cfg: DynatrainConfig):
    """An :class:`ElasticPipelineEngine` over ``module`` (a ``PipelineModule``, whose
    construction started ``torch.distributed``), with the job's layout checked against DeepSpeed's
    build; in a process ``dynatrain launch`` started to join the running job (a grow), the engine
    of the generation it joins (:func:`~ds_dynatrain.engine.pp_grow.join_pipeline_parallel`:
    ``module``, built at one stage in the joiner's world of one, gives the layer list).

    Raises:
        ConfigError: as :func:`refuse_pipeline_config`; batch keys the DP size cannot serve;
            parameter groups (one group of every parameter is what a layout change rebuilds); a
            ``pipeline_partition_method`` that does not give the module's stage bounds.
        LayoutMismatchError: the module holds what a change would lose (persistent buffers,
            frozen parameters), or DeepSpeed's partitions are not the layout's.
    """
    refuse_pipeline_config(ds_config, dt_cfg)
    problem = None
    try:
        check_rebuildable(module)  # this rank's stage: every rank agrees before any collective of the build
    except LayoutMismatchError as err:
        problem = err
    raise_on_every_rank(problem, LayoutMismatchError, "a PipelineModule job refused at its start")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError("a PipelineModule job takes a torch optimizer object or the config's optimizer section")
    optimizer_groups = gather_optimizer_groups(module, optimizer, model_parameters)
    world, rank = tdist.get_world_size(), tdist.get_rank()
    pp = module.num_stages
    ctx = LaunchContext.from_environ()
    joiner = ctx is not None and ctx.joiner
    membership = launched_membership(ctx, dt_cfg)
    if joiner:  # the job's batch, not the one its world of one would take
        job = membership.job()
        global_batch, micro = int(job["global_batch"]), int(job["micro_batch"])
    else:
        global_batch, micro = check_elastic_config(ds_config, dt_cfg, world // pp, elastic=False)
    generation = ctx.generation if ctx is not None else 0
    dt = ElasticState(
        config=dt_cfg,
        ds_config=ds_config,
        global_batch=global_batch,
        micro_batch=micro,
        membership=membership,
        member=ctx.member if ctx is not None else member_id(0, rank),
        members=() if joiner else tuple(member_id(generation, r) for r in range(world)),
        generation=generation,
        backend=tdist.get_backend(),
        metrics=MetricsWriter(dt_cfg.metrics_path),
    )
    engine = ElasticPipelineEngine.__new__(ElasticPipelineEngine)
    if joiner:
        engine._dt = dt
        # warm while the survivors train (until the generation forms): rank 0's modules imported,
        # forward and backward of the whole layer list on a synthetic micro-batch, no collective
        one_thread_unless_fixed()  # beside the host's running workers until its share is set at the build
        dt.warmup_s = warm_joiner(membership.store, module, ctx.generation, dt.group_timeout_s, hold=dt.held)
        rec = joined_generation(dt, ctx)
        join_pipeline_parallel(engine, rec, module, optimizer, model_parameters, lr_scheduler, optimizer_groups)
    else:
        _build_first(engine, dt, module, optimizer, model_parameters, lr_scheduler, optimizer_groups)
    dt.returned_optimizer = engine.optimizer
    atexit.register(shutdown)
    if dt.membership is not None:
        if not joiner:
            publish_launched(engine)
            dt.requests_seen = dt.membership.served()  # a restarted job does not serve the answered ones again
        take_preemption_notices(dt)  # SIGTERM to a worker: it leaves at the next step, the others shrink
        if ctx.restore_dir and not joiner:
            restore(engine, ctx.restore_dir)
    at_thread_shutdown(close_at_exit, engine)  # the last snapshot finishes and publishes
    if dt.membership is not None:  # a later shrink or grow plans at once: the solver's import off its path
        import_solver_in_background()
    return engine


def _build_first(engine, dt: ElasticState, module, optimizer, model_parameters, lr_scheduler, optimizer_groups):
    """Build the engine of the job's first generation (or of a restart) on the script's
    ``module``, its layout checked against DeepSpeed's build.

    Raises:
        ConfigError: a ``pipeline_partition_method`` that does not give the module's stage bounds,
            optimizer groups a stage lacks, or a schedule entry the job cannot take.
        LayoutMismatchError: DeepSpeed's partitions are not the layout's.
    """
    ds_config, dt_cfg = dt.ds_config, dt.config
    world, pp = tdist.get_world_size(), module.num_stages
    dt.pp_layout = job_layout(module, ds_config, dt_cfg, pp, world, optimizer_groups)
    if tuple(int(x) for x in module.parts) != dt.pp_layout.parts:
        raise ConfigError(
            f"dynatrain.pipeline_partition_method {dt_cfg.pipeline_partition_method!r} splits the layers at "
            f"{list(dt.pp_layout.parts)}, the PipelineModule was split at {[int(x) for x in module.parts]}: "
            "set it to the partition_method the module was built with"
        )
    try:
        check_stage_groups(dt.pp_layout)
    except LayoutMismatchError as err:
        raise ConfigError(f"a PipelineModule job's optimizer groups: {err}") from None
    check_pipeline_schedule(dt, layer_type_names(module))
    split = dt.split(world // pp, "DP size")
    construct_pipeline(engine, dt, module, optimizer, model_parameters, lr_scheduler, ds_config_for(dt, split, False))
    check_pipeline_layout(engine)


def check_pipeline_schedule(dt: ElasticState, type_names) -> None:
    """Every entry of the resize schedule is a layout the job can take, in order (``type_names``:
    each layer's class name, for ``type:`` partition methods): a PP degree at the world size the
    entry names, which under ``dynatrain launch`` may differ from the job's before it (a shrink or
    a grow), and outside it may not.

    Raises:
        ConfigError: naming the entry: another world size outside ``dynatrain launch``, no PP
            degree, a PP degree the layers or the world cannot take, or a DP size that cannot keep
            the global batch.
    """
    world = dt.pp_layout.world_size
    for e in dt.config.resize_schedule:
        entry = f"invalid DeepSpeed config: dynatrain.resize_schedule (step {e.step})"
        if e.world_size != world and dt.membership is None:
            raise ConfigError(
                f"{entry}: world size {e.world_size}: a PipelineModule job changes its PP degree over its "
                f"{world} processes; it grows and shrinks under `dynatrain launch`"
            )
        if e.pipeline_parallel is None:
            raise ConfigError(f"{entry} gives no pipeline_parallel: a PipelineModule job's entries name its PP degree")
        try:
            layout_for(dt.pp_layout, type_names, e.pipeline_parallel, e.world_size, dt.config.pipeline_partition_method)
            dt.split(e.world_size // e.pipeline_parallel, "DP size")
        except ResizeRefusedError as err:
            raise ConfigError(f"{entry}: {err}") from None
        world = e.world_size
