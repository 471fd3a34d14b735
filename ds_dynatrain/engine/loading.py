"""``ElasticEngine.load_checkpoint``: a snapshot or a DeepSpeed ZeRO checkpoint, at the saving layout
through DeepSpeed's own load, at any other world size, ZeRO stage or partition layout through the
resharded load. Either way the checkpoint is first checked against the model on every rank."""

from __future__ import annotations

import os
from typing import Callable, Optional, Tuple

from io_engine.errors import IOEngineError

from ..checkpoint.fit import check_model, saved_partition_keys
from ..checkpoint.resharded import BandLoad, load_resharded
from ..checkpoint.saved import LAYER_FILE, SavedCheckpoint
from ..checkpoint.saved_pp import saved_pp_layout
from ..checkpoint.saved_tp import saved_tp_layout
from ..checkpoint.snapshot import SnapshotCheckpointEngine
from ..checkpoint.state_file import files_loaded_by
from ..config import tensor_parallel_grain
from ..elastic.collective import raise_on_every_rank
from ..errors import CheckpointIncompleteError, CheckpointNotPartitionedError, DynatrainError, LayoutMismatchError
from ..log import logger, plural
from ..vps.pipeline import PipelineLayout
from ..vps.tensor_parallel import TensorParallelLayout
from ..zero.geometry import layout_of
from ..zero.state import relink_optimizer_state
from .records import LoadRecord
from .tp_switch import skeleton_splits


def load_checkpoint(
    engine,
    deepspeed_load: Callable[..., Tuple],
    load_dir: str,
    tag=None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    **kwargs,
) -> Tuple[Optional[str], Optional[dict]]:
    """Load ``load_dir`` (``tag``: its ``latest`` when None) into ``engine``; see
    :meth:`~ds_dynatrain.engine.elastic_engine.ElasticEngine.load_checkpoint`.

    ``deepspeed_load``: DeepSpeed's own ``load_checkpoint`` of the engine (same arguments),
    used when the checkpoint's partitions are the engine's (same world size, ZeRO stage and
    parameters in each partition), and for ``load_module_only=True`` (the module state alone,
    by name). Collective.

    Raises:
        CheckpointIncompleteError: missing or damaged files of the saving world.
        LayoutMismatchError: the checkpoint holds another model (names the first parameter),
            at any world size.
        Either on every rank, each distinct problem named once.
    """
    # DeepSpeed's load_module_only reads the module state by name and no partition: its own load
    # (a pipeline's checkpoint checked first on every rank: its stages read their own layer files)
    if kwargs.get("load_module_only"):
        _check_module_only(engine, load_dir, tag)
        saved, bands = None, None
    else:
        saved, bands = _open_checked(engine, load_dir, tag)
    if saved is not None:
        _warn_global_batch(engine, saved)
        _warn_past_schedule(engine, saved.step)
    if saved is not None and (bands is not None or not _same_partitions(engine, saved)):
        return _load_resharded(engine, saved, load_dir, load_optimizer_states, load_lr_scheduler_states, bands)
    if saved is not None:
        _read_ahead(engine, saved)  # the same layout: DeepSpeed's own load reads the files
    problem, out = None, (None, None)
    try:
        out = deepspeed_load(
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            **kwargs,
        )
    except Exception as err:  # noqa: BLE001 - reported on every rank below, then raised
        problem = _as_ours(err)
    finally:
        if isinstance(engine.checkpoint_engine, SnapshotCheckpointEngine):
            engine.checkpoint_engine.read_ahead.clear()  # what DeepSpeed did not ask for
    # one rank's damaged file fails every rank (else the others train on and hang on it)
    raise_on_every_rank(problem, CheckpointIncompleteError, f"loading {load_dir} failed")
    if out[0] is not None:
        relink_optimizer_state(engine)
        if isinstance(engine.checkpoint_engine, SnapshotCheckpointEngine):
            # DeepSpeed's own load set the working parameters from the file's module, which need not
            # be the cast of the loaded master: snapshots write them whole until the next step
            engine.checkpoint_engine.hold_module = True
    return out


def _warn_past_schedule(engine, step: int) -> None:
    """A warning (rank 0) naming the ``resize_schedule`` entries at or before the loaded ``step``:
    the job goes on from there, so they never run."""
    past = sorted(e.step for e in engine._dt.config.resize_schedule if e.step <= step)
    if past and engine.global_rank == 0:
        logger.warning(
            f"dynatrain.resize_schedule entries at steps {past} are at or before the loaded step {step}: "
            "the job goes on from there, so they will not run"
        )


def _warn_global_batch(engine, saved: SavedCheckpoint) -> None:
    """A warning (rank 0) when the checkpoint was saved with another global batch: a loop that
    skips the samples already trained by counting steps (Trainer, Accelerate's
    ``skip_first_batches``) then skips too few or too many, so samples are seen twice or never."""
    was = saved.ds_config.get("train_batch_size")
    now = engine.train_batch_size()
    if isinstance(was, int) and was != now and engine.global_rank == 0:
        logger.warning(
            f"{saved.dir} was saved with a global batch of {was} samples and this engine trains {now} "
            f"(train_batch_size = micro-batch x gradient accumulation x world size): a loop that skips the "
            "trained samples by counting steps will repeat or miss some; keep the global batch to resume exactly"
        )


def _open_checked(engine, load_dir: str, tag):
    """``(checkpoint, band route)``: the checkpoint opened and checked against the model on every
    rank (one agreement), or ``(None, None)`` when there is nothing of ours to check (no tag and no
    ``latest``: DeepSpeed's own load reports that; an engine without ZeRO partitions). The band
    route is None unless the checkpoint or the engine is AutoTP's or a pipeline's
    (:func:`_band_load`); such a checkpoint is checked against the model by the load itself,
    before anything is installed.

    Raises:
        CheckpointIncompleteError, LayoutMismatchError: on every rank, before anything is read.
    """
    if engine.zero_optimization_stage() not in (1, 2, 3):
        return None, None
    if tag is None and not os.path.lexists(os.path.join(load_dir, "latest")):
        return None, None
    saved, bands, problem = None, None, None
    try:
        saved = SavedCheckpoint(load_dir, tag)  # refuses an incomplete checkpoint before anything loads
        bands = _band_load(engine, saved)
        if bands is None:
            check_model(engine, saved, layout_of(engine))
    except (DynatrainError, IOEngineError, OSError) as err:
        problem = err
    if problem is not None and saved is not None:
        saved.close()
    raise_on_every_rank(problem, CheckpointIncompleteError, f"loading {load_dir} refused, nothing was loaded")
    return saved, bands


def _check_module_only(engine, load_dir: str, tag) -> None:
    """A pipeline job's ``load_module_only``: before DeepSpeed's own load reads each stage's layer
    files, the checkpoint is opened (every file of the saving world, each layer file a stage's
    parameters name included), checked against the model (:func:`saved_pp_layout`), and this
    rank's layer files are read and checked (this project's files: every checksum; handed to
    DeepSpeed's load by the snapshot engine), agreed on every rank: one stage's missing or damaged
    file otherwise fails that stage alone, in the middle of the load, while the others wait in its
    tied-weight broadcast, and layers read before it are left replaced.

    Raises:
        CheckpointIncompleteError, CheckpointCorruptError, LayoutMismatchError: on every rank,
            before anything is read into the model.
    """
    dt = engine._dt
    if dt.pp_layout is None or (tag is None and not os.path.lexists(os.path.join(load_dir, "latest"))):
        return
    saved, problem = None, None
    ce = engine.checkpoint_engine
    try:
        saved = SavedCheckpoint(load_dir, tag)
        saved_pp_layout(saved, dt.pp_layout)
        stage = dt.pp_layout.stage_of_rank(engine.global_rank)
        lo, hi = dt.pp_layout.parts[stage], dt.pp_layout.parts[stage + 1]
        mine = [os.path.join(saved.dir, LAYER_FILE.format(i)) for i in range(lo, hi)]
        if isinstance(ce, SnapshotCheckpointEngine):
            ce.read_ahead.read([p for p in mine if os.path.exists(p)])
    except CheckpointNotPartitionedError:  # the same on every rank (one model-state file)
        return  # a pipeline saved without ZeRO: DeepSpeed's own load reads its layer files
    except (DynatrainError, IOEngineError, OSError) as err:
        problem = err
    finally:
        if saved is not None:
            saved.close()
    if problem is not None and isinstance(ce, SnapshotCheckpointEngine):
        ce.read_ahead.clear()
    raise_on_every_rank(problem, CheckpointIncompleteError, f"loading {load_dir} refused, nothing was loaded")


def _band_load(engine, saved: SavedCheckpoint) -> Optional[BandLoad]:
    """The load through the box planner (even at the saving layout) when the engine is a
    pipeline's (the saved layout split where the saved stages' files say) or the checkpoint or
    the engine is AutoTP's (the model cut as AutoTP cuts it at the saved degree; an engine without
    AutoTP is a TP 1 layout of its own ZeRO layout), else None.

    Raises:
        LayoutMismatchError: a pipeline checkpoint into a job without a pipeline, or AutoTP cannot
            cut the model at the saved degree.
    """
    dt = engine._dt
    if dt.pp_layout is not None:
        live = dt.pp_layout
        return BandLoad(live, lambda s: saved_pp_layout(s, live))
    if saved.pp > 1:
        raise LayoutMismatchError(
            f"{saved.dir} was saved by a pipeline at {saved.degrees()}: it loads into a PipelineModule job"
        )
    if saved.tp == 1 and dt.tp_layout is None:
        return None
    live = dt.tp_layout
    if live is None:
        zl = layout_of(engine)
        live = TensorParallelLayout(
            1, zl.world_size, zl.groups, (), zl.stage, zl.round_robin, zl.parameter_alignment, zl.sub_group_size
        )
    splits = {}
    if saved.tp > 1:
        try:
            splits = skeleton_splits(engine.module, saved.tp, tensor_parallel_grain(saved.ds_config))
        except (ValueError, AssertionError, AttributeError, TypeError, LayoutMismatchError) as err:
            raise LayoutMismatchError(
                f"{saved.dir} was saved by AutoTP at TP {saved.tp}; this model cannot be cut at it ({err})"
            ) from None
    return BandLoad(live, lambda s: saved_tp_layout(s, live, splits))


def _read_ahead(engine, saved: SavedCheckpoint) -> None:
    """Read (and check every byte of) the files DeepSpeed's own load will read on this rank before
    it installs any of them, agreed on every rank: a damaged optimizer file found after the module
    state was installed would leave the model holding the checkpoint's weights beside the old
    optimizer state. The snapshot engine hands what was read back to DeepSpeed's load (no second
    read). Closes ``saved``.

    Raises:
        CheckpointCorruptError, CheckpointIncompleteError: on every rank, before anything changes.
    """
    ce = engine.checkpoint_engine
    problem = None
    try:
        if isinstance(ce, SnapshotCheckpointEngine):
            ce.read_ahead.read(files_loaded_by(saved, engine.global_rank))
    except DynatrainError as err:
        problem = err
    finally:
        saved.close()
    if problem is not None:
        ce.read_ahead.clear()
    raise_on_every_rank(problem, CheckpointIncompleteError, f"loading {saved.dir} refused, nothing was loaded")


def _same_partitions(engine, saved: SavedCheckpoint) -> bool:
    """Whether the saved partitions are the engine's: the same world size and ZeRO stage, and the
    same parameters in each partition in the same order (a checkpoint saved with another
    ``sub_group_size`` or ``round_robin_gradients`` goes through the resharded load)."""
    if (saved.world_size, saved.stage) != (engine.dp_world_size, engine.zero_optimization_stage()):
        return False
    live = layout_of(engine)
    return saved_partition_keys(saved) == [live.partition_keys(b) for b in range(live.num_partitions)]


def _as_ours(err: Exception) -> Exception:
    """DeepSpeed's own load refusing a module state of another model (``load_state_dict``'s
    ``Error(s) in loading state_dict``) is a :class:`LayoutMismatchError`; other errors are
    reported as they are."""
    if isinstance(err, RuntimeError) and "Error(s) in loading state_dict" in str(err):
        return LayoutMismatchError(str(err).strip())
    return err


def _load_resharded(engine, saved, load_dir, load_optimizer_states, load_lr_scheduler_states, bands=None):
    path, client, stats = load_resharded(
        engine, load_dir, saved.tag, load_optimizer_states, load_lr_scheduler_states, saved=saved, bands=bands
    )
    tp = bands is not None and not isinstance(bands.live, PipelineLayout)
    pp = bands is not None and not tp
    if engine.global_rank == 0:
        engine._dt.metrics.write(
            LoadRecord(
                step=engine.global_steps,
                from_world_size=stats.saved_world_size,
                to_world_size=stats.world_size,
                saved_stage=stats.saved_stage,
                stage=stats.stage,
                bytes_read=stats.bytes_read,
                seconds=stats.seconds,
                plan_s=stats.plan_s,
                read_s=stats.read_s,
                dir=path,
                tensor_parallel_from=stats.saved_tp if tp else None,
                tensor_parallel_to=stats.tp if tp else None,
                pipeline_parallel_from=stats.saved_pp if pp else None,
                pipeline_parallel_to=stats.pp if pp else None,
            )
        )
        if tp:
            was = f"TP {stats.saved_tp} x DP {stats.saved_world_size}"
            now = f"TP {stats.tp} x DP {stats.world_size}"
        elif pp:
            was = f"PP {stats.saved_pp} x DP {stats.saved_world_size}"
            now = f"PP {stats.pp} x DP {stats.world_size}"
        else:
            was, now = plural(stats.saved_world_size, "rank"), plural(stats.world_size, "rank")
        logger.info(
            f"loaded {path} (ZeRO-{stats.saved_stage}, {was}) onto {now} (ZeRO-{stats.stage}): "
            f"{stats.bytes_read / 2**20:.2f} MiB read on rank 0 in {stats.seconds:.2f} s"
        )
    return path, client
