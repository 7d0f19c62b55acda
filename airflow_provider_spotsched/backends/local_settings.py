"""The local backend's settings: where its workers run and which shipped market they replay.

They come from a ``spotsched_local`` connection's extras or from keyword overrides (a DAG's
``backend_options``); see :mod:`airflow_provider_spotsched.hooks.local` for the fields.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.market.shipped import trace_path
from airflow_provider_spotsched.market.trace import parse_timestamp

DEFAULT_SECONDS_PER_SLOT = 5.0
DEFAULT_HISTORY_SLOTS = 48


def default_workdir() -> Path:
    """``$AIRFLOW_HOME/spotsched`` (Airflow's own default home when the variable is unset)."""
    return Path(os.environ.get("AIRFLOW_HOME") or "~/airflow").expanduser() / "spotsched"


@dataclass(frozen=True)
class LocalReplaySettings:
    """Where the local backend works and which market it replays (see the module docstring)."""

    workdir: Path
    trace: Path = GCP_TRACE
    seconds_per_slot: float = DEFAULT_SECONDS_PER_SLOT
    market_start: datetime | None = None
    history_slots: int = DEFAULT_HISTORY_SLOTS

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], where: str) -> LocalReplaySettings:
        """Settings from connection extras or keyword overrides, naming ``where`` in every error."""
        unknown = sorted(set(extra) - {"workdir", "trace", "seconds_per_slot", "market_start", "history_slots"})
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown}; use workdir, trace, seconds_per_slot, market_start, history_slots"
            )
        settings = cls(workdir=default_workdir())
        if extra.get("workdir"):
            if not isinstance(extra["workdir"], str):
                raise ValueError(f"{where}: workdir must be a directory path (text), got {extra['workdir']!r}")
            settings = replace(settings, workdir=Path(extra["workdir"]).expanduser())
        if extra.get("trace"):
            try:
                path = trace_path(str(extra["trace"]))
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            settings = replace(settings, trace=path)
        if extra.get("seconds_per_slot") is not None:
            value = _from_text(extra["seconds_per_slot"], float)
            try:
                seconds = math.nan if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)
            except OverflowError:  # an integer beyond any float
                seconds = math.inf
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{where}: seconds_per_slot must be a number of seconds > 0, got {value!r}")
            settings = replace(settings, seconds_per_slot=seconds)
        if extra.get("market_start"):
            value = extra["market_start"]
            try:
                start = value if isinstance(value, datetime) else parse_timestamp(str(value))
                start = start.astimezone(timezone.utc)
            except (ValueError, OverflowError) as error:
                raise ValueError(f"{where}: market_start {value!r}: {error}") from None
            settings = replace(settings, market_start=start)
        if extra.get("history_slots") is not None:
            value = _from_text(extra["history_slots"], int)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: history_slots must be an integer >= 1, got {value!r}")
            settings = replace(settings, history_slots=value)
        return settings


def _from_text(value: Any, kind: type[int] | type[float]) -> Any:
    """A number given as text read as one: a connection in URI form (``?seconds_per_slot=10``) has
    only text extras. Anything else is returned as given, for the range checks to refuse."""
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
