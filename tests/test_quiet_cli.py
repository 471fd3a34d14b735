"""``dynatrain resize`` against an address where something listens that is no job's store, or against
a job's store that goes away while the request waits for its answer, says so in one line: torch's
store client logs each failure with a C++ stack trace ("frame #0: ...") on the process's own stderr
(file descriptor 2), which the command hides while it connects and while it waits.

The command runs as its own process (what native code writes to fd 2 is only seen from outside).
The listeners are real: a TCP socket that accepts each connection and closes it at once, and a
``TCPStore`` served by a child process that the test kills (SIGKILL) once the request is queued.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from conftest import ROOT, _env, free_port

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def not_a_store():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(5)
    srv.close()


@pytest.mark.timeout(120)
def test_resize_to_something_that_is_not_a_store_says_one_line(not_a_store):
    cmd = [sys.executable, "-m", "ds_dynatrain.cli", "resize", "--store", f"127.0.0.1:{not_a_store}"]
    p = subprocess.run(
        cmd + ["--world-size", "2", "--timeout", "1"], capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=100
    )
    assert p.returncode == 1, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"dynatrain resize: no dynatrain job answers at 127.0.0.1:{not_a_store}: ")
    assert p.stdout == ""


STORE_SERVER = """
import json, sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, timeout=timedelta(seconds=60))
store.set(sys.argv[2], sys.argv[3])
print("ready", flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(120)
def test_resize_whose_store_goes_away_while_it_waits_says_one_line():
    from torch.distributed import TCPStore

    from ds_dynatrain.elastic.keys import JOB_KEY, REQUEST_KEY

    port = free_port()
    job = json.dumps({"global_batch": 4, "micro_batch": 1, "max_world_size": None, "world_size": 2})
    server = subprocess.Popen(
        [sys.executable, "-c", STORE_SERVER, str(port), JOB_KEY, job],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    cli = None
    try:
        assert server.stdout.readline().strip() == "ready"
        cmd = [sys.executable, "-m", "ds_dynatrain.cli", "resize", "--store", f"127.0.0.1:{port}"]
        cli = subprocess.Popen(
            cmd + ["--world-size", "1", "--timeout", "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=_env(),
            start_new_session=True,
        )
        watcher = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        watcher.wait([REQUEST_KEY.format(0)])  # queued: the command now waits for the answer
        time.sleep(0.5)
        os.killpg(server.pid, signal.SIGKILL)
        out, err = cli.communicate(timeout=90)
    finally:
        for p in (server, cli):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert cli.returncode == 1, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"dynatrain resize: the job's store at 127.0.0.1:{port} went away after "), lines
    assert "before request 0 (world size 1) was answered" in lines[0] and out == ""
