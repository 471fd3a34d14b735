"""A call run in a daemon thread while training goes on (a transfer, a transition group's build),
its result or its error kept for the thread that later waits for it."""

from __future__ import annotations

import threading
from typing import Callable, Optional

from ..errors import TransitionAbortedError, without_frames
from ..log import logger


class BackgroundCall:
    """``call()`` in a daemon thread named ``name``. Its return value, passed through ``keep``
    where given (run in that thread; e.g. to shut down a group nobody will take), is kept for
    :meth:`result`; so is an error it raises, without its frames: they would keep the call's
    objects alive (a transfer's group with an unfinished receive spins one of gloo's threads for as
    long as it lives; a build's store client holds its connection)."""

    def __init__(self, call: Callable[[], object], name: str, keep: Optional[Callable[[object], object]] = None):
        self._value: object = None
        self._error: Optional[BaseException] = None
        self._done = threading.Event()

        def run():
            try:
                value = call()
                self._value = value if keep is None else keep(value)
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
                logger.debug(f"{name} failed", exc_info=True)  # formatted only if logged
                self._error = without_frames(err)
            finally:
                self._done.set()

        threading.Thread(target=run, name=name, daemon=True).start()

    def done(self) -> bool:
        """Whether the call has returned or raised."""
        return self._done.is_set()

    @property
    def error(self) -> Optional[BaseException]:
        """The call's error, once it raised one; else None."""
        return self._error

    def result(self, timeout_s: Optional[float], late: Callable[[], str], failed: str) -> object:
        """Wait for the call (``timeout_s`` seconds; None: for ever) and return its kept value.

        Raises:
            TransitionAbortedError: the call did not end in time (message ``late()``), or it
                raised: a :class:`TransitionAbortedError` again with its message, any other error
                as ``"<failed>: <error>"``; the call's error is the cause.
        """
        if not self._done.wait(timeout_s):
            raise TransitionAbortedError(late())
        err = self._error
        if err is None:
            return self._value
        if isinstance(err, TransitionAbortedError):
            raise TransitionAbortedError(str(err)) from err
        raise TransitionAbortedError(f"{failed}: {err}") from err
