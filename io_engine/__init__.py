"""Moving bytes between memory and storage, and the commit protocol.

Knows nothing of training, ranks or DeepSpeed. Modules, one concept each:

* ``format``     — the per-rank snapshot file format and its pure layout planner
* ``host_cache`` — the bounded pool of page-aligned host buffers
* ``ioqueue``    — io_uring and thread-pool operation queues
* ``backend``    — queue / O_DIRECT choice with logged fallbacks; per-file operation channel
* ``flusher``    — writing (buffer, offset) extents into a file
* ``validate``   — reading a file's header, trailer and footer back, every value checked
* ``reader``     — reading byte ranges and verified items back
* ``writer``     — the write/read facade for one snapshot file
* ``commit``     — crash-consistent publication of a snapshot directory
* ``storage_check`` — a snapshot directory checked before anything is written there
* ``errors``     — the error family
"""

from .backend import IOBackend, IOConfig
from .commit import (
    LATEST,
    TMP_PREFIX,
    check_tag,
    fsync_dir,
    fsync_file,
    prune_snapshots,
    publish_dir,
    read_latest,
    remove_stale,
    write_atomic,
)
from .errors import (
    BackendUnavailableError,
    BadLatestError,
    BadMagicError,
    ChecksumMismatchError,
    CorruptFooterError,
    CorruptHeaderError,
    FileSizeMismatchError,
    HostCacheError,
    HostCacheTimeoutError,
    InvalidItemError,
    IOEngineError,
    IOTimeoutError,
    ShortWriteError,
    SnapshotFormatError,
    StorageError,
    StorageReadError,
    StorageWriteError,
    TruncatedFileError,
    UnsupportedVersionError,
)
from .flusher import Flusher, WriteReport, WriteSession
from .format import DEFAULT_ALIGNMENT, FORMAT_VERSION, FileLayout, ItemMeta, ItemSpec, plan_layout
from .host_cache import HostBuffer, HostCache
from .reader import FileReader, read_ranges
from .storage_check import DirCheck, check_snapshot_dir
from .validate import read_footer
from .writer import SnapshotFileWriter, WriteItem, WriteResult, read_snapshot_file, write_snapshot_file

__all__ = [
    "LATEST",
    "TMP_PREFIX",
    "fsync_dir",
    "fsync_file",
    "prune_snapshots",
    "publish_dir",
    "read_latest",
    "remove_stale",
    "check_tag",
    "write_atomic",
    "IOBackend",
    "IOConfig",
    "BackendUnavailableError",
    "BadLatestError",
    "BadMagicError",
    "ChecksumMismatchError",
    "CorruptFooterError",
    "CorruptHeaderError",
    "FileSizeMismatchError",
    "HostCacheError",
    "HostCacheTimeoutError",
    "InvalidItemError",
    "IOEngineError",
    "IOTimeoutError",
    "ShortWriteError",
    "SnapshotFormatError",
    "StorageError",
    "StorageReadError",
    "StorageWriteError",
    "TruncatedFileError",
    "UnsupportedVersionError",
    "Flusher",
    "WriteReport",
    "WriteSession",
    "DEFAULT_ALIGNMENT",
    "FORMAT_VERSION",
    "FileLayout",
    "ItemMeta",
    "ItemSpec",
    "plan_layout",
    "read_footer",
    "HostBuffer",
    "HostCache",
    "FileReader",
    "read_ranges",
    "DirCheck",
    "check_snapshot_dir",
    "SnapshotFileWriter",
    "WriteItem",
    "WriteResult",
    "read_snapshot_file",
    "write_snapshot_file",
]
