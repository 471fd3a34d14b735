"""Hugging Face Accelerate's ``load_state`` made right for a state saved at another world size.

``Accelerator.load_state`` (accelerate 1.x, ``checkpointing.load_accelerator_state``) restores the
accelerator's micro-step counter ``step``, which ``accumulate()`` uses to decide when gradients are
synchronised, from the per-process file ``random_states_<process index>.pkl``. Resumed on more
processes, the new ones find no file and keep 0 while the others take the saved count; resumed
with another number of accumulation steps, the saved count is off the new boundary. Either way the
ranks disagree about which micro-batch ends a step, and the first optimizer step after the resume
is a collective mismatch (gloo: "Received data size doesn't match expected size").

A DeepSpeed checkpoint holds no partly accumulated gradients, so a loaded state is always at a step
boundary: after the load, the counter is set to ``global_steps x gradient_accumulation_steps`` on
every rank, when an engine of ours was prepared (a log line says when that changed it).
"""

from __future__ import annotations

import os

from ..config import SECTION, ConfigError
from ..log import logger
from .accelerate_loop import hook_accelerator, hook_skip_function
from .configs import section_of, sections

ACCELERATOR_MODULE = "accelerate.accelerator"


def _realign(accelerator) -> None:
    from ..engine.elastic_engine import ElasticEngine

    engines = [m for m in getattr(accelerator, "_models", []) if isinstance(m, ElasticEngine)]
    if not engines:
        return
    boundary = engines[0].global_steps * accelerator.gradient_accumulation_steps
    if accelerator.step != boundary:
        logger.info(
            f"ds_dynatrain: accelerator.step {accelerator.step} -> {boundary} (step {engines[0].global_steps} x "
            f"{accelerator.gradient_accumulation_steps} accumulation steps): the loaded state is at a step boundary"
        )
        accelerator.step = boundary


def _load_state(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    _realign(instance)
    return out


def _init(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    plugin = kwargs.get("deepspeed_plugin") or kwargs.get("deepspeed_plugins")
    sectioned = plugin is not None and bool(sections(plugin))
    if plugin is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes"):
        # the config of `accelerate launch --deepspeed_config_file` (or `dynatrain launch`'s) by Accelerate's variable
        sectioned = section_of(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")) is not None
    if sectioned and str(instance.distributed_type) != "DistributedType.DEEPSPEED":
        raise ConfigError(
            f"this Accelerator does not use DeepSpeed (distributed type {instance.distributed_type}), so the "
            f"{SECTION!r} section of its DeepSpeed plugin's config would be ignored: Accelerate selects DeepSpeed "
            "with `accelerate launch --use_deepspeed` (or ACCELERATE_USE_DEEPSPEED=true) and without cpu=True"
        )
    return out


def _hook(module) -> None:
    import wrapt

    if not getattr(module.Accelerator.load_state, "__ds_dynatrain_wrapped__", False):
        wrapt.wrap_function_wrapper(module, "Accelerator.load_state", _load_state)
        wrapt.wrap_function_wrapper(module, "Accelerator.__init__", _init)
        hook_accelerator(module)  # a plain loop's data loaders and counters follow resizes
        module.Accelerator.load_state.__ds_dynatrain_wrapped__ = True


def install_accelerate_hooks() -> None:
    """Wrap ``Accelerator.load_state`` once ``accelerate.accelerator`` is imported (at once if it is)."""
    import wrapt

    wrapt.register_post_import_hook(_hook, ACCELERATOR_MODULE)
    for name in ("accelerate.data_loader", "accelerate"):  # the function, and its re-export
        wrapt.register_post_import_hook(hook_skip_function, name)
