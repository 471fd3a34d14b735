"""Accelerate's cached view of the world (process count and index, accumulation steps, the
DeepSpeed plugin's batch keys) set to an elastic engine's after a resize."""

from __future__ import annotations


def set_world(world_size: int, rank: int) -> None:
    """The process count and index ``PartialState`` and ``AcceleratorState`` report (their shared
    state, read by every ``Accelerator``, data loader and ``is_main_process`` check)."""
    from accelerate.state import AcceleratorState, PartialState

    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if "num_processes" in shared:
            shared["num_processes"], shared["process_index"] = world_size, rank


def set_accumulation(accelerator, engine) -> int:
    """``accelerator``'s accumulation steps (what ``accumulate()`` counts micro-batches against) and
    its DeepSpeed plugin's batch keys set to ``engine``'s at its current world size. Returns the
    accumulation steps."""
    gas = engine.gradient_accumulation_steps()
    accelerator.gradient_accumulation_steps = gas
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        cfg = plugin.deepspeed_config
        cfg["gradient_accumulation_steps"] = gas
        cfg["train_batch_size"] = engine.train_batch_size()
        cfg["train_micro_batch_size_per_gpu"] = engine.train_micro_batch_size_per_gpu()
    return gas
