"""The elastic engine: a real ``DeepSpeedEngine`` that can change its data-parallel world size.

``ds_dynatrain.initialize`` returns an :class:`ElasticEngine`. Hugging Face Accelerate, Lightning
and Trainer keep the engine object they were handed, so a resize never hands back a new engine:
it renews the insides of the same object (DeepSpeed's ``__init__`` runs again on it, on the new
process group) and the optimizer object returned at start shares the state of the rebuilt ZeRO
optimizer. The LR scheduler object is passed through unchanged.

This class holds DeepSpeed's overrides and the public API only; the work is in the modules of
this package: the step boundary (:mod:`.boundary`), a resize phase by phase (:mod:`.resize`),
requests from outside (:mod:`.requests`), joining (:mod:`.join`), loading (:mod:`.loading`).
"""

from __future__ import annotations

import time
from typing import List, Optional, Tuple

from deepspeed.runtime.engine import DeepSpeedEngine

from ..checkpoint.model_config import MODEL_CONFIG_KEY, with_model_config
from ..checkpoint.snapshot import SnapshotCheckpointEngine
from ..elastic.launch_env import LAUNCHER_LIMITS, started_elsewhere
from ..errors import ResizeRefusedError
from ..log import logger
from ..transition.spread import post_to_joiners
from ..zero.geometry import zero_optimizer_of
from . import boundary, loading, pending, recover, requests, tp_grow, tp_resize, tp_switch
from .construct import latest_by_commit
from .frontend import FrontendRestart, catching
from .resize import resize as resize_now
from .state import ElasticState, require_integers
from .switch_memory import prepare_world_change, release_switch_memory, released_on_refusal
from .warmup import publish_inputs, publish_modules


class ElasticEngine(DeepSpeedEngine):
    """A ``DeepSpeedEngine`` whose data-parallel world size can change while it trains.

    Built by :func:`ds_dynatrain.initialize`, never directly. Everything of ``DeepSpeedEngine``
    works as usual; in addition:

    * :meth:`step` runs, after each optimizer step, the plugin's step record, the periodic
      snapshot and any resize scheduled for that step;
    * :meth:`resize` changes the world size now (collective: every member calls it at the same
      step boundary);
    * :attr:`is_member` turns False in a process that left the job at a resize.
    """

    _dt: ElasticState

    # ------------------------------------------------------------------ public
    @property
    def is_member(self) -> bool:
        """False once this process has left the job at a resize."""
        return not self._dt.retired

    @property
    def generation(self) -> int:
        """The membership generation this process trains in (0 at launch, +1 per resize)."""
        return self._dt.generation

    @property
    def resize_records(self) -> List[dict]:
        """One record per resize (and join) this process took part in, as written to the metrics
        file (:mod:`ds_dynatrain.engine.records`)."""
        return [r.to_dict() for r in self._dt.resizes]

    def resize(
        self, world_size: int, must_leave: Tuple[str, ...] = (), tensor_parallel: Optional[int] = None
    ) -> Optional[dict]:
        """Change the data-parallel world size now, in memory; in an AutoTP job, the TP degree.

        Collective: every member of the current generation calls it at the same step boundary
        (the resize schedule of the config does this from :meth:`step`).

        Args:
            world_size: the new data-parallel world size.
            must_leave: member ids that leave whatever the rank assignment prefers (preemption).
            tensor_parallel: the new AutoTP degree of an AutoTP job (``tensor_parallel.autotp_size``
                in its config), at an unchanged ``world_size`` (the number of processes, TP x DP):
                the TP and DP degrees change, the processes stay
                (:func:`~ds_dynatrain.engine.tp_switch.switch_tensor_parallel`); under
                ``dynatrain launch`` with another ``world_size`` processes leave
                (:mod:`~ds_dynatrain.engine.tp_resize`) or join (:mod:`~ds_dynatrain.engine.tp_grow`).

        Returns:
            The resize record (``from``, ``to``, ``bytes_moved``, ``seconds``, ...) on members of
            the new generation, as it stands when the call returns (with ``transfer_overlap:
            "step"`` the moments' transfer figures come later: :meth:`wait_transition` returns the
            completed record, :attr:`resize_records` holds it); None in a process that left, or
            when the size does not change.

        Raises:
            ResizeRefusedError: ``world_size`` < 1, above ``max_world_size``, breaks the global
                batch, or the job was not started by ``dynatrain launch``; nothing has changed.
            LayoutMismatchError, TransitionAbortedError: the ranks disagreed or a peer failed.
        """
        self._require_member()
        self.wait_transition()
        dt = self._dt
        with released_on_refusal(dt):  # a hold for a switch that will not come goes
            require_integers(world_size, tensor_parallel=tensor_parallel)
            if tensor_parallel is not None or dt.tp_layout is not None:
                return self._resize_tensor_parallel(world_size, must_leave, tensor_parallel)
            return self._resize_data_parallel(world_size, must_leave)

    def _resize_data_parallel(self, world_size: int, must_leave: Tuple[str, ...]) -> Optional[dict]:
        split = self._data_parallel_split(world_size)
        if world_size == self.dp_world_size and not must_leave:
            return None
        zero_optimizer_of(self)  # refuse engines we cannot resize before anything changes
        rec = resize_now(self, world_size, split, tuple(must_leave))
        return None if rec is None else rec.to_dict()

    def _data_parallel_split(self, world_size: int):
        """The batch split of a DP resize to ``world_size``; ResizeRefusedError where the resize
        cannot happen (the global batch, ``max_world_size``, a job not started by ``dynatrain
        launch``)."""
        dt = self._dt
        split = dt.split(world_size)
        if dt.membership is None:
            raise ResizeRefusedError(
                f"world size {world_size} refused: this process was {started_elsewhere()} (which hosts the "
                f"job's membership store and starts joiners); {LAUNCHER_LIMITS}"
            )
        return split

    def prepare_resize(self, world_size: int, tensor_parallel: Optional[int] = None) -> int:
        """Prepare a later ``resize``: a background thread touches the memory the new layout will
        need on this process while training goes on, held until the switch frees it for the new
        engine (:mod:`~ds_dynatrain.engine.switch_memory`). For an AutoTP job's change of TP
        degree at its world size (``tensor_parallel``): the new partitions, larger working
        parameters and gradient buffers; for a DP job's change of world size: the new partitions
        of a rank that stays (a rank the shrink will let go holds nothing). A scheduled change,
        and a requested grow or shrink being prepared behind training, is prepared by itself
        (``dynatrain.warm_switch_steps`` steps early). Not collective. Nothing is held for an
        AutoTP job's change of world size, an unchanged layout (which also lets go of a hold made
        before), working parameters on an accelerator, or ``warm_switch_steps`` 0; a hold lasts
        until the next change of layout, a ``resize`` that refuses, or the engine's close.

        Returns:
            The bytes the thread will touch (at most half the host's available memory over its
            processes; fewer are touched where the switch comes first); 0 where nothing is held.

        Raises:
            ResizeRefusedError: the layout ``resize`` would refuse (a world size that breaks the
                global batch or exceeds ``max_world_size``, a job not started by ``dynatrain
                launch``, an impossible TP degree); nothing has changed.
            NotAMemberError: this process left the job.
        """
        self._require_member()
        require_integers(world_size, tensor_parallel=tensor_parallel)
        dt = self._dt
        if dt.tp_layout is None and tensor_parallel is None and world_size != len(dt.members):
            self._data_parallel_split(world_size)  # ResizeRefusedError: a resize that would refuse
            return prepare_world_change(self, world_size)
        if dt.tp_layout is None or world_size != len(dt.members) or tensor_parallel in (None, dt.tp):
            release_switch_memory(dt)  # a hold made before: not wanted any more
            return 0
        return tp_switch.prepare_tensor_switch(self, tensor_parallel)

    def _resize_tensor_parallel(self, world_size: int, must_leave, tensor_parallel: Optional[int]) -> Optional[dict]:
        dt = self._dt
        if dt.tp_layout is None:
            raise ResizeRefusedError(
                f"tensor_parallel {tensor_parallel} refused: the job was not started with AutoTP "
                "(tensor_parallel.autotp_size in its DeepSpeed config)"
            )
        tp = tp_switch.tp_degree_for(dt, world_size, tensor_parallel)
        if tp != dt.tp and tensor_parallel is None and self.global_rank == 0:
            logger.info(f"world size {world_size}: TP {dt.tp} does not divide it; the job goes on at TP {tp}")
        world = len(dt.members)
        if world_size == world and not must_leave:
            return None if tp == dt.tp else tp_switch.switch_tensor_parallel(self, tp).to_dict()
        if dt.membership is None:
            raise ResizeRefusedError(
                f"world size {world_size} refused: this process was {started_elsewhere()}; such an AutoTP job "
                f"changes only its TP degree at its world size ({world}); `dynatrain launch` serves its shrinks"
            )
        if world_size > world:
            if must_leave:
                raise ResizeRefusedError(
                    f"world size {world_size} refused: a grow cannot also let {list(must_leave)} leave"
                )
            return tp_grow.grow_tensor_parallel(self, world_size, tp).to_dict()
        rec = tp_resize.shrink_tensor_parallel(self, world_size, tp, tuple(must_leave))
        return None if rec is None else rec.to_dict()

    def wait_transition(self) -> Optional[dict]:
        """Finish the optimizer-state transfer of the last resize, if one is still running.

        The optimizer moments of a resize move in a background thread while the DeepSpeed engine
        is rebuilt, and are installed here. By default (``transfer_overlap: "rebuild"``) the
        resize itself calls this before it returns. With ``transfer_overlap: "step"`` the resize
        returns as soon as the new engine can run forward and backward; :meth:`step`,
        :meth:`save_checkpoint`, :meth:`load_checkpoint` and :meth:`resize` call it, and code
        that reads optimizer state (``safe_get_full_optimizer_state``) between the resize and the
        next optimizer step must call it first (until then the optimizer has no state).

        Returns:
            The completed resize record, or None if nothing was pending.

        Raises:
            TransitionAbortedError: a peer failed during the transfer (names the peer and step).
        """
        rec = pending.wait_transition(self)
        return None if rec is None else rec.to_dict()

    def cancel_pending_joiners(self) -> None:
        """Stop joiners started for a generation that will not be formed (the job is ending)."""
        requests.cancel_pending_joiners(self)

    # ------------------------------------------------------------------ DeepSpeed's, overridden
    def forward(self, *inputs, **kwargs):
        """DeepSpeed's ``forward``. A collective that fails because a worker died (ZeRO-3's
        parameter gathers, with ``recovery.peer_replicas``) does not escape: the survivors recover
        in place, the step is abandoned and the call returns an output of the last forward's
        structure whose floating-point tensors are NaN
        (:func:`~ds_dynatrain.engine.recover.abandoned_output`); the following :meth:`backward`
        and :meth:`step` do nothing."""
        self._require_member()
        dt = self._dt
        if dt.step_t0 is None:  # the step's time is counted from its first forward
            dt.step_t0 = time.perf_counter()
        if not dt.inputs_published and dt.membership is not None and self.global_rank == 0:
            dt.inputs_published = True  # what a joiner warms up on (shapes and dtypes only)
            publish_inputs(dt.membership.store, inputs, kwargs)
        if dt.config.recovery.peer_replicas == 0:
            return super().forward(*inputs, **kwargs)
        try:
            out = super().forward(*inputs, **kwargs)
        except Exception as err:  # ZeRO-3 gathers parameters in forward: a death can surface here
            if not recover.handles(self, err):
                raise
            recover.recover(self, err)
            dt.abandoned = True
            return recover.abandoned_output(dt.output_template)
        dt.output_template = recover.output_template(out)
        return out

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """DeepSpeed's ``backward``. A collective that fails because a worker died (with
        ``recovery.peer_replicas``) does not escape: the survivors recover in place
        (:mod:`~ds_dynatrain.engine.recover`), the step is abandoned, the next :meth:`step` call
        does nothing and the loader serves the step's samples again."""
        self._require_member()
        if self._dt.abandoned:  # the step was abandoned in forward
            return None
        try:
            out = super().backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)
        except Exception as err:
            if not recover.handles(self, err):
                raise
            recover.recover(self, err)
            self._dt.abandoned = True
            return None
        value = float(loss.detach().float())
        if not scale_wrt_gas:  # the caller divided by the accumulation steps itself (Trainer): undone for the records
            value *= self.gradient_accumulation_steps()
        self._dt.loss_sum += value
        self._dt.loss_count += 1
        return out

    def step(self, lr_kwargs=None):
        """DeepSpeed's ``step``; after an optimizer step, the plugin's step boundary
        (:func:`~ds_dynatrain.engine.boundary.after_optimizer_step`). After an in-place recovery
        in :meth:`backward`, the abandoned step's call does nothing; a worker's death inside the
        step is recovered from here (the step is then not taken)."""
        dt = self._dt
        if dt.abandoned:
            dt.abandoned = False
            return
        self._require_member()
        try:
            self._elastic_step(lr_kwargs)
        except Exception as err:
            if not recover.handles(self, err):
                recover.fall_back_if_dead(self, err)  # the last resize's transfer met a death
                raise
            recover.recover(self, err)

    def _elastic_step(self, lr_kwargs):
        before = self.global_steps
        if self.is_gradient_accumulation_boundary():
            self.wait_transition()  # the optimizer moments of the last resize must have arrived
            if isinstance(self.checkpoint_engine, SnapshotCheckpointEngine):
                # the optimizer step is the first thing that changes the state a snapshot captures
                self._dt.snapshot_stall_s += self.checkpoint_engine.wait_captured()
        super().step(lr_kwargs=lr_kwargs)
        if self.global_steps != before:
            if isinstance(self.checkpoint_engine, SnapshotCheckpointEngine) and not getattr(
                self.optimizer, "overflow", False
            ):
                self.checkpoint_engine.hold_module = False  # the step cast the master into the working parameters
            dt = self._dt
            if not dt.modules_published and dt.membership is not None and self.global_rank == 0:
                dt.modules_published = True  # what a joiner imports before it joins (names only)
                publish_modules(dt.membership.store)
            generation = dt.generation
            boundary.after_optimizer_step(self)
            if dt.frontend is not None and (dt.generation != generation or dt.retired):
                if catching():
                    raise FrontendRestart(self)  # Trainer's loop resumes on the new world (frontends.restart)
                if dt.in_place_loop is not None:
                    dt.in_place_loop(self)  # a plain Accelerate loop runs on (frontends.accelerate_loop)

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's ``save_checkpoint`` through the snapshot engine; ``latest`` is replaced
        atomically by the engine's commit (DeepSpeed's own write of it is skipped). A
        ``transformers`` model's config is saved too (``dynatrain export`` writes it as
        ``config.json``)."""
        self._require_member()
        self.wait_transition()
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        return super().save_checkpoint(
            save_dir,
            tag=tag,
            client_state=with_model_config(client_state, self.module),  # config.json of an export
            save_latest=latest_by_commit(self, save_latest),
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    def _copy_recovery_script(self, save_path):
        """DeepSpeed's copy of its ``zero_to_fp32.py`` into ``save_path`` (rank 0 alone, between
        barriers): no part of a snapshot, so a failure (a full disk) is a warning, not an
        exception the other ranks would wait for at the barrier."""
        try:
            super()._copy_recovery_script(save_path)
        except OSError as err:
            logger.warning(f"copying DeepSpeed's recovery scripts into {save_path} failed: {err}")

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        **kwargs,
    ):
        """Load a snapshot or a DeepSpeed ZeRO checkpoint, saved at this or any other world size
        and ZeRO stage (1, 2, 3).

        Same world size and stage: DeepSpeed's ``load_checkpoint`` through the snapshot engine
        (``weights_only=True``); afterwards the optimizer-state fragments are linked again so
        ``deepspeed.utils.safe_get_full_optimizer_state`` works at once. Otherwise
        :func:`ds_dynatrain.checkpoint.resharded.load_resharded`: every file of the saving world is
        checked first, then each rank reads only the fragments of its new partitions. Collective.

        Returns:
            ``(load path, client state)`` as DeepSpeed's; ``(None, None)`` when nothing is found.

        Raises:
            CheckpointIncompleteError: missing or damaged files of the saving world.
            LayoutMismatchError: the checkpoint holds another model (names the first parameter).
        """
        self._require_member()
        self.wait_transition()
        path, client = loading.load_checkpoint(
            self,
            super().load_checkpoint,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_strict=load_module_strict,
            **kwargs,
        )
        if isinstance(client, dict):
            client.pop(MODEL_CONFIG_KEY, None)  # the plugin's, not the caller's client state
        return path, client

    def _broadcast_model(self):
        """DeepSpeed's set-up broadcast of the working parameters, shaped by the resize: none
        after a shrink (every survivor holds them already); after a grow, only the joiners
        receive, each parameter ``k`` from survivor ``k mod S`` (point-to-point messages, all
        posted at once, so the survivors send over their own connections in parallel and no
        survivor receives what it holds; :func:`~ds_dynatrain.transition.spread.post_to_joiners`,
        posted already where the resize began them beside the moments' transfer);
        DeepSpeed's own otherwise."""
        dt = self.__dict__.get("_dt")
        mode = dt.rebuild_broadcast if dt is not None else None
        if mode is None:
            return super()._broadcast_model()
        if mode == "none":
            return None
        posted, dt.params_posted = dt.params_posted, None  # posted when the transfer began (a grow)
        if posted is None:
            posted = post_to_joiners([p.data for _, p in self.module.named_parameters()], list(mode))
        dt.params_spread = (posted.wait(), time.perf_counter())
        return None

    def destroy(self):
        """DeepSpeed's ``destroy``, except inside Trainer's ``train`` whose loop resumes after a
        resize with this engine (Accelerate destroys the prepared engine when the loop starts)."""
        if not (catching() and self._dt.frontend is not None):
            super().destroy()

    def _require_member(self):
        dt = getattr(self, "_dt", None)
        if dt is not None:
            dt.require_member()
