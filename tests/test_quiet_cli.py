"""``dynatrain resize`` against an address where something listens that is no job's store says so in
one line: torch's store client logs every failed attempt with a C++ stack trace ("frame #0: ...")
on the process's own stderr (file descriptor 2), which the command hides while it connects.

The command runs as its own process (what native code writes to fd 2 is only seen from outside).
The listener is real: a TCP socket that accepts each connection and closes it at once.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest
from conftest import ROOT, _env

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
        cmd + ["--world-size", "2", "--timeout", "5"], capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=100
    )
    assert p.returncode == 1, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"dynatrain resize: no dynatrain job answers at 127.0.0.1:{not_a_store}: ")
    assert p.stdout == ""
