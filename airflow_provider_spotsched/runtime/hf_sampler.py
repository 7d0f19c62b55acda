"""One global sample order, whatever the world size: what lets an elastic job resume exactly.

The Trainer's default sampler shuffles with the RNG state of the process, and a multi-process
Trainer shards batches across ranks, so the samples of step ``k`` depend on how many processes
ran it. :class:`GlobalOrderSampler` makes the order a function of ``(seed, epoch)`` alone: epoch
``e`` is a permutation drawn from a generator seeded with ``seed + e``, cut to a whole number of
global batches. accelerate hands rank ``r`` of ``w`` the per-device batches ``r, r + w, ...`` of
that stream, so optimizer step ``k`` consumes samples ``[k * B, (k + 1) * B)`` of it for any ``w``
that keeps the global batch ``B`` (per-device batch x accumulation x world size) fixed. The
Trainer resumes at step ``k`` by skipping ``k`` steps' batches of the same stream, so a resume at
another world size continues at the sample after the last checkpointed one, provided the sampler
is told the epoch of step ``k`` (:meth:`GlobalOrderSampler.epoch_of`; see ``hf_callback.SamplerEpoch``
for why the Trainer's own ``set_epoch`` is not enough).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class GlobalOrderSampler(Sampler[int]):
    """Epoch ``e``: ``randperm(length)`` seeded with ``seed + e``, cut to whole global batches."""

    def __init__(self, length: int, global_batch: int, seed: int) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if length < global_batch:
            raise ValueError(f"the training set has {length} samples, fewer than one global batch of {global_batch}: "
                             "lower per_device_train_batch_size or add data")
        self.length, self.global_batch, self.seed = length, global_batch, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the Trainer (through accelerate) before each epoch, also on a resume mid-epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        # The tail that does not fill a global batch is dropped: accelerate would otherwise pad the
        # last batch with samples that depend on the world size.
        return self.length - self.length % self.global_batch

    def epoch_of(self, global_step: int) -> int:
        """The epoch that optimizer step ``global_step + 1`` belongs to: every epoch has the same whole steps."""
        return global_step // (len(self) // self.global_batch)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch))

    def order(self, epoch: int) -> list[int]:
        """The global sample stream of ``epoch``."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.length, generator=generator)[: len(self)].tolist()
