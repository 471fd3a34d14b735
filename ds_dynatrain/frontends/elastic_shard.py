"""Accelerate's data-loader shard made to follow resizes: each micro-batch is cut from the epoch's
sample order at the moment it is asked for, for the world, rank and micro-batch of that moment.

Accelerate's ``DataLoaderShard`` over a ``BatchSamplerShard`` (``accelerate.data_loader``, the
shard of every map-style loader ``Accelerator.prepare`` returns under DeepSpeed) hands round ``k``
of an epoch's batches to the processes in turn: process ``r`` of ``W`` takes batch ``k*W + r`` of
the user's batch sampler. It fixes ``W`` and ``r`` when prepared and fetches one batch ahead, so
after a resize it would go on serving the old world's shard, and the batch it fetched before the
resize (inside the step) would be the old rank's.

:class:`ElasticLoaderShard` serves the same samples from the same order: the order is the user's
batch sampler's for the epoch (flattened; Accelerate's generator synchronisation and ``set_epoch``
first, as Accelerate does), and the ``j``-th micro-batch served at a position ``p`` of the epoch
takes samples ``[p + r*m, p + (r+1)*m)`` and moves ``p`` on by ``W*m`` -- ``W``, ``r`` and the
micro-batch ``m`` read from the engine each time, nothing fetched ahead. Resizes happen at step
boundaries, where ``p`` is a whole number of global batches on every rank whatever the worlds so
far, so no sample is served twice or skipped. With ``m`` equal to the loader's batch size this is
exactly Accelerate's static shard. A last round with fewer samples than ``W*m`` is filled from the
start of the order (Accelerate's ``even_batches``), or dropped when the batch sampler drops its
last incomplete batch.

Batches are fetched in the training process (``dataset[i]`` and the loader's ``collate_fn``): a
worker pool would fetch ahead, before a resize decides whose samples are next. (Imported only once
Accelerate is: by :mod:`.accelerate_loop`'s hooks.)
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

from accelerate.data_loader import BatchSamplerShard, DataLoaderShard
from accelerate.state import PartialState
from accelerate.utils import send_to_device, synchronize_rng_states
from torch.utils.data import BatchSampler

from ..config import ConfigError


def _shard_parts(loader) -> Tuple[object, int]:
    """The user's batch sampler inside Accelerate's shard of ``loader`` and its batch size.

    Raises:
        ConfigError: a loader Accelerate did not shard by batches (an iterable dataset, batches
            split or dispatched by the main process).
    """
    shard = getattr(loader, "batch_sampler", None)
    if isinstance(shard, BatchSampler) and not isinstance(shard, BatchSamplerShard):
        return shard, int(shard.batch_size)  # one process: Accelerate keeps the user's batch sampler
    if getattr(loader, "use_stateful_dataloader", False):
        raise ConfigError(
            "a data loader prepared with use_stateful_dataloader cannot follow a resize under `dynatrain "
            "launch` (its saved position would be the old world's)"
        )
    if not isinstance(shard, BatchSamplerShard) or shard.split_batches or shard.batch_size is None:
        raise ConfigError(
            f"a data loader prepared as {type(loader).__name__} over {type(shard).__name__} cannot follow a "
            "resize under `dynatrain launch`: ds_dynatrain re-shards map-style datasets that Accelerate "
            "shards by batches (no IterableDataset, split_batches and dispatch_batches off)"
        )
    return shard.batch_sampler, int(shard.batch_size)


def elastic_shard(loader, engine_of: Callable[[], Optional[object]]):
    """An :class:`ElasticLoaderShard` serving ``loader``'s samples (a ``DataLoaderShard`` that
    ``Accelerator.prepare_data_loader`` returned; its device placement, generator and epoch kept).

    Args:
        engine_of: the elastic engine prepared beside the loader, or None while there is none (the
            world is then Accelerate's and the micro-batch the loader's batch size).

    Raises:
        ConfigError: see :func:`_shard_parts`.
    """
    inner, batch_size = _shard_parts(loader)
    new = ElasticLoaderShard.__new__(ElasticLoaderShard)
    new.__dict__.update(loader.__dict__)
    new._dt_inner = inner
    new._dt_batch = batch_size
    new._dt_engine_of = engine_of
    new._dt_follows_engine = None  # decided at the first batch served beside an engine
    new.skip_batches = getattr(loader, "skip_batches", 0)
    return new


class ElasticLoaderShard(DataLoaderShard):
    """A ``DataLoaderShard`` whose shard follows the engine's world (module docstring).

    Every iteration is one epoch: ``begin``/``end`` of Accelerate's gradient state,
    ``end_of_dataloader`` set with the last micro-batch (``accumulate()`` then ends the
    step) and ``remainder`` (what ``gather_for_metrics`` drops) at the world of the start.
    ``len()`` and ``total_batch_size`` are the current world's.
    """

    def _view(self) -> Tuple[int, int, int]:
        """(world size, rank, micro-batch) of this moment."""
        engine = self._dt_engine_of()
        if engine is None or not engine.is_member:
            state = PartialState()
            return state.num_processes, state.process_index, self._dt_batch
        micro = engine.train_micro_batch_size_per_gpu()
        if self._dt_follows_engine is None:  # the training loader: its batches are the engine's micro-batches
            self._dt_follows_engine = self._dt_batch in (micro, engine._dt.micro_batch)
        return engine.dp_world_size, engine.global_rank, micro if self._dt_follows_engine else self._dt_batch

    def _order(self) -> List[int]:
        return [int(i) for batch in self._dt_inner for i in batch]

    def _samples(self) -> int:
        if getattr(self._dt_inner, "drop_last", False):
            return len(self._dt_inner) * self._dt_batch
        sampler = getattr(self._dt_inner, "sampler", None)
        return len(sampler) if sampler is not None else len(self.dataset)

    def __len__(self) -> int:
        world, _, micro = self._view()
        per_round = world * micro
        left = max(0, self._samples() - self.skip_batches * per_round)
        if getattr(self._dt_inner, "drop_last", False):
            return left // per_round
        return math.ceil(left / per_round)

    @property
    def total_batch_size(self) -> int:
        world, _, micro = self._view()
        return world * micro

    def __iter__(self):
        if self.rng_types is not None:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        self.set_epoch(self.iteration)
        order = self._order()
        n = len(order)
        drop_last = getattr(self._dt_inner, "drop_last", False)
        world, _, micro = self._view()
        pos = self.skip_batches * world * micro
        try:
            while pos < n and not self.end_of_dataloader:
                world, rank, micro = self._view()
                if drop_last and pos + world * micro > n:
                    break
                start = pos + rank * micro
                indices = [order[(start + k) % n] for k in range(micro)]
                pos += world * micro
                if pos >= n or (drop_last and pos + world * micro > n):
                    self.end_of_dataloader = True
                batch = self.collate_fn([self.dataset[i] for i in indices])
                if self.device is not None:
                    batch = send_to_device(batch, self.device, non_blocking=self._non_blocking)
                yield batch
            self.iteration += 1
        finally:
            self.end()

    def __reduce__(self):
        raise TypeError("an ElasticLoaderShard follows a live engine and cannot be pickled")
