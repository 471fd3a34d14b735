"""Moving bytes between memory and storage, and the commit protocol.

Knows nothing of training, ranks or DeepSpeed.
"""
from .commit import LATEST, TMP_PREFIX, fsync_dir, fsync_file, prune_snapshots, publish_dir, read_latest, write_atomic

__all__ = ["LATEST", "TMP_PREFIX", "fsync_dir", "fsync_file", "prune_snapshots", "publish_dir", "read_latest", "write_atomic"]
