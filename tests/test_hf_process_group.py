"""spot_train leaves the process group once training ends in order, and only then.

A real gloo group of one process and a real ``Accelerator``; the callback's training is replaced,
since what is tested is what happens to the group around it (the training itself is tested
end to end in test_hf_callback.py and test_hf_elastic.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from accelerate import Accelerator

from airflow_provider_spotsched.runtime import hf_callback
from airflow_provider_spotsched.runtime.contract import EXIT_PREEMPTED


class _Training:
    """What ``SpotCallback.from_env`` returns here: a training that ends as told."""

    def __init__(self, outcome: int | Exception) -> None:
        self.outcome = outcome

    def train(self, trainer: object) -> int:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _spot_train(monkeypatch: pytest.MonkeyPatch, outcome: int | Exception) -> int:
    monkeypatch.setattr(hf_callback.SpotCallback, "from_env", classmethod(lambda cls, checkpoint_uri=None: _Training(outcome)))
    trainer = SimpleNamespace(accelerator=Accelerator(cpu=True))
    return hf_callback.spot_train(trainer)  # type: ignore[arg-type]


def test_a_preempted_run_leaves_its_process_group_before_returning_75(group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert dist.is_initialized()
    assert _spot_train(monkeypatch, EXIT_PREEMPTED) == EXIT_PREEMPTED
    assert not dist.is_initialized()


def test_a_run_that_raises_keeps_its_process_group(group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="a peer died"):
        _spot_train(monkeypatch, RuntimeError("a peer died"))
    assert dist.is_initialized()
