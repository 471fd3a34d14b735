"""A data loader whose position survives resizes without the training script's help.

The sample order is a function of the seed and the epoch alone (a ``torch.randperm`` per epoch);
optimizer step ``s`` of an epoch consumes samples ``[s * G, (s + 1) * G)`` of that order, where
``G`` is the global batch. Within a step, micro-batch ``j`` of rank ``r`` (world size ``W``,
micro-batch ``m``) takes positions ``[j*W*m + r*m, j*W*m + (r+1)*m)`` of the step's samples. The
loader reads the engine's step counter, rank, world size and micro-batch each time it is asked
for a batch, so after a resize (which happens at a step boundary) it continues exactly where the
job stands: no sample is seen twice or skipped, whatever the world sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, Tuple

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate


def tokens_per_sample(batch) -> Optional[int]:
    """Tokens of one sample of ``batch``: the second dimension of an integer tensor of at least two
    dimensions (``[samples, tokens]``), or of the ``input_ids`` of a mapping; None otherwise (the
    records then carry no tokens/s)."""
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids")
    if isinstance(batch, torch.Tensor) and batch.dim() >= 2 and not batch.is_floating_point():
        return int(batch.shape[1])
    return None


def data_parallel_position(engine) -> Tuple[int, int]:
    """``(DP rank, DP size)`` of this process: in a pipeline job its stage's DP group (every stage
    of a DP rank alike), in an AutoTP job every TP rank of a DP rank alike."""
    dt = getattr(engine, "_dt", None)
    if dt is not None and dt.pp_layout is not None:
        return engine.grid.get_data_parallel_id(), engine.grid.get_data_parallel_world_size()
    tp = getattr(dt, "tp", 1)
    return engine.global_rank // tp, engine.dp_world_size


class ElasticDataLoader:
    """Iterates this rank's micro-batches of the current epoch.

    Args:
        dataset: a map-style dataset (``__len__``, ``__getitem__``).
        engine: the :class:`~ds_dynatrain.engine.elastic_engine.ElasticEngine` or
            :class:`~ds_dynatrain.engine.pp_engine.ElasticPipelineEngine` (its step counter is the
            position).
        global_batch: samples per optimizer step (``train_batch_size``).
        seed: seed of the sample order.
        shuffle: False keeps dataset order.
        collate_fn: merges samples into a batch (``default_collate`` by default).

    ``iter(loader)`` yields micro-batches until the epoch's last full global batch is consumed or
    this process leaves the job at a resize; then iteration stops. Samples beyond the last full
    global batch of an epoch are dropped (``drop_last``).
    """

    def __init__(
        self,
        dataset: Dataset,
        engine,
        global_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Optional[Callable[[list], Any]] = None,
    ):
        if len(dataset) < global_batch:
            raise ValueError(f"dataset of {len(dataset)} samples is smaller than one global batch ({global_batch})")
        self.dataset = dataset
        self.engine = engine
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.collate_fn = collate_fn or default_collate
        self._order_epoch = -1
        self._order = None
        self._step = -1
        self._micro = 0
        self._generation = 0

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch

    def _order_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(len(self.dataset), generator=g)
            else:
                self._order = torch.arange(len(self.dataset))
            self._order_epoch = epoch
        return self._order

    def indices_for(self, step: int, micro: int, rank: int, world_size: int, micro_batch: int) -> torch.Tensor:
        """Dataset indices of micro-batch ``micro`` of ``rank`` at global step ``step``."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        start = in_epoch * self.global_batch + micro * world_size * micro_batch + rank * micro_batch
        return self._order_of(epoch)[start : start + micro_batch]

    def __len__(self) -> int:
        """Micro-batches this rank takes per epoch at the current world size."""
        return self.steps_per_epoch * self.engine.gradient_accumulation_steps()

    def __iter__(self):
        engine = self.engine
        epoch = engine.global_steps // self.steps_per_epoch
        while engine.is_member and engine.global_steps // self.steps_per_epoch == epoch:
            step, generation = engine.global_steps, getattr(engine, "generation", 0)
            if step != self._step or generation != self._generation:
                # a new step, or a new world (an in-place recovery may go back to a step begun)
                self._step, self._micro, self._generation = step, 0, generation
            accum = engine.gradient_accumulation_steps()
            if self._micro >= accum:
                raise RuntimeError(
                    f"the training loop asked for micro-batch {self._micro + 1} of step {step}, "
                    f"which has {accum}; call engine.step() after every backward()"
                )
            dp_rank, dp_size = data_parallel_position(engine)
            idx = self.indices_for(step, self._micro, dp_rank, dp_size, engine.train_micro_batch_size_per_gpu())
            self._micro += 1
            batch = self.collate_fn([self.dataset[int(i)] for i in idx])
            dt = getattr(engine, "_dt", None)
            if dt is not None and dt.tokens_per_sample is None:
                dt.tokens_per_sample = tokens_per_sample(batch)  # the step records' tokens/s
            yield batch
