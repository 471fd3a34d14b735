"""Snapshots and saved checkpoints: the asynchronous snapshot engine (a DeepSpeed
``CheckpointEngine``), the footer's VPS schema, saved checkpoints opened for reading, loading at
another world size or ZeRO stage, inspection, verification and consolidated export.
"""
