"""ds_dynatrain: online data-parallel resizing and resilience snapshots for DeepSpeed ZeRO.

Use :func:`initialize` where you would call ``deepspeed.initialize``; add a ``"dynatrain"``
section to the DeepSpeed config; start the job with ``dynatrain launch``.
"""
from .config import DynatrainConfig, load_ds_config
from .errors import (ConfigError, DynatrainError, LayoutMismatchError, NotAMemberError, ResizeRefusedError,
                     TransitionAbortedError)
from .initialize import initialize

__all__ = [
    "initialize", "DynatrainConfig", "load_ds_config", "DynatrainError", "ConfigError", "ResizeRefusedError",
    "LayoutMismatchError", "TransitionAbortedError", "NotAMemberError",
]
