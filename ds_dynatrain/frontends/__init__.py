"""The ways in from the front-ends DeepSpeed users train with: ``deepspeed.initialize`` routed to
ours (Accelerate, Trainer and Lightning call it by attribute), and Trainer's checkpoint choices
(resume from the last complete checkpoint, rotation that keeps the last durable one).

:func:`install` runs at ``import ds_dynatrain``; it is idempotent.
"""

from .route import install_route, original_initialize, section_of
from .trainer import install_trainer_hooks, last_complete_checkpoint


def install() -> None:
    """Route ``deepspeed.initialize`` and hook ``transformers.trainer`` (when it is imported)."""
    install_route()
    install_trainer_hooks()


__all__ = [
    "install",
    "install_route",
    "install_trainer_hooks",
    "last_complete_checkpoint",
    "original_initialize",
    "section_of",
]
