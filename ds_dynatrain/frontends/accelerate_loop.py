"""A plain Hugging Face Accelerate loop (``accelerator.prepare``, ``accumulate``, ``backward``)
under ``dynatrain launch``: it runs on, in its processes, through every resize that shrinks the job.

Unlike Trainer's loop (:mod:`.restart`), a plain loop cannot be entered again at a step: its
counters (epoch, step, whatever the script keeps) live in the script. So the loop is never left;
after a resize, inside ``engine.step()`` (which ``accelerator.backward`` calls at the end of each
step), before the loop issues another collective, :func:`follow` sets what Accelerate cached from
the old world to the new one:

* the process count and index of ``PartialState``/``AcceleratorState``;
* the accelerator's accumulation steps (the micro-batches ``accumulate()`` counts to a step) and
  its micro-step counter (``accelerator.step``, put on the step boundary), and the DeepSpeed
  plugin's batch keys;
* the data loaders: every map-style loader this accelerator prepared is an
  :class:`~.elastic_shard.ElasticLoaderShard`, which cuts each micro-batch for the world of the
  moment, so the epoch goes on where it stands (also after ``accelerator.skip_first_batches``).

A process that leaves at the resize ends there: ``SystemExit(0)`` from ``accelerator.backward``
(the script's ``finally`` blocks run; no other code of its loop issues a collective the remaining
processes would not match).

What such a loop cannot do is take a process that was not in it: a joiner would run the script
from its first line with its counters at zero. So the job refuses grows (``dynatrain resize`` up,
``dynatrain join``, a refill; a grow in the resize schedule, ``standby`` and the launcher's
restart from a snapshot after a failure are refused when the engine is built) with the reason.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

from ..config import SECTION, ConfigError, parse_section
from ..log import logger

_accelerators: "weakref.WeakSet" = weakref.WeakSet()  # accelerators whose loaders follow resizes


def _under_launch() -> bool:
    from ..elastic.launch_env import LaunchContext

    return LaunchContext.from_environ() is not None


def _uses_section(accelerator) -> bool:
    from .configs import sections

    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return plugin is not None and bool(sections(plugin))


def _elastic_engine_of(accelerator) -> Optional[object]:
    from ..engine.elastic_engine import ElasticEngine

    return next((m for m in getattr(accelerator, "_models", []) if isinstance(m, ElasticEngine)), None)


def check_plain_loop(section: dict) -> None:
    """The ``"dynatrain"`` section of a plain Accelerate loop under ``dynatrain launch``: nothing in
    it may need a process to enter the loop at the job's step.

    Raises:
        ConfigError: a grow in ``resize_schedule``; ``standby`` (processes that leave would be
            taken back later); a launcher restart from snapshots after a failure
            (``snapshot.restore_on_failure`` with ``snapshot.interval_steps``).
    """
    cfg = parse_section(section)
    why = []
    size = _launch_world_size()
    for event in cfg.resize_schedule:
        if event.world_size > size:
            why.append(f"resize_schedule grows the job ({size} -> {event.world_size} ranks after step {event.step})")
        size = event.world_size
    if cfg.standby:
        why.append("standby is on (a process that left would be taken back by a grow)")
    if cfg.snapshot.interval_steps and cfg.snapshot.restore_on_failure:
        why.append(
            "snapshot.restore_on_failure is on (the launcher would restart the script from its first line at the "
            "snapshot's step; set it to false, and resume with accelerator.load_state, which loads at any world size)"
        )
    if why:
        raise ConfigError(
            f"a plain Accelerate loop under `dynatrain launch` runs on through shrinks but cannot take a process "
            f"that was not in it (its counters live in the script), so its {SECTION!r} section must not ask for "
            "one: " + "; ".join(why)
        )


def _launch_world_size() -> int:
    from ..elastic.launch_env import LaunchContext

    ctx = LaunchContext.from_environ()
    return ctx.world_size if ctx is not None else 1


def in_place_loop_for(frontend: Optional[str], section: dict) -> Optional[Callable]:
    """:func:`follow` for an engine that Accelerate builds outside Trainer's ``train`` under
    ``dynatrain launch`` (after :func:`check_plain_loop` of its section); None otherwise."""
    from ..engine.frontend import catching

    if frontend is None or frontend.split(".")[0] != "accelerate" or catching() or not _under_launch():
        return None
    check_plain_loop(section)
    return follow


def follow(engine) -> None:
    """After a change of the world, on every process: a process that left exits; the others set
    Accelerate's cached world, accumulation steps and micro-step counter to ``engine``'s
    (module docstring). Called by the engine inside ``step()``."""
    if not engine.is_member:
        logger.info(f"member {engine._dt.member} left the job at a resize; this process ends (exit status 0)")
        raise SystemExit(0)
    from .accelerate_state import set_accumulation, set_world

    set_world(engine.dp_world_size, engine.global_rank)
    for accelerator in list(_accelerators):
        if _elastic_engine_of(accelerator) is engine:
            gas = set_accumulation(accelerator, engine)
            accelerator.step = engine.global_steps * gas  # on the step boundary: accumulate() counts anew
            logger.info(
                f"the Accelerate loop goes on at step {engine.global_steps} on {engine.dp_world_size} processes "
                f"({gas} accumulation steps)"
            )


def _prepare_data_loader(wrapped, instance, args, kwargs):
    """``Accelerator.prepare_data_loader``; under ``dynatrain launch`` with a ``"dynatrain"``
    section, outside Trainer, the loader returned (and kept in ``_dataloaders``) is an
    :class:`~.elastic_shard.ElasticLoaderShard`."""
    from ..engine.frontend import catching
    from .elastic_shard import elastic_shard

    loader = wrapped(*args, **kwargs)
    trainers = getattr(instance, "_dt_trainer", False)  # Trainer prepares its loaders anew after a resize
    if trainers or catching() or not _under_launch() or not _uses_section(instance):
        return loader
    ref = weakref.ref(instance)
    shard = elastic_shard(loader, lambda: _elastic_engine_of(ref()) if ref() is not None else None)
    _accelerators.add(instance)
    loaders = getattr(instance, "_dataloaders", [])
    for i, kept in enumerate(loaders):
        if kept is loader:
            loaders[i] = shard
    return shard


def _skip_first_batches(wrapped, instance, args, kwargs):
    """``Accelerator.skip_first_batches``: for an elastic shard, a copy that starts that many of
    this process's batches (at the current world) into the epoch."""
    from .elastic_shard import ElasticLoaderShard

    loader = args[0] if args else kwargs.get("dataloader")
    if not isinstance(loader, ElasticLoaderShard):
        return wrapped(*args, **kwargs)
    num = args[1] if len(args) > 1 else kwargs.get("num_batches", 0)
    skipped = type(loader).__new__(type(loader))
    skipped.__dict__.update(loader.__dict__)
    skipped.skip_batches = int(num)
    return skipped


def hook_skip_function(module) -> None:
    """Wrap ``module.skip_first_batches`` (``accelerate.data_loader``'s, or the package's re-export)
    once, so that ``from accelerate import skip_first_batches`` keeps an elastic shard too."""
    import wrapt

    fn = getattr(module, "skip_first_batches", None)
    if fn is not None and not isinstance(fn, wrapt.FunctionWrapper):
        wrapt.wrap_function_wrapper(module, "skip_first_batches", _skip_first_batches)


def hook_accelerator(module) -> None:
    """Wrap ``prepare_data_loader`` and ``skip_first_batches`` of ``module.Accelerator``."""
    import wrapt

    wrapt.wrap_function_wrapper(module, "Accelerator.prepare_data_loader", _prepare_data_loader)
    wrapt.wrap_function_wrapper(module, "Accelerator.skip_first_batches", _skip_first_batches)
