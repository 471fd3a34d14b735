"""The ways in from the front-ends DeepSpeed users train with: ``deepspeed.initialize`` routed to
ours (Accelerate, Trainer and Lightning call it by attribute), and Trainer's checkpoint choices
(resume from the last complete checkpoint, rotation that keeps the last durable one), and
Accelerate's ``load_state`` at another world size (its micro-step counter realigned).

:func:`install` runs at ``import ds_dynatrain``; it is idempotent.
"""

from .accelerate import install_accelerate_hooks
from .route import install_route, original_initialize, section_of
from .trainer import install_trainer_hooks, last_complete_checkpoint


def install() -> None:
    """Route ``deepspeed.initialize``; hook ``transformers.trainer`` and ``accelerate.accelerator``
    (when each is imported)."""
    install_route()
    install_trainer_hooks()
    install_accelerate_hooks()


__all__ = [
    "install_accelerate_hooks",
    "install",
    "install_route",
    "install_trainer_hooks",
    "last_complete_checkpoint",
    "original_initialize",
    "section_of",
]
