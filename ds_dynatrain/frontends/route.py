"""``deepspeed.initialize`` routed to :func:`ds_dynatrain.initialize` for configs with a
``"dynatrain"`` section, and a DeepSpeed config guard that refuses the section anywhere else.

Why a rebinding: Hugging Face Accelerate (``Accelerator._prepare_deepspeed``, which Trainer reaches
through ``accelerator.prepare``) and Lightning's ``DeepSpeedStrategy`` look ``deepspeed.initialize``
up on the module when they call it, and neither offers a hook to substitute it; rebinding the one
public function reaches all three with no change to the user's script but ``import ds_dynatrain``.
Nothing else of DeepSpeed is replaced.

Why the guard: DeepSpeed ignores unknown top-level keys, so a config whose ``"dynatrain"`` section
reached DeepSpeed by another road (``from deepspeed import initialize`` bound before the import, a
``DeepSpeedEngine`` built by hand, ``deepspeed.init_inference``) would train without the plugin,
silently. Once the package is imported, such an engine is refused at its config, before anything is
built. :func:`ds_dynatrain.initialize` strips the section before DeepSpeed sees it.
"""

from __future__ import annotations

import copy
import functools
import sys
from typing import Any, Tuple

import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig

from ..config import SECTION, ConfigError
from ..log import logger
from .configs import parsed_config, section_of  # noqa: F401  (section_of: the package's public name)

_ORIGINAL_ATTR = "__ds_dynatrain_original__"
# callers that keep step, data and accumulation counters of their own (Trainer goes through accelerate)
FRONTEND_PACKAGES = ("accelerate", "transformers", "lightning", "pytorch_lightning")


def _config_of(args: Any, kwargs: dict) -> Any:
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return getattr(args, "deepspeed_config", None)


def _is_training(kwargs: dict, config: dict) -> bool:
    """Whether DeepSpeed would build an optimizer: one passed, or one in the config (DeepSpeed
    takes ``model.parameters()`` when ``model_parameters`` is None)."""
    return kwargs.get("optimizer") is not None or "optimizer" in config


def _without_section(args: Any, kwargs: dict, config: Any) -> Tuple[Any, dict]:
    """``(args, kwargs)`` for DeepSpeed's own ``initialize``: the config without the section, as
    ``config=`` only (DeepSpeed refuses a config in both ``args.deepspeed_config`` and the call)."""
    from ..config import load_ds_config

    kwargs = {k: v for k, v in kwargs.items() if k != "config_params"}
    kwargs["config"] = load_ds_config(config)[0]
    if getattr(args, "deepspeed_config", None) is not None:
        args = copy.copy(args)
        args.deepspeed_config = None
    return args, kwargs


def routed_initialize(original):
    """``deepspeed.initialize`` that sends a config with a ``"dynatrain"`` section to
    :func:`ds_dynatrain.initialize` (same arguments, same four return values); every other call
    goes to ``original`` unchanged.

    An engine without an optimizer (Trainer's evaluation-only path under ZeRO-3) is DeepSpeed's
    own, built on the config without the section, and a log line says so.

    Raises:
        ConfigError: a ``mesh_param`` (a TP/SP device mesh) with the section, or what
            :func:`ds_dynatrain.initialize` raises.
    """

    @functools.wraps(original)
    def initialize(args=None, model=None, *rest, **kwargs):
        if rest:  # positional beyond (args, model): DeepSpeed's own order
            names = ("optimizer", "model_parameters", "training_data", "lr_scheduler", "distributed_port", "mpu")
            kwargs.update(zip(names, rest))
        config = _config_of(args, kwargs)
        parsed = parsed_config(config)
        if parsed is None or parsed.get(SECTION) is None:
            return original(args=args, model=model, **kwargs)
        if not _is_training(kwargs, parsed):
            logger.info(
                "ds_dynatrain: an engine without an optimizer (no optimizer passed, none in the config: "
                f"evaluation) is DeepSpeed's own; the {SECTION!r} section applies to training engines"
            )
            args, kwargs = _without_section(args, kwargs, config)
            return original(args=args, model=model, **kwargs)
        if kwargs.pop("mesh_param", None) is not None:
            raise ConfigError(
                f"the {SECTION!r} section with a device mesh (mesh_param: tensor or sequence parallelism) "
                "is not supported; ds_dynatrain resizes data-parallel ZeRO jobs"
            )
        from ..engine.frontend import FrontendRestart, catching
        from ..initialize import initialize as dynatrain_initialize
        from .accelerate_loop import in_place_loop_for
        from .restart import engine_for, remember

        live = engine_for(model)
        if live is not None:  # a front-end's loop resumed after a resize: the same engine
            return live, live.optimizer, None, live.lr_scheduler
        caller = sys._getframe(1).f_globals.get("__name__", "")
        frontend = caller if caller.split(".")[0] in FRONTEND_PACKAGES else None
        in_place = in_place_loop_for(frontend, parsed[SECTION])  # a plain Accelerate loop under dynatrain launch
        out = dynatrain_initialize(args=args, model=model, frontend=frontend, in_place_loop=in_place, **kwargs)
        engine = out[0]
        remember(engine)
        if frontend is not None and catching() and engine.global_steps > 0:
            raise FrontendRestart(engine)  # a joiner (or a restored job): its loop starts at the job's step
        return out

    setattr(initialize, _ORIGINAL_ATTR, original)
    return initialize


def _guarded_init(original_init):
    @functools.wraps(original_init)
    def __init__(self, config, *args, **kwargs):
        original_init(self, config, *args, **kwargs)
        section = getattr(self, "_param_dict", {}).get(SECTION)
        enabled = not (isinstance(section, dict) and section.get("enabled") is False)
        if section is not None and enabled:
            raise ConfigError(
                f"the DeepSpeed config has a {SECTION!r} section but this engine is being built by DeepSpeed "
                "directly, so the plugin would not act on it: build it with ds_dynatrain.initialize, or "
                "deepspeed.initialize looked up after `import ds_dynatrain` (not bound by "
                f'`from deepspeed import initialize` earlier), or set "{SECTION}": {{"enabled": false}}'
            )

    __init__.__ds_dynatrain_guard__ = True
    return __init__


def install_route() -> None:
    """Rebind ``deepspeed.initialize`` and guard ``DeepSpeedConfig`` (idempotent)."""
    if not hasattr(deepspeed.initialize, _ORIGINAL_ATTR):
        deepspeed.initialize = routed_initialize(deepspeed.initialize)
    if not getattr(DeepSpeedConfig.__init__, "__ds_dynatrain_guard__", False):
        DeepSpeedConfig.__init__ = _guarded_init(DeepSpeedConfig.__init__)


def original_initialize():
    """DeepSpeed's own ``deepspeed.initialize`` (the one the route wraps)."""
    return getattr(deepspeed.initialize, _ORIGINAL_ATTR, deepspeed.initialize)
