"""GlobalOrderSampler: optimizer step k takes the same samples at every world size (in-process, fast).

The ranks' shares are built the way a multi-process Trainer builds them: accelerate's
``BatchSamplerShard`` over a ``BatchSampler`` of the per-device batch size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.data_loader import BatchSamplerShard, DataLoaderShard, skip_first_batches
from torch.utils.data import BatchSampler
from transformers import TrainerControl, TrainerState, TrainingArguments

from airflow_provider_spotsched.runtime.hf_callback import SamplerEpoch
from airflow_provider_spotsched.runtime.hf_sampler import GlobalOrderSampler

LENGTH, GLOBAL_BATCH, SEED = 103, 8, 7


def steps(world_size: int, epoch: int) -> list[list[int]]:
    """Each optimizer step's samples (ranks' micro-batches concatenated in rank order) at ``world_size``."""
    sampler = GlobalOrderSampler(LENGTH, GLOBAL_BATCH, SEED)
    sampler.set_epoch(epoch)
    per_device = GLOBAL_BATCH // world_size
    shares = [list(BatchSamplerShard(BatchSampler(sampler, per_device, drop_last=False), world_size, rank))
              for rank in range(world_size)]
    assert len({len(share) for share in shares}) == 1  # every rank takes part in every step
    return [[index for share in shares for index in share[step]] for step in range(len(shares[0]))]


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_world_size_takes_the_same_samples_at_every_step(world_size: int) -> None:
    for epoch in (0, 1):
        assert steps(world_size, epoch) == steps(1, epoch)


def test_the_stream_is_whole_global_batches_of_a_permutation_that_changes_per_epoch() -> None:
    sampler = GlobalOrderSampler(LENGTH, GLOBAL_BATCH, SEED)
    first, second = sampler.order(0), sampler.order(1)
    assert len(sampler) == len(first) == LENGTH // GLOBAL_BATCH * GLOBAL_BATCH
    assert len(set(first)) == len(first) and set(first) <= set(range(LENGTH))
    assert first != second
    assert first == GlobalOrderSampler(LENGTH, GLOBAL_BATCH, SEED).order(0)  # a function of (seed, epoch) alone
    assert first != GlobalOrderSampler(LENGTH, GLOBAL_BATCH, SEED + 1).order(0)


def test_a_resume_continues_at_the_sample_after_the_last_checkpointed_one() -> None:
    """The Trainer resumes at step k by skipping k steps' batches; at another world size that is the same place."""
    checkpointed = 5
    before = [index for step in steps(2, 0)[:checkpointed] for index in step]
    after = [index for step in steps(1, 0)[checkpointed:] for index in step]
    assert before + after == GlobalOrderSampler(LENGTH, GLOBAL_BATCH, SEED).order(0)


def test_bad_sizes_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalOrderSampler(4, GLOBAL_BATCH, SEED)
    with pytest.raises(ValueError, match="global_batch must be >= 1"):
        GlobalOrderSampler(LENGTH, 0, SEED)


def test_a_multi_process_resume_after_the_first_epoch_takes_that_epochs_samples(tmp_path: Path) -> None:
    """What the Trainer does on a resume at world size 2, step 3 of epoch 1: skip, set the epoch, iterate.

    accelerate's ``set_epoch`` does not reach the sampler through ``SkipBatchSampler(BatchSamplerShard)``
    (the first assertion documents it); :class:`SamplerEpoch`, at the epoch's start, does.
    """
    world_size, rank, skipped = 2, 0, 3
    sampler = GlobalOrderSampler(LENGTH, GLOBAL_BATCH, SEED)
    shard = BatchSamplerShard(BatchSampler(sampler, GLOBAL_BATCH // world_size, drop_last=False), world_size, rank)
    resumed = skip_first_batches(DataLoaderShard(range(LENGTH), batch_sampler=shard), skipped)
    resumed.set_epoch(1)
    assert sampler.epoch == 0  # the library's own path misses it
    expected = steps(world_size, 1)[skipped][: GLOBAL_BATCH // world_size]  # rank 0's half of step 3 of epoch 1

    state = TrainerState(global_step=len(sampler) // GLOBAL_BATCH + skipped)
    SamplerEpoch(sampler).on_epoch_begin(TrainingArguments(output_dir=str(tmp_path), use_cpu=True), state, TrainerControl())
    assert sampler.epoch == 1
    assert next(iter(resumed)).tolist() == expected


def test_the_epoch_of_a_step_counts_whole_epochs_of_global_batches() -> None:
    sampler = GlobalOrderSampler(LENGTH, GLOBAL_BATCH, SEED)  # 103 samples of global batch 8: 12 steps an epoch
    assert [sampler.epoch_of(step) for step in (0, 11, 12, 23, 24, 100)] == [0, 0, 1, 1, 2, 8]
