"""``ds_dynatrain.initialize``: ``deepspeed.initialize`` with an elastic engine behind it."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .config import ConfigError, check_snapshot_storage, load_ds_config
from .data import ElasticDataLoader
from .elastic.launch_env import LaunchContext
from .engine.build import start_engine
from .log import logger


def _check_storage(dt_cfg) -> None:
    """:func:`~ds_dynatrain.config.check_snapshot_storage`, its finding logged (at debug level under
    ``dynatrain launch``, whose launcher logged the same line for the whole job). Raises ConfigError."""
    storage = check_snapshot_storage(dt_cfg)
    if storage is not None:
        (logger.debug if LaunchContext.from_environ() is not None else logger.info)(storage.describe())


def _config_of(args: Any, config: Any, config_params: Any) -> Any:
    """The DeepSpeed config from ``config``, ``config_params`` or ``args.deepspeed_config``, the
    first given. Raises ConfigError when none is."""
    for given in (config, config_params, getattr(args, "deepspeed_config", None)):
        if given is not None:
            return given
    raise ConfigError("no DeepSpeed config: pass config= or args.deepspeed_config")


def _refuse_frontend_under_launch(frontend: Optional[str], in_place_loop: Optional[Callable]) -> None:
    """ConfigError for an engine a front-end builds under ``dynatrain launch`` outside Trainer's
    ``train`` when nothing makes its loop follow a resize (Lightning; Accelerate's plain loop
    passes ``in_place_loop``)."""
    from .engine.frontend import catching

    if frontend is not None and in_place_loop is None and not catching() and LaunchContext.from_environ() is not None:
        raise ConfigError(
            f"an engine built by {frontend} outside Hugging Face Trainer's train() under `dynatrain launch`: "
            "resizing this loop online is not supported (its step, data and accumulation counters would not "
            "follow); start it with torchrun or deepspeed, where snapshots and resuming at any world size "
            "work, or train with Trainer or a plain Accelerate loop"
        )


def _refuse_model_parallel(mpu) -> None:
    """Refuse a job whose layout DeepSpeed gets from a user's ``mpu``: its partitions hold
    model-parallel parameters no layout here describes.

    Raises:
        ConfigError: a model-parallel ``mpu``. (An AutoTP config is checked with the world size:
            ``config.check_tensor_parallel``; a ``PipelineModule`` brings its own grid.)
    """
    if mpu is not None:
        raise ConfigError("ds_dynatrain resizes data-parallel-only jobs; a model-parallel mpu is not supported")


def _start_pipeline(
    model,
    optimizer,
    model_parameters,
    training_data,
    lr_scheduler,
    ds_config,
    dt_cfg,
    *,
    frontend,
    seed,
    shuffle,
    collate_fn,
):
    """``initialize`` of a ``deepspeed.pipe.PipelineModule``: an
    :class:`~ds_dynatrain.engine.pp_engine.ElasticPipelineEngine`. ``training_data`` is served
    by an :class:`~ds_dynatrain.data.ElasticDataLoader` that ``train_batch()`` reads (repeated
    over epochs, as DeepSpeed's own), following the global sample order across PP changes; else
    the caller passes ``data_iter``. Raises ConfigError: a front-end's engine."""
    from deepspeed.runtime.dataloader import RepeatingLoader

    from .engine.pp_engine import start_pipeline_engine

    if frontend is not None:
        raise ConfigError(f"a PipelineModule job through {frontend}: DeepSpeed's pipeline engine trains by train_batch")
    engine = start_pipeline_engine(model, optimizer, model_parameters, lr_scheduler, ds_config, dt_cfg)
    loader = None
    if training_data is not None:
        loader = ElasticDataLoader(training_data, engine, engine._dt.global_batch, seed, shuffle, collate_fn)
        engine._dt.pipeline_data = RepeatingLoader(loader)
        engine.set_dataiterator(engine._dt.pipeline_data)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def initialize(
    args: Any = None,
    model: Optional[torch.nn.Module] = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = 29500,
    mpu=None,
    dist_init_required: Optional[bool] = None,
    collate_fn=None,
    config=None,
    config_params=None,
    *,
    seed: int = 0,
    shuffle: bool = True,
    frontend: Optional[str] = None,
    in_place_loop: Optional[Callable] = None,
):
    """Drop-in for ``deepspeed.initialize`` returning an :class:`~ds_dynatrain.engine.elastic_engine.ElasticEngine`.

    Same arguments and return values as ``deepspeed.initialize`` (``(engine, optimizer,
    training_dataloader, lr_scheduler)``), with these differences:

    * the config may hold a ``"dynatrain"`` section (validated; DeepSpeed never sees it);
    * ``training_data`` is served by an :class:`~ds_dynatrain.data.ElasticDataLoader` (sample order
      from ``seed``), whose position survives resizes;
    * in a process the launcher started as a *joiner*, this call joins the running job: it receives
      its partitions and the training state, and returns an engine positioned at the job's step.

    ``frontend``: the module whose ``deepspeed.initialize`` call :mod:`ds_dynatrain.frontends` sent
    here; under ``dynatrain launch`` only inside Trainer's ``train`` (``frontends.restart``) or with
    ``in_place_loop``, called with the engine on every process after each change of the world (a
    plain Accelerate loop, ``frontends.accelerate_loop``; such a job refuses grows).

    Raises:
        ConfigError: invalid ``"dynatrain"`` section or batch keys, a resize schedule that cannot
            keep the global batch, resizing asked of a job not started by ``dynatrain launch``, or
            a ``snapshot.dir`` that is no writable directory and cannot be made one (before any engine);
            a ``frontend`` engine outside Trainer's ``train`` in a process of ``dynatrain launch``
            without ``in_place_loop``.
    """
    import deepspeed

    if model is None:
        raise ValueError("ds_dynatrain.initialize requires a model")
    if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
        model_parameters = list(model_parameters)  # a generator would be spent by the first engine
    ds_config, dt_cfg = load_ds_config(_config_of(args, config, config_params))
    if not dt_cfg.enabled:
        plain = dict(optimizer=optimizer, model_parameters=model_parameters, training_data=training_data)
        plain.update(lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu, collate_fn=collate_fn)
        return deepspeed.initialize(model=model, dist_init_required=dist_init_required, config=ds_config, **plain)
    _refuse_model_parallel(mpu)
    from deepspeed.pipe import PipelineModule

    if isinstance(model, PipelineModule):
        data = dict(seed=seed, shuffle=shuffle, collate_fn=collate_fn)
        args = (model, optimizer, model_parameters, training_data, lr_scheduler, ds_config, dt_cfg)
        return _start_pipeline(*args, frontend=frontend, **data)
    _refuse_frontend_under_launch(frontend, in_place_loop)
    _check_storage(dt_cfg)  # bad storage found before anything trains
    engine = start_engine(
        model,
        optimizer,
        model_parameters,
        lr_scheduler,
        ds_config,
        dt_cfg,
        collate_fn=collate_fn,
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    loader = None
    if training_data is not None:
        loader = ElasticDataLoader(
            training_data, engine, engine._dt.global_batch, seed=seed, shuffle=shuffle, collate_fn=collate_fn
        )
    engine._dt.frontend = frontend
    engine._dt.in_place_loop = in_place_loop
    return engine, engine.optimizer, loader, engine.lr_scheduler
