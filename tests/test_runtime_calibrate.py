"""The calibration step: the job's own config, timed on this machine through the backends' launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_spotsched.runtime.calibrate import (
    NO_PERIODIC_SAVES,
    SECONDS_PER_HOUR,
    Calibration,
    CalibrationError,
    calibrate,
    calibration_config,
    main,
)
from airflow_provider_spotsched.runtime.config import TrainConfig

PACE = 20.0  # samples/s the demo's instance speed holds the run to: the measurement cannot exceed it


def test_the_calibration_config_is_the_jobs_own_cut_to_a_few_steps() -> None:
    job = {"samples": 100_000, "batch_size": 4, "lr": 1e-3, "checkpoint": {"keep": 2}}
    cut = calibration_config(job, 12)
    assert cut == {"batch_size": 4, "lr": 1e-3, "steps": 12, "checkpoint": {"keep": 2, **NO_PERIODIC_SAVES}}
    assert TrainConfig.from_dict(cut).samples == 48  # valid as a runtime config
    with pytest.raises(ValueError, match="steps must be >= 1"):
        calibration_config(job, 0)


def test_the_throughput_is_samples_per_hour_on_one_instance() -> None:
    assert Calibration(41.25, 8, 30).to_dict()["throughput"] == {"alpha": 41.25 * SECONDS_PER_HOUR, "beta": 0.0}


@pytest.mark.e2e
def test_a_calibration_run_reports_the_rate_the_runtime_measured(tmp_path: Path) -> None:
    config = {"samples": 100_000, "batch_size": 4, "seq_len": 32, "samples_per_second_per_worker": PACE}
    result = calibrate(config, 8, tmp_path)
    assert result.steps == 8 and result.processes == 1
    assert 0 < result.samples_per_second <= PACE * 1.01, result
    progress = json.loads((tmp_path / "checkpoint" / "progress.json").read_text())
    assert progress["samples_done"] == 32 and progress["samples_per_second"] == result.samples_per_second


def test_a_calibration_that_cannot_run_says_why(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="exited 2 .*batch_size"):
        calibrate({"batch_size": 0}, 4, tmp_path)


def test_the_command_line_refuses_a_config_that_is_not_an_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text("[1, 2]")
    assert main(["--config", str(config)]) == 2
    assert "must hold a JSON object" in capsys.readouterr().err
