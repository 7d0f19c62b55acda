"""The ``spotsched_local`` connection: local worker processes on a shipped trace replayed fast.

The embedded default needs no connection at all: workers run under ``$AIRFLOW_HOME/spotsched``,
the market is the shipped GCP H100 trace, one market slot lasts a few wall-clock seconds. A
``spotsched_local`` connection (or keyword overrides, e.g. from a DAG) changes any of it; its
extras are

- ``workdir``: where job directories (and default checkpoints) live (default: ``[spotsched]
  local_workdir``, else ``$AIRFLOW_HOME/spotsched``);
- ``trace``: ``"gcp"`` or ``"aws"`` (the shipped traces) or the path of a trace file;
- ``seconds_per_slot``: wall-clock seconds per market slot;
- ``market_start``: UTC timestamp in the trace where the job is submitted (default: after the
  first ``history_slots`` slots);
- ``history_slots``: slots of market history before submission (forecasts and the selector's
  warm-up read them).

The operator and the local backend must see the same market: :class:`ReplayedMarket` is the
trace in slots, history first; the backend replays its rows from submission on, and slot ``k``
of the run is row ``history_slots + k``, however late the operator reads it.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from airflow.sdk import BaseHook, conf

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.backends.base import TrainingJob
from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.backends.local_jobdir import read_json
from airflow_provider_spotsched.backends.market_clock import MarketClock
from airflow_provider_spotsched.config import SECTION
from airflow_provider_spotsched.hooks import local_connection
from airflow_provider_spotsched.hooks.market_feed import MarketFeed
from airflow_provider_spotsched.market.slots import SlotMarket, resample
from airflow_provider_spotsched.market.trace import Trace, format_timestamp, load_trace, parse_timestamp

SHIPPED_TRACES = {"gcp": GCP_TRACE, "aws": AWS_TRACE}
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
    def from_extra(cls, extra: Mapping[str, Any], where: str) -> "LocalReplaySettings":
        """Settings from connection extras or keyword overrides, naming ``where`` in every error."""
        unknown = sorted(set(extra) - {"workdir", "trace", "seconds_per_slot", "market_start", "history_slots"})
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown}; use workdir, trace, seconds_per_slot, market_start, history_slots"
            )
        settings = cls(workdir=default_workdir())
        if extra.get("workdir"):
            settings = replace(settings, workdir=Path(str(extra["workdir"])).expanduser())
        if extra.get("trace"):
            name = str(extra["trace"])
            path = SHIPPED_TRACES.get(name, Path(name).expanduser())
            if not path.is_file():
                raise ValueError(f'{where}: trace {name!r} is neither "gcp", "aws" nor an existing trace file')
            settings = replace(settings, trace=path)
        if extra.get("seconds_per_slot") is not None:
            value = extra["seconds_per_slot"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{where}: seconds_per_slot must be a number of seconds > 0, got {value!r}")
            settings = replace(settings, seconds_per_slot=float(value))
        if extra.get("market_start"):
            value = extra["market_start"]
            try:
                start = value if isinstance(value, datetime) else parse_timestamp(str(value))
            except ValueError as error:
                raise ValueError(f"{where}: market_start {value!r}: {error}") from None
            settings = replace(settings, market_start=start.astimezone(timezone.utc))
        if extra.get("history_slots") is not None:
            value = extra["history_slots"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: history_slots must be an integer >= 1, got {value!r}")
            settings = replace(settings, history_slots=value)
        return settings


class ReplayedMarket(MarketFeed):
    """A trace in slots: ``history_slots`` before submission, then the slots the run replays."""

    def __init__(self, trace: Trace, slot_hours: float, history_slots: int, start: datetime | None = None) -> None:
        first = datetime.fromtimestamp(trace.first_time, timezone.utc)
        start = start or first + timedelta(hours=history_slots * slot_hours)
        origin = start - timedelta(hours=history_slots * slot_hours)
        if origin < first:
            raise ValueError(
                f"market_start {format_timestamp(start)} leaves fewer than history_slots={history_slots} slots of "
                f"{trace.source} before it; choose a market_start at or after "
                f"{format_timestamp(first + timedelta(hours=history_slots * slot_hours))}"
            )
        self.history_slots = history_slots
        self.market: SlotMarket = resample(trace, origin, slot_hours)
        if self.market.num_slots <= history_slots:
            raise ValueError(f"market_start {format_timestamp(start)} lies at the end of {trace.source}; choose an earlier one")

    def history(self, now: datetime) -> SlotMarket:
        return self.market.prefix(self.history_slots + 1)

    def row(self, slot: int, pools: Sequence[str], now: datetime) -> tuple[np.ndarray, np.ndarray]:
        """Row ``slot`` of the replay; past the trace's end the last row holds (as the backend's clock)."""
        index = [self.market.pools.index(p) for p in pools]
        row = min(self.history_slots + slot, self.market.num_slots - 1)
        return self.market.spot_price[row, index], self.market.available[row, index]

    def replay(self) -> SlotMarket:
        """The slots from submission on: what the local backend's spot pools obey."""
        return self.market.window(self.history_slots)


class LocalSpotHook(BaseHook):
    """Builds the local backend and its replayed market from a ``spotsched_local`` connection.

    :param local_conn_id: the connection; ``None`` uses the embedded default (no connection).
    :param overrides: extras that win over the connection's (same names as the extras).
    """

    conn_name_attr = "local_conn_id"
    default_conn_name = "spotsched_local_default"
    conn_type = local_connection.CONN_TYPE
    hook_name = local_connection.HOOK_NAME

    def __init__(self, local_conn_id: str | None = None, **overrides: Any) -> None:
        super().__init__()
        self.local_conn_id = local_conn_id
        self.overrides = overrides

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        """The provider info's ``ui-field-behaviour``, for readers of the hook (Airflow 3.3 reads the info)."""
        return local_connection.field_behaviour()

    def settings(self) -> LocalReplaySettings:
        """Overrides win over the connection's extras; then ``[spotsched] local_workdir``; then the defaults."""
        extra: dict[str, Any] = {}
        if self.local_conn_id:
            extra.update(self.get_connection(self.local_conn_id).extra_dejson)
        extra.update({k: v for k, v in self.overrides.items() if v is not None})
        if not extra.get("workdir"):
            extra["workdir"] = conf.get(SECTION, "local_workdir", fallback=None)
        where = f"connection {self.local_conn_id!r}" if self.local_conn_id else "backend_options"
        return LocalReplaySettings.from_extra(extra, where)

    def market(self, slot_hours: float = 1.0) -> ReplayedMarket:
        settings = self.settings()
        return ReplayedMarket(_load_trace(settings.trace), slot_hours, settings.history_slots, settings.market_start)

    def backend(self, market: ReplayedMarket | None = None) -> LocalBackend:
        """The backend; without ``market`` it can report and release but not launch a new job."""
        settings = self.settings()
        return LocalBackend(
            settings.workdir / "jobs",
            market=market.replay() if market is not None else None,
            seconds_per_slot=settings.seconds_per_slot,
        )

    def default_checkpoint_uri(self, job_id: str) -> str:
        return str(self.settings().workdir / "checkpoints" / job_id)


@functools.lru_cache(maxsize=4)
def _load_trace(path: Path) -> Trace:
    """A trace parsed once per process: every slot of a run reads the same file again."""
    return load_trace(path)


def clock_start(backend: LocalBackend, job: TrainingJob) -> float | None:
    """When slot 0 of ``job``'s replay began (epoch seconds), or ``None`` before its first launch."""
    clock_file = backend.jobdir(job).clock_file
    return MarketClock.from_dict(read_json(clock_file)).start if clock_file.exists() else None
