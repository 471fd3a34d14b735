"""``ElasticEngine.load_checkpoint``: a snapshot or a DeepSpeed ZeRO checkpoint, at the saving layout
through DeepSpeed's own load, at any other world size or ZeRO stage through the resharded load."""

from __future__ import annotations

import os
from typing import Callable, Optional, Tuple

from ..checkpoint.resharded import load_resharded
from ..checkpoint.saved import SavedCheckpoint
from ..elastic.collective import raise_on_every_rank
from ..errors import CheckpointIncompleteError
from ..log import logger
from ..zero.state import relink_optimizer_state
from .records import LoadRecord


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
    used at the saving world size and stage. Collective.

    Raises:
        CheckpointIncompleteError: missing or damaged files of the saving world (on every rank).
        LayoutMismatchError: the checkpoint holds another model (names the first parameter).
    """
    saved = None
    if engine.zero_optimization_stage() in (1, 2, 3) and (
        tag is not None or os.path.isfile(os.path.join(load_dir, "latest"))
    ):
        saved = SavedCheckpoint(load_dir, tag)  # refuses an incomplete checkpoint before anything loads
    if saved is not None and (saved.world_size, saved.stage) != (
        engine.dp_world_size,
        engine.zero_optimization_stage(),
    ):
        path, client, stats = load_resharded(
            engine, load_dir, saved.tag, load_optimizer_states, load_lr_scheduler_states, saved=saved
        )
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
                )
            )
            logger.info(
                f"loaded {path} (ZeRO-{stats.saved_stage}, {stats.saved_world_size} ranks) onto "
                f"{stats.world_size} ranks (ZeRO-{stats.stage}): {stats.bytes_read / 2**20:.2f} MiB read "
                f"on rank 0 in {stats.seconds:.2f} s"
            )
        return path, client
    if saved is not None:
        saved.close()  # the same layout: DeepSpeed's own load reads the files
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
        problem = f"{type(err).__name__}: {err}"
    # one rank's damaged file fails every rank (else the others train on and hang on it)
    raise_on_every_rank(problem, CheckpointIncompleteError, f"loading {load_dir} failed")
    if out[0] is not None:
        relink_optimizer_state(engine)
    return out
