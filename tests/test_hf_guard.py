"""The divergence guard on the default runtime: a NaN loss rolls back to the newest checkpoint, lr backed off.

``fault_injection.nan_loss_at_steps`` poisons the trainable weights before a step, once per process,
so the step's loss is NaN. The guard judges every loss the Trainer logs, and the loss since the last
log before every save, so no poisoned state is ever checkpointed: the run restores the newest
checkpoint (from before the NaN), halves the learning rate and trains on to the end.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_FAILURE
from airflow_provider_spotsched.runtime.hf_checkpoints import checkpoints, verify
from airflow_provider_spotsched.runtime.node import BACKEND_RENDEZVOUS

ROOT = Path(__file__).resolve().parent.parent
NAN_AT = 12
CONFIG = {"steps": 20, "batch_size": 4, "seq_len": 32, "log_every_steps": 5,
          "checkpoint": {"min_interval_s": 0.3, "max_interval_s": 0.3},
          "fault_injection": {"nan_loss_at_steps": [NAN_AT], "step_sleep_s": 0.1}}


def train(tmp_path: Path, config: dict[str, Any]) -> tuple[int, list[dict[str, Any]], str]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPOTSCHED_NOTICE": "none", "OMP_NUM_THREADS": "1"}
    for name in BACKEND_RENDEZVOUS:
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "airflow_provider_spotsched.runtime", "--config",
                           str(tmp_path / "config.json"), "--checkpoint-uri", str(tmp_path / "job")],
                          env=env, capture_output=True, text=True, timeout=300)
    events = []
    for line in done.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return done.returncode, events, done.stderr


@pytest.mark.e2e
def test_a_nan_loss_rolls_back_to_the_newest_checkpoint_with_the_learning_rate_halved(tmp_path: Path) -> None:
    code, events, stderr = train(tmp_path, CONFIG)
    assert code == EXIT_DONE, stderr
    kinds = [event["event"] for event in events]
    (rollback,) = [event for event in events if event["event"] == "rollback"]
    assert rollback["reason"] == "loss is nan" and rollback["lr_scale"] == 0.5 and rollback["rollbacks"] == 1
    before = events[: kinds.index("rollback")]
    saved_before = [event["step"] for event in before if event["event"] == "checkpoint"]
    assert rollback["step"] == max(saved_before) < NAN_AT, (rollback, saved_before)  # nothing poisoned was saved
    after = events[kinds.index("rollback"):]
    assert all(math.isfinite(event["loss"]) for event in after if event["event"] == "log")
    final = verify(checkpoints(tmp_path / "job" / "checkpoints")[0])
    assert final["step"] == 20 and final["rollbacks"] == 1 and final["lr_scale"] == 0.5


@pytest.mark.e2e
def test_past_max_rollbacks_the_job_fails_with_the_reason(tmp_path: Path) -> None:
    code, _, stderr = train(tmp_path, {**CONFIG, "guard": {"max_rollbacks": 0}})
    assert code == EXIT_FAILURE
    assert "DivergenceError: training diverged (loss is nan) after 0 rollback(s)" in stderr, stderr
