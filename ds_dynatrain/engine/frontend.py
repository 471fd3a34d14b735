"""The signal a front-end's training loop gets after the world changed (see
:mod:`ds_dynatrain.frontends.restart`, which catches it), and whether a loop that catches it runs."""

import threading

_catching = threading.local()


def catching() -> bool:
    """Whether this thread runs inside a front-end loop that restarts on :class:`FrontendRestart`
    (Trainer's ``train``, wrapped by :mod:`ds_dynatrain.frontends.restart`)."""
    return getattr(_catching, "depth", 0) > 0


class Catching:
    """Context manager marking this thread's code as inside such a loop."""

    def __enter__(self):
        _catching.depth = getattr(_catching, "depth", 0) + 1

    def __exit__(self, *exc):
        _catching.depth -= 1
        return False


class FrontendRestart(BaseException):
    """Raised through a front-end's training loop (Trainer's) right after a resize, or after a
    joiner joined, before the loop issues another collective. A BaseException, so that no
    ``except Exception`` in between keeps it.

    Attributes:
        engine: the elastic engine (``is_member`` False in a process that left).
    """

    def __init__(self, engine):
        super().__init__(f"the world changed at step {engine.global_steps}: the training loop restarts")
        self.engine = engine
