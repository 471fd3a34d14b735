"""A background thread's own CPU priority (Linux nice value), below that of training.

The snapshot worker copies, checksums and flushes beside training on the same cores; at a higher
nice value the kernel's scheduler gives it the CPU time training leaves idle first (CFS weights,
sched(7)), and training keeps the rest.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Optional

log = logging.getLogger("ds_dynatrain.io")


def lower_thread_priority(increment: int) -> Optional[int]:
    """Add ``increment`` to the calling thread's nice value (capped at 19) and return the new one.

    Linux keeps a nice value per thread (setpriority(2), notes: under NPTL it is a per-thread
    attribute, not POSIX's per-process one): ``setpriority(PRIO_PROCESS, tid)`` with the thread's
    own id changes that thread alone, and threads it starts afterwards inherit it. Raising one's
    own nice value needs no privilege. Returns None, changing nothing, for ``increment`` 0 or where
    the platform has no per-thread value (or refuses): the thread then runs as the others do.
    """
    if not increment or not sys.platform.startswith("linux"):
        return None
    try:
        tid = threading.get_native_id()
        nice = min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return nice
    except OSError as err:
        log.debug("thread priority unchanged (%s)", err)
        return None
