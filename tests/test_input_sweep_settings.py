"""A sweep of bad settings: the runtime's training config and the local connection's extras.

Two more inputs cross the project's edge as JSON a user writes: the runtime's CONFIG (the
operator's ``training_config``, ``spotsched run --training-config``) and a ``spotsched_local``
connection's extras. For every generated value at its extremes, each is either accepted or
refused with the one error type its reader promises (``ConfigError``, ``ValueError``) whose
message names the field; never another exception. (tests/test_input_sweep.py sweeps job and
trace files through the command line the same way.)
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_spotsched.backends.local_settings import LocalReplaySettings
from airflow_provider_spotsched.runtime.config import ConfigError, TrainConfig

SWEEP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

EXTREMES = st.sampled_from([
    None, True, False, 0, -1, -0.5, 1e-9, 0.5, 2, 1e6, 1e308, -1e308, 10**30, 10**400,
    float("nan"), float("inf"), float("-inf"), "5", "abc", "", "gcp", "aws", "/nonexistent/trace.csv",
    [], [1, 2], ["c_attn"], {}, {"a": [1, {"b": None}]}, "2025-10-11T03:10:00Z", "2025-13-01", "é",
])
CONFIG: dict[str, Any] = {
    "samples": 64, "batch_size": 4, "seq_len": 32, "threads": 1,
    "lora": {"r": 8, "alpha": 16.0, "dropout": 0.0},
    "checkpoint": {"keep": 2, "min_interval_s": 1.0, "max_interval_s": 3.0},
}
CONFIG_FIELDS = [
    "samples", "batch_size", "seq_len", "threads", "model", "dataset", "learning_rate", "seed", "colour",
    "lora", "lora.r", "lora.alpha", "lora.dropout", "lora.target_modules",
    "checkpoint", "checkpoint.keep", "checkpoint.min_interval_s", "checkpoint.max_interval_s", "checkpoint.cost_s",
]
EXTRAS = ["workdir", "trace", "seconds_per_slot", "market_start", "history_slots", "colour"]


def with_value(config: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    changed = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    section, _, key = field.partition(".")
    if key and isinstance(changed.get(section), dict):
        changed[section][key] = value
    else:
        changed[section] = value
    return changed


@SWEEP
@given(st.lists(st.tuples(st.sampled_from(CONFIG_FIELDS), EXTREMES), min_size=1, max_size=3))
def test_a_training_config_is_accepted_or_refused_naming_its_field(changes):
    config = CONFIG
    for field, value in changes:
        config = with_value(config, field, value)
    try:
        parsed = TrainConfig.from_dict(config)
    except ConfigError as error:
        named = {f.split(".")[-1] for f, _ in changes} | {f.split(".")[0] for f, _ in changes}
        assert any(name in str(error) for name in named), f"{error} names none of {sorted(named)}"
        return
    assert parsed.samples >= 1 and math.isfinite(float(parsed.samples))


@SWEEP
@given(st.dictionaries(st.sampled_from(EXTRAS), EXTREMES, min_size=1, max_size=3))
def test_connection_extras_are_accepted_or_refused_naming_their_field(extra):
    try:
        settings_ = LocalReplaySettings.from_extra(extra, "connection 'my_local'")
    except ValueError as error:
        message = str(error)
        assert message.startswith("connection 'my_local': ") and "\n" not in message
        assert any(name in message for name in extra), f"{message} names none of {sorted(extra)}"
        return
    assert settings_.seconds_per_slot > 0 and math.isfinite(settings_.seconds_per_slot)
    assert settings_.history_slots >= 1 and settings_.trace.is_file()
