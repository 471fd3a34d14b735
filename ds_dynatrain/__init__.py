"""ds_dynatrain: online data-parallel resizing and resilience snapshots for DeepSpeed ZeRO.

Use :func:`initialize` where you would call ``deepspeed.initialize``; add a ``"dynatrain"``
section to the DeepSpeed config; start the job with ``dynatrain launch``. Hugging Face Trainer and
Accelerate scripts need only ``import ds_dynatrain``: from then on ``deepspeed.initialize`` sends a
config with a ``"dynatrain"`` section here (:mod:`ds_dynatrain.frontends`). :func:`log_to_console`
prints the plugin's log lines (a library installs no handler of its own).
"""

from .config import DynatrainConfig, load_ds_config
from .errors import (
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointNotPartitionedError,
    ConfigError,
    DynatrainError,
    LayoutMismatchError,
    NotAMemberError,
    RecoveryNotPossibleError,
    ResizeRefusedError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    TransitionAbortedError,
)
from .frontends import install as _install_frontends
from .initialize import initialize
from .log import log_to_console
from .version import package_version

__version__ = package_version()
_install_frontends()  # deepspeed.initialize routed to ours; Trainer's checkpoint hooks (frontends)

__all__ = [
    "__version__",
    "initialize",
    "DynatrainConfig",
    "load_ds_config",
    "log_to_console",
    "DynatrainError",
    "ConfigError",
    "ResizeRefusedError",
    "LayoutMismatchError",
    "TransitionAbortedError",
    "NotAMemberError",
    "RecoveryNotPossibleError",
    "CheckpointCorruptError",
    "CheckpointNotPartitionedError",
    "CheckpointIncompleteError",
    "SnapshotNotFoundError",
    "SnapshotWriteError",
]
