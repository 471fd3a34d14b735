"""The package's logger, and the console handler an application may attach to it.

Library code only logs (``logger.info``); it installs no handler. The ``dynatrain`` command line,
the examples and the test workers call :func:`log_to_console`; a training script of its own may do
the same, or configure :mod:`logging` as it likes (the logger is ``"ds_dynatrain"``).
"""

from __future__ import annotations

import logging
import sys
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
