"""The Hugging Face runtime's resume housekeeping: only a checkpoint known to be bad is deleted."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from airflow_provider_spotsched.runtime import hf_checkpoints
from airflow_provider_spotsched.runtime.hf_checkpoints import MANIFEST, checkpoints, remove_newer_than, write_manifest


def saved(output: Path, step: int) -> Path:
    directory = output / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    (directory / "adapter_model.safetensors").write_bytes(f"weights of step {step}".encode())
    write_manifest(directory, step=step)
    return directory


def unreadable(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Reading any file of the checkpoints ``names`` fails as a flaky network disk does (EIO)."""
    real_digest = hf_checkpoints._digest

    def digest(path: Path) -> tuple[int, str]:
        if path.parent.name in names:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_digest(path)

    monkeypatch.setattr(hf_checkpoints, "_digest", digest)


def test_newer_checkpoints_that_could_not_be_read_are_set_aside_not_deleted(tmp_path, monkeypatch):
    output = tmp_path / "checkpoints"
    saved(output, 10)
    unread = saved(output, 20)
    corrupt = saved(output, 30)
    (corrupt / MANIFEST).write_text("{not json")
    unreadable(monkeypatch, unread.name)
    log: list[str] = []
    chosen, skipped = hf_checkpoints.latest_valid(output, log.append)
    assert chosen == output / "checkpoint-10" and len(skipped) == 2

    assert remove_newer_than(output, 10, log.append) == ["checkpoint-30", "checkpoint-20"]
    assert checkpoints(output) == [chosen]  # the Trainer will not save into either
    (aside,) = [p for p in output.iterdir() if p.name.startswith("checkpoint-20.unreadable-")]
    assert (aside / "adapter_model.safetensors").read_bytes() == b"weights of step 20"
    assert any("checkpoint-20 set aside as checkpoint-20.unreadable-" in message for message in log)
    assert any(message.startswith("checkpoint checkpoint-30 removed: corrupt") for message in log)


def test_when_no_checkpoint_can_be_read_none_is_deleted(tmp_path, monkeypatch):
    output = tmp_path / "checkpoints"
    saved(output, 10)
    saved(output, 20)
    unreadable(monkeypatch, "checkpoint-10", "checkpoint-20")
    chosen, _ = hf_checkpoints.latest_valid(output, lambda message: None)
    assert chosen is None
    remove_newer_than(output, None, lambda message: None)
    monkeypatch.undo()
    kept = sorted(p for p in output.iterdir())
    assert [p.name.split(".")[0] for p in kept] == ["checkpoint-10", "checkpoint-20"]
    assert all(hf_checkpoints.verify(p)["step"] for p in kept)
