"""The package's logger, and the console handler an application may attach to it.

Library code only logs (``logger.info``); it installs no handler. The ``dynatrain`` command line,
the examples and the test workers call :func:`log_to_console`; a training script of its own may do
the same, or configure :mod:`logging` as it likes (the logger is ``"ds_dynatrain"``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import IO, Optional

logger = logging.getLogger("ds_dynatrain")
CONSOLE_FORMAT = "[dynatrain] %(message)s"


class _CurrentStdout(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stdout`` is at the time of each record (a
    test harness or a notebook may replace it after the handler was made)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value):
        pass


def log_to_console(stream: Optional[IO[str]] = None, level: int = logging.INFO) -> logging.Handler:
    """Print the plugin's records (``[dynatrain] ...`` lines) on ``stream`` (default stdout).

    Idempotent: a second call returns the handler of the first. The records then stop at this
    handler (``propagate`` off), so a root handler configured by the application does not print
    them twice.
    """
    for h in logger.handlers:
        if getattr(h, "_dynatrain_console", False):
            return h
    h = logging.StreamHandler(stream) if stream is not None else _CurrentStdout()
    h.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    h._dynatrain_console = True  # type: ignore[attr-defined]
    logger.addHandler(h)
    logger.setLevel(level)
    logger.propagate = False
    return h


@contextlib.contextmanager
def native_stderr_hidden():
    """Discard what native code writes to file descriptor 2 while the block runs.

    torch's C++ store client logs each failed connection attempt with a C++ stack trace (dozens
    of lines) before it raises; the command line (``dynatrain resize``, an agent joining a job)
    says in one line what failed instead. For a command-line process between its threads' work
    only: every thread's writes to fd 2 are discarded meanwhile (Python's ``sys.stderr`` is
    flushed first, so nothing written before is lost)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no fd 2 (an embedding application)
        yield
        return
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def plural(n: int, word: str, many: Optional[str] = None) -> str:
    """``"1 rank"``, ``"2 ranks"``: ``n`` and ``word``, in the plural (``many``, default ``word + "s"``)
    unless ``n`` is 1."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
