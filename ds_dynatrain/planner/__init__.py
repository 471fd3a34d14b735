"""The planner: where layouts meet (pure).

``plan`` (``Plan``: the intersection of two layouts into keeps and transfers; the scalars of the new
partitions), ``assignment`` (which process takes which new rank). No tensors, no process group.
"""

from .assignment import assign_members, assign_members_best, next_members, recent_members
from .plan import PLAN_FORMAT_VERSION, Plan, Transfer, plan_transition, scalars_for

__all__ = [
    "Plan",
    "Transfer",
    "plan_transition",
    "scalars_for",
    "PLAN_FORMAT_VERSION",
    "assign_members",
    "assign_members_best",
    "recent_members",
    "next_members",
]
