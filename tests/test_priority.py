"""A joiner's CPU priority (ds_dynatrain/elastic/priority.py): a real child process started as the
agent starts a joiner (raised nice value between fork and exec), with a thread of its own, returns
every thread to the agent's value; where the agent may not lower a nice value it starts the
joiner unchanged."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from conftest import ROOT

from ds_dynatrain.elastic.agent import _before_exec
from ds_dynatrain.elastic.priority import RENICE_ENV, can_lower_nice, joiner_start_env

CHILD = """
import json, os, threading, time
from ds_dynatrain.elastic.priority import return_to_job_priority
nice = lambda tid: os.getpriority(os.PRIO_PROCESS, tid)
ready, done = threading.Event(), threading.Event()
box = {}
def worker():
    box["tid"] = threading.get_native_id()
    ready.set()
    done.wait(10)
t = threading.Thread(target=worker)
t.start()
ready.wait(10)
main = threading.get_native_id()
before = [nice(main), nice(box["tid"])]
was = return_to_job_priority()
after = [nice(main), nice(box["tid"])]
done.set()
t.join()
print(json.dumps({"before": before, "was": was, "after": after}))
"""


def _run_joiner(extra: int) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, **joiner_start_env(extra))
    nice = extra if RENICE_ENV in env else 0
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        preexec_fn=functools.partial(_before_exec, nice),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_joiner_started_lower_returns_every_thread_to_the_agents_value():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    got = _run_joiner(7)
    if can_lower_nice():
        assert got == {"before": [base + 7, base + 7], "was": base + 7, "after": [base, base]}
    else:  # the agent cannot lower it again: the joiner starts unchanged
        assert got == {"before": [base, base], "was": None, "after": [base, base]}


def test_no_lower_start_when_switched_off():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert joiner_start_env(0) == {}
    assert _run_joiner(0) == {"before": [base, base], "was": None, "after": [base, base]}


def test_the_env_names_the_agents_own_value():
    env = joiner_start_env(5)
    assert env == ({RENICE_ENV: str(os.getpriority(os.PRIO_PROCESS, 0))} if can_lower_nice() else {})
