"""The spot contract on the Hugging Face Trainer: docs/examples/hf_trainer_lora.py run as a training command.

The end-to-end tests run the example script in subprocesses (about 15 s each on a loaded 2-core
machine, most of it importing transformers): an uninterrupted reference, a ``file://`` notice
then a resume, a ``kill -9`` then a resume. The checkpoint-selection and pruning tests work on
the reference run's real ``checkpoint-N`` directories in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from airflow_provider_spotsched.runtime.config import CheckpointSettings, ConfigError
from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_PREEMPTED, read_progress
from airflow_provider_spotsched.runtime.hf_callback import SpotCallback
from airflow_provider_spotsched.runtime.hf_checkpoints import MANIFEST, checkpoints, prune, verify
from airflow_provider_spotsched.runtime.preemption import NoticeSource

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "examples" / "hf_trainer_lora.py"
STEPS = 40
BATCH = 8
# A step takes about 15 ms on an idle machine and several times that under load; saves every
# 0.05 s give several periodic checkpoints in 40 steps either way (every 3-4 steps idle, every
# step loaded), which the keep-3 and kill -9 tests need.
PERIODIC = {"keep": 3, "min_interval_s": 0.05, "max_interval_s": 0.05}
# Resuming replays the Trainer's exact data order, optimizer, scheduler and RNG state; what may
# differ is float summation order, so the final adapter and loss are compared to this tolerance.
ATOL = 1e-5
TIMEOUT_S = 180


class Run:
    """One run of the example script; its JSON event lines, read as they come."""

    def __init__(self, uri: Path, notice: Path | None = None, settings: dict[str, Any] | None = None) -> None:
        self.stderr_file = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the run
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SPOTSCHED_NOTICE": f"file://{notice}" if notice else "none",
               "SPOTSCHED_NOTICE_POLL_S": "0.05", "SPOTSCHED_CHECKPOINT": json.dumps(settings or PERIODIC)}
        self.process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--checkpoint-uri", str(uri), "--max-steps", str(STEPS),
             "--batch-size", str(BATCH), "--threads", "1"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self.stderr_file, text=True)
        self.events: list[dict[str, Any]] = []

    def __iter__(self) -> Iterator[dict[str, Any]]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # the Trainer's own prints
            if isinstance(event, dict) and "event" in event:
                self.events.append(event)
                yield event

    def finish(self) -> int:
        for _ in self:
            pass
        code = self.process.wait(TIMEOUT_S)
        self.stderr_file.seek(0)
        self.stderr = self.stderr_file.read()
        self.stderr_file.close()
        return code

    def kill(self) -> None:
        """``kill -9``: no handler runs, no emergency checkpoint."""
        self.process.send_signal(signal.SIGKILL)
        self.process.communicate(timeout=TIMEOUT_S)
        self.stderr_file.close()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == kind]


def final_adapter(uri: Path) -> dict[str, torch.Tensor]:
    return load_file(uri / "final" / "adapter_model.safetensors")


def assert_same_end(run: Run, uri: Path, reference: tuple[Path, Run]) -> None:
    reference_uri, reference_run = reference
    assert run.of("done")[0]["loss"] == pytest.approx(reference_run.of("done")[0]["loss"], abs=ATOL)
    ours, theirs = final_adapter(uri), final_adapter(reference_uri)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    uri = tmp_path_factory.mktemp("reference")
    run = Run(uri)
    code = run.finish()
    assert code == EXIT_DONE, run.stderr
    return uri, run


@pytest.mark.e2e
def test_an_uninterrupted_run_is_done_with_checkpoints_progress_and_adapter(reference: tuple[Path, Run]) -> None:
    uri, run = reference
    progress = read_progress(str(uri))
    assert (progress.status, progress.step, progress.world_size) == ("done", STEPS, 1)
    assert progress.samples_done == progress.samples_total == STEPS * BATCH
    assert progress.samples_per_second > 0 and progress.loss == run.of("done")[0]["loss"]
    kinds = [event["kind"] for event in run.of("checkpoint")]
    assert kinds[-1] == "final" and "periodic" in kinds
    kept = checkpoints(uri / "checkpoints")
    assert [d.name for d in kept][0] == f"checkpoint-{STEPS}" and len(kept) == PERIODIC["keep"]
    for directory in kept:  # the Trainer's own safetensors checkpoint, vouched for by the manifest
        assert "adapter_model.safetensors" in verify(directory)["files"]
    assert (uri / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.e2e
def test_a_notice_checkpoints_the_step_it_arrived_at_and_the_rerun_ends_as_the_reference(
        reference: tuple[Path, Run], tmp_path: Path) -> None:
    uri, notice = tmp_path / "job", tmp_path / "notice"
    run = Run(uri, notice=notice)
    for event in run:
        if event["event"] == "log" and event["step"] >= 10:
            notice.touch()
            break
    assert run.finish() == EXIT_PREEMPTED, run.stderr
    stopped = run.of("stop")[0]["step"]
    emergency = run.of("checkpoint")[-1]
    assert emergency["kind"] == "emergency" and emergency["step"] == stopped < STEPS
    assert max(event["step"] for event in run.of("log")) == stopped  # no step trained after it: 0 lost
    progress = read_progress(str(uri))
    assert (progress.status, progress.samples_done) == ("preempted", stopped * BATCH)

    notice.unlink()  # as the backends do before starting the next generation
    rerun = Run(uri, notice=notice)
    assert rerun.finish() == EXIT_DONE, rerun.stderr
    assert rerun.of("resumed")[0]["step"] == stopped
    assert min(event["step"] for event in rerun.of("log")) == stopped + 1
    assert_same_end(rerun, uri, reference)
    progress = read_progress(str(uri))  # what the scheduler measures the restarted slot from
    assert progress.resumed_samples == stopped * BATCH and progress.resumed <= progress.checkpointed <= progress.updated


@pytest.mark.e2e
def test_kill_9_loses_under_one_interval_and_the_rerun_skips_a_partial_checkpoint(
        reference: tuple[Path, Run], tmp_path: Path) -> None:
    uri = tmp_path / "job"
    run = Run(uri)
    saved: list[int] = []
    last_step = 0
    for event in run:
        if event["event"] == "checkpoint":
            saved.append(event["step"])
        if event["event"] == "log":
            last_step = event["step"]
            if len(saved) >= 2 and last_step > saved[-1]:  # trained past the last save: work to lose
                break
    run.kill()
    interval_steps = max(b - a for a, b in zip([0, *saved], saved))
    # what the killed process left for the next one, plus a half-written newer save
    partial = uri / "checkpoints" / f"checkpoint-{last_step + 1}"
    partial.mkdir()
    (partial / "adapter_model.safetensors").write_bytes(b"half")

    rerun = Run(uri)
    assert rerun.finish() == EXIT_DONE, rerun.stderr
    resumed = rerun.of("resumed")[0]
    assert resumed["skipped"][0].startswith(f"{partial.name}: no manifest")
    assert saved[-1] <= resumed["step"] <= last_step
    assert last_step - resumed["step"] <= interval_steps
    assert_same_end(rerun, uri, reference)


@pytest.mark.e2e
def test_a_corrupt_or_partial_newest_checkpoint_is_skipped_and_removed(
        reference: tuple[Path, Run], tmp_path: Path) -> None:
    uri = tmp_path / "job"
    shutil.copytree(reference[0], uri)
    newest, previous = checkpoints(uri / "checkpoints")[:2]
    weights = newest / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    partial = uri / "checkpoints" / f"checkpoint-{STEPS + 5}"
    shutil.copytree(previous, partial)
    (partial / MANIFEST).unlink()

    events: list[dict[str, Any]] = []
    callback = SpotCallback(str(uri), emit=lambda event, **fields: events.append({"event": event, **fields}))
    assert callback.resume_checkpoint() == str(previous)
    assert [why.split(":")[0] for why in events[0]["skipped"]] == [partial.name, newest.name]
    assert "checksum mismatch in adapter_model.safetensors" in events[0]["skipped"][1]
    assert checkpoints(uri / "checkpoints")[0] == previous  # the Trainer will not save into a stale one


@pytest.mark.e2e
def test_pruning_keeps_the_newest_valid_checkpoints_however_many_newer_are_corrupt(
        reference: tuple[Path, Run], tmp_path: Path) -> None:
    output = tmp_path / "checkpoints"
    shutil.copytree(reference[0] / "checkpoints", output)
    newest, middle, oldest = checkpoints(output)
    (newest / MANIFEST).write_text("{not json")
    removed = prune(output, keep=1, log=lambda message: None)
    assert removed == [newest.name, oldest.name] and checkpoints(output) == [middle]


def test_from_env_names_what_is_missing_or_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="SPOTSCHED_CHECKPOINT_URI"):
        SpotCallback.from_env({})
    with pytest.raises(ValueError, match=r"'s3://bucket/job': Install s3fs"):  # not installed here (pyproject: s3)
        SpotCallback.from_env({"SPOTSCHED_CHECKPOINT_URI": "s3://bucket/job"})
    staged = SpotCallback.from_env({"SPOTSCHED_CHECKPOINT_URI": "memory://bucket/job",
                                    "SPOTSCHED_STAGING_DIR": str(tmp_path / "staging")})
    assert staged.mirror is not None and staged.root.parent == tmp_path / "staging"
    assert staged.checkpoint_uri == "memory://bucket/job"
    with pytest.raises(ConfigError, match="not JSON"):
        SpotCallback.from_env({"SPOTSCHED_CHECKPOINT_URI": str(tmp_path), "SPOTSCHED_CHECKPOINT": "{"})
    with pytest.raises(ConfigError, match="checkpoint.keep"):
        SpotCallback.from_env({"SPOTSCHED_CHECKPOINT_URI": str(tmp_path), "SPOTSCHED_CHECKPOINT": '{"keep": 0}'})
    with pytest.raises(ValueError, match="SPOTSCHED_NOTICE"):
        SpotCallback.from_env({"SPOTSCHED_CHECKPOINT_URI": str(tmp_path), "SPOTSCHED_NOTICE": "azure"})
    callback = SpotCallback.from_env({"SPOTSCHED_CHECKPOINT_URI": f"file://{tmp_path}",
                                      "SPOTSCHED_NOTICE": "file:///tmp/n", "SPOTSCHED_CHECKPOINT": '{"keep": 2}'})
    assert (callback.output_dir, callback.keep) == (tmp_path / "checkpoints", 2)
    assert callback.notice is not None and callback.notice.location == "/tmp/n"


def test_the_shipped_sft_data_is_what_its_generator_makes_of_the_corpus() -> None:
    from airflow_provider_spotsched.data.text import generate_sft

    shipped = generate_sft.OUTPUT.read_text(encoding="utf-8")
    assert shipped == generate_sft.generate(generate_sft.CORPUS.read_text(encoding="utf-8"))
    assert all(set(json.loads(line)) == {"prompt", "response"} for line in shipped.splitlines())


def test_a_step_and_save_longer_than_the_notice_window_is_warned_about(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    callback = SpotCallback(str(tmp_path), CheckpointSettings(cost_s=2.0), notice=NoticeSource("gcp", "http://127.0.0.1:9"))
    callback.check_notice_window(1.0)
    assert capsys.readouterr().err == ""
    callback.check_notice_window(29.0)  # 29 s step + 2 s save > GCP's 30 s
    assert "exceeds the 30 s preemption notice" in capsys.readouterr().err


def test_sigterm_during_training_asks_the_trainer_to_save_and_stop(tmp_path: Path) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    events: list[dict[str, Any]] = []
    callback = SpotCallback(str(tmp_path), emit=lambda event, **fields: events.append({"event": event, **fields}))
    args = TrainingArguments(output_dir=str(callback.output_dir), save_total_limit=2, report_to="none", use_cpu=True)
    state, control = TrainerState(max_steps=10, global_step=3), TrainerControl()
    previous = signal.getsignal(signal.SIGTERM)
    callback.on_train_begin(args, state, control)
    try:
        assert (callback.keep, args.save_total_limit) == (2, None)  # pruned by validity, not by the Trainer
        os.kill(os.getpid(), signal.SIGTERM)
        control = callback.on_step_end(args, state, control)
    finally:
        callback.on_train_end(args, state, control)
    assert control.should_save and control.should_training_stop and callback.exit_code == EXIT_PREEMPTED
    assert events == [{"event": "stop", "reason": "sigterm", "step": 3}]
    assert signal.getsignal(signal.SIGTERM) is previous
