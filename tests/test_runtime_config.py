"""The runtime's small parts: config validation, the data position, Young/Daly and the divergence guard."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from airflow_provider_spotsched.runtime.config import (
    CheckpointSettings,
    ConfigError,
    GuardSettings,
    TrainConfig,
    check_resumable,
)
from airflow_provider_spotsched.runtime.data import SampleStream, dataset_path, rank_share
from airflow_provider_spotsched.runtime.guard import DivergenceError, bad_loss_reason, check_rollback_allowed
from airflow_provider_spotsched.runtime.interval import CheckpointInterval, young_daly_interval
from airflow_provider_spotsched.runtime.train import lr_factor


def test_a_minimal_config_takes_the_defaults():
    config = TrainConfig.from_dict({"samples": 1000})
    assert config.runtime == "hf" and config.model == "builtin:tiny-gpt2" and config.dataset == "builtin:sft"
    assert config.lora.r == 8 and config.checkpoint.keep == 3 and config.guard.max_rollbacks == 3
    assert TrainConfig.from_dict({"steps": 10, "batch_size": 4}).samples == 40


@pytest.mark.parametrize("raw, message", [
    ({}, "give exactly one of samples"),
    ({"samples": 10, "steps": 2}, "give exactly one of samples"),
    ({"samples": 0}, "samples must be >= 1, got 0"),
    ({"samples": 2.5}, "samples must be an integer, got 2.5"),
    ({"samples": 10, "lr": "fast"}, "lr must be a number, got 'fast'"),
    ({"samples": 10, "lr": 0}, "lr must be > 0.0"),
    ({"samples": 10, "seq_len": True}, "seq_len must be an integer, got True"),
    ({"samples": 10, "batch_size": 4, "micro_batch_size": 8}, "micro_batch_size (8) must not exceed batch_size (4)"),
    ({"samples": 10, "lora": {"r": 0}}, "lora.r must be >= 1"),
    ({"samples": 10, "lora": {"target_modules": "c_attn"}}, "lora.target_modules must be a non-empty list"),
    ({"samples": 10, "lora": {"rank": 4}}, "unknown field(s) ['rank'] in lora"),
    ({"samples": 10, "checkpoint": {"min_interval_s": 60, "max_interval_s": 30}},
     "must not exceed checkpoint.max_interval_s"),
    ({"samples": 10, "checkpoint": {"mtbp_hours": 0}}, "checkpoint.mtbp_hours must be > 0.0"),
    ({"samples": 10, "checkpoint": []}, "checkpoint must be a JSON object"),
    ({"samples": 10, "guard": {"lr_backoff": 2}}, "guard.lr_backoff must be in (0, 1]"),
    ({"samples": 10, "fault_injection": {"nan_loss_at_steps": [0]}},
     "nan_loss_at_steps must be a list of step numbers >= 1"),
    ({"samples": 10, "epochs": 3}, "unknown field(s) ['epochs'] in the config"),
    ({"samples": 10, "model": ""}, "model must be a non-empty string"),
])
def test_bad_configs_are_refused_naming_the_field(raw, message):
    with pytest.raises(ConfigError) as error:
        TrainConfig.from_dict(raw)
    assert message in str(error.value)


def test_config_files_that_are_missing_or_not_json_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        TrainConfig.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{samples: 3}")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        TrainConfig.from_file(tmp_path / "bad.json")


def test_unknown_datasets_and_one_shorter_than_a_sample_are_config_errors_naming_the_fix():
    with pytest.raises(ConfigError, match="is not a builtin dataset of runtime 'loop'; builtin: "):
        dataset_path("builtin:wikipedia")
    with pytest.raises(ConfigError, match="neither a builtin dataset nor an existing text file: give the path of a UTF-8"):
        dataset_path("/nonexistent/corpus.txt")
    with pytest.raises(ConfigError, match="dataset 'tiny.txt' has 10 tokens, fewer than one sample of seq_len=64: "
                                          "give seq_len <= 10 or a longer dataset"):
        SampleStream(np.arange(10), 64, 0, "tiny.txt")


def test_a_resume_is_judged_on_every_data_shaping_field_the_checkpoint_recorded():
    shape = TrainConfig.from_dict({"samples": 8, "eval_fraction": 0.1, "lora": {"target_modules": ["c_attn"]}}).resume_shape()
    assert set(shape) == {"model", "dataset", "seq_len", "seed", "eval_fraction", "chat_template", "lora.r",
                          "lora.target_modules"}
    check_resumable(shape, shape, "checkpoint-4")
    check_resumable(json.loads(json.dumps(shape)), shape, "checkpoint-4")  # as the hf manifest reads it back
    check_resumable({"model": shape["model"]}, {**shape, "seq_len": 128}, "checkpoint-4")  # recorded before seq_len was
    for name, other in [("dataset", "other.jsonl"), ("seed", 7), ("eval_fraction", 0.2), ("model", "gpt2")]:
        with pytest.raises(ConfigError, match=f"checkpoint-4 was made with {name}=.*this config has {name}=.*Restore {name}="):
            check_resumable(shape, {**shape, name: other}, "checkpoint-4")


def test_a_resume_is_judged_on_the_lora_layers_the_checkpoint_has_and_not_on_alpha_or_dropout():
    shape = TrainConfig.from_dict({"samples": 8}).resume_shape()
    for lora in ({"alpha": 32.0}, {"dropout": 0.1}):
        check_resumable(shape, TrainConfig.from_dict({"samples": 8, "lora": lora}).resume_shape(), "checkpoint-4")
    for lora, name, values in [({"r": 4}, "lora.r", "8.*4"), ({"target_modules": ["c_attn"]}, "lora.target_modules",
                                                             r"None.*\['c_attn'\]")]:
        with pytest.raises(ConfigError, match=f"checkpoint-4 was made with {name}={values}: its adapter's LoRA layers "
                                              f"do not fit this config's. Restore {name}="):
            check_resumable(shape, TrainConfig.from_dict({"samples": 8, "lora": lora}).resume_shape(), "checkpoint-4")

def test_rank_shares_cover_a_global_batch_exactly_once():
    for count in (0, 1, 7, 8, 9):
        for world in (1, 2, 3):
            shares = [rank_share(100, count, rank, world) for rank in range(world)]
            covered = [g for first, size in shares for g in range(first, first + size)]
            assert covered == list(range(100, 100 + count))


def test_the_sample_stream_is_a_function_of_the_global_position():
    stream = SampleStream(np.arange(1000), seq_len=10, seed=5, dataset="corpus.txt")
    assert len(stream) == 100
    whole = stream.batch(95, 10)  # crosses into the second epoch
    first, size = rank_share(95, 10, 1, 2)
    assert torch.equal(stream.batch(first, size), whole[5:])
    assert torch.equal(SampleStream(np.arange(1000), 10, 5, "corpus.txt").batch(95, 10), whole)
    epoch0 = sorted(int(row[0]) for row in stream.batch(0, 100))
    assert epoch0 == list(range(0, 1000, 10))  # an epoch is a permutation of every chunk
    assert not torch.equal(stream.batch(0, 100), stream.batch(100, 100))  # reshuffled per epoch


def test_the_learning_rate_warms_up_then_decays_to_zero_by_position():
    assert lr_factor(0, 1000, 0.1) == pytest.approx(1 / 100)
    assert lr_factor(99, 1000, 0.1) == 1.0
    assert lr_factor(100, 1000, 0.1) == 1.0
    assert lr_factor(550, 1000, 0.1) == pytest.approx(0.5)
    assert lr_factor(1000, 1000, 0.1) == 0.0
    assert lr_factor(0, 1000, 0.0) == 1.0


def test_young_daly_interval_follows_the_preemption_rate_within_bounds():
    assert young_daly_interval(2.0, 3600.0) == pytest.approx(120.0)
    interval = CheckpointInterval(CheckpointSettings(min_interval_s=10, max_interval_s=600, mtbp_hours=1.0))
    interval.record_cost(2.0)
    assert interval.seconds == pytest.approx(120.0)
    interval.record_cost(12.0)  # moving average: 2 + 0.3 * (12 - 2) = 5
    assert interval.cost_s == pytest.approx(5.0) and interval.seconds == pytest.approx(math.sqrt(2 * 5 * 3600))
    assert not interval.due(100) and interval.due(200)
    rare = CheckpointInterval(CheckpointSettings(max_interval_s=600, cost_s=30, mtbp_hours=24))
    assert rare.seconds == 600  # sqrt(2 * 30 * 86400) = 2277 s, capped
    frequent = CheckpointInterval(CheckpointSettings(min_interval_s=10, cost_s=0.01, mtbp_hours=0.01))
    assert frequent.seconds == 10  # sqrt(2 * 0.01 * 36) = 0.85 s, raised to the floor
    assert CheckpointInterval(CheckpointSettings(max_interval_s=300)).seconds == 300  # no forecast


def test_the_guard_refuses_non_finite_and_exploding_losses_only():
    settings = GuardSettings(explode_factor=4.0, window=10)
    assert bad_loss_reason(float("nan"), [], settings) == "loss is nan"
    assert bad_loss_reason(float("inf"), [2.0] * 10, settings) == "loss is inf"
    assert bad_loss_reason(50.0, [2.0] * 4, settings) is None  # too little history to judge
    assert "exceeds 4.0 x the recent median 2" in bad_loss_reason(9.0, [2.0] * 5, settings)
    assert bad_loss_reason(7.9, [2.0] * 10, settings) is None
    check_rollback_allowed(2, "loss is nan", GuardSettings(max_rollbacks=3))
    with pytest.raises(DivergenceError, match=r"training diverged \(loss is nan\) after 3 rollback"):
        check_rollback_allowed(3, "loss is nan", GuardSettings(max_rollbacks=3))


def test_max_step_seconds_splits_a_step_into_chunks_between_stop_checks(tmp_path):
    from airflow_provider_spotsched.runtime.distributed import Workers
    from airflow_provider_spotsched.runtime.preemption import StopFlag
    from airflow_provider_spotsched.runtime.train import Trainer

    def trainer(**raw) -> Trainer:
        return Trainer(TrainConfig.from_dict({"runtime": "loop", "samples": 100, **raw}), str(tmp_path),
                       Workers(0, 1, torch.device("cpu"), 0.0), StopFlag())

    assert trainer(batch_size=8)._chunks_wanted(8) == 1
    assert trainer(batch_size=8, micro_batch_size=3)._chunks_wanted(8) == 3
    assert trainer(global_batch_size=32, batch_size=8)._chunks_wanted(32) == 4  # one worker: 4 micro-batches
    bounded = trainer(batch_size=8, max_step_seconds=2.0)
    assert bounded._chunks_wanted(8) == 1  # nothing measured yet
    bounded.seconds_per_sample = 0.5  # a whole step would take 4 s: chunks of 4 samples, 2 s each
    assert bounded._chunks_wanted(8) == 2


def test_sigterm_abandons_the_step_in_progress_and_a_notice_only_when_finishing_would_overrun(tmp_path):
    from airflow_provider_spotsched.runtime.distributed import Workers
    from airflow_provider_spotsched.runtime.preemption import StopFlag
    from airflow_provider_spotsched.runtime.train import Trainer

    def trainer(reason: str | None, window_s: float | None) -> Trainer:
        stop = StopFlag()
        if reason:
            stop.set(reason)
        built = Trainer(TrainConfig.from_dict({"samples": 100, "checkpoint": {"cost_s": 1.0}}), str(tmp_path),
                        Workers(0, 1, torch.device("cpu"), 0.0), stop, notice_window_s=window_s)
        built.seconds_per_sample = 1.0
        return built

    assert not trainer(None, 30.0).abandon_step(100)
    assert trainer("sigterm", 30.0).abandon_step(1)
    assert not trainer("notice: gcp preempted", 30.0).abandon_step(10)  # 10 s + 1 s save < 15 s
    assert trainer("notice: gcp preempted", 30.0).abandon_step(20)  # 21 s > half of 30 s
    assert not trainer("notice: notice file /x", None).abandon_step(1000)  # the SIGTERM that follows decides


def test_a_config_is_read_from_an_fsspec_url_like_the_checkpoints():
    import fsspec

    with fsspec.open("memory://spotsched-config/config.json", "w") as handle:
        handle.write('{"samples": 64, "batch_size": 4}')
    config = TrainConfig.from_file("memory://spotsched-config/config.json")
    assert (config.samples, config.batch_size) == (64, 4)
