"""The transition engine: executes a plan between processes and interprets nothing.

``schedule`` (XOR pairing, streams cut into messages: pure), ``execute`` (the exchanges over a
private gloo group, in the foreground or a background thread, with timeouts), ``buffers`` (the new
partitions a plan fills), ``boxes`` (a box plan's strided copies and messages), ``replicas`` (peer
replicas in host memory) and ``spread`` (the working parameters from the processes that stayed to
the joiners). No DeepSpeed.
"""

from .buffers import allocate_partitions
from .execute import PendingTransition, TransitionStats, execute_plan, start_plan, transition_group, transition_ranks

__all__ = [
    "execute_plan",
    "start_plan",
    "PendingTransition",
    "TransitionStats",
    "transition_group",
    "transition_ranks",
    "allocate_partitions",
]
