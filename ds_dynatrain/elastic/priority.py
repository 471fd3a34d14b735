"""A joiner's CPU priority: it starts below the running workers of its host and returns to theirs
once its generation forms.

A joiner's start-up (importing torch and DeepSpeed, building the model) and its warm-up take
seconds of CPU while the survivors train; on a host whose CPUs the survivors already use, that
work slows their steps. The agent starts a joiner at a higher nice value
(``dynatrain.joiner_nice``): the kernel then gives it the CPU time the survivors leave idle first
(CFS weights, sched(7)). When its generation forms the joiner sets every one of its threads back
to the agent's own value (Linux keeps a nice value per thread, setpriority(2)). Lowering a nice
value needs CAP_SYS_NICE or a large enough RLIMIT_NICE: where the agent cannot, it starts joiners
unchanged rather than leave them slower than the rest of the job.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Dict, Optional

RENICE_ENV = "DYNATRAIN_RENICE"  # the nice value a joiner returns to when its generation forms


def can_lower_nice() -> bool:
    """Whether this process may lower a thread's nice value again (tried on a short-lived thread of
    its own: raised by one, then set back)."""
    if not sys.platform.startswith("linux"):
        return False
    ok = []

    def probe():
        tid = threading.get_native_id()
        base = os.getpriority(os.PRIO_PROCESS, tid)
        if base >= 19:
            return
        os.setpriority(os.PRIO_PROCESS, tid, base + 1)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, base)
            ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="dynatrain-nice-probe")
    t.start()
    t.join()
    return bool(ok)


def joiner_start_env(joiner_nice: int) -> Dict[str, str]:
    """What the agent adds to a joiner's environment: the nice value to return to
    (:data:`RENICE_ENV`), or nothing where it starts unchanged (``joiner_nice`` 0, or this process
    cannot lower a nice value again)."""
    if joiner_nice <= 0 or not can_lower_nice():
        return {}
    return {RENICE_ENV: str(os.getpriority(os.PRIO_PROCESS, 0))}


def return_to_job_priority(environ=os.environ) -> Optional[int]:
    """In a joiner whose generation forms: set every thread of this process back to the nice value
    in :data:`RENICE_ENV` (threads that end meanwhile are skipped). Returns the nice value it had,
    or None where it started unchanged.

    Raises:
        OSError: the kernel refused to lower the value (the agent checked it could).
    """
    if RENICE_ENV not in environ:
        return None
    base = int(environ[RENICE_ENV])
    was = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), base)
        except ProcessLookupError:
            pass
    return was
