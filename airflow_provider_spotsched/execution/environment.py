"""What one run drives: a compute backend, the market feed it reads, and the clock of its slots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import fsspec

from airflow_provider_spotsched.backends.base import ComputeBackend, TrainingJob
from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.backends.local_settings import LocalReplaySettings
from airflow_provider_spotsched.market.feed import MarketFeed, ReplayedMarket
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.runtime.contract import Locate


def _no_clock(job: TrainingJob) -> float | None:
    return None


@dataclass
class SpotEnvironment:
    """A backend, its market and its clock.

    ``seconds_per_slot`` is set where the market is replayed faster than real time;
    ``clock_start`` says when the backend's slot 0 began (``None``: slot 0 began when the run
    started, as on a real market); ``default_checkpoint_uri`` gives a job's checkpoint location
    where the backend has one of its own (the local backend's workdir); ``locate`` reaches the
    files under the checkpoint URI (on Airflow: with the connection's credentials, not ambient ones).
    """

    backend: ComputeBackend
    market: MarketFeed
    seconds_per_slot: float | None = None
    default_checkpoint_uri: Callable[[str], str] | None = None
    clock_start: Callable[[TrainingJob], float | None] = _no_clock
    locate: Locate = fsspec.core.url_to_fs


def local_environment(settings: LocalReplaySettings, slot_hours: float) -> SpotEnvironment:
    """Local worker processes on a replayed trace: the operator's and the CLI's embedded default.

    The run and the backend read one :class:`ReplayedMarket`, so slot ``k`` of the run is the slot
    the backend's spot pools obey, however late the run reads it.
    """
    market = ReplayedMarket(cached_trace(settings.trace), slot_hours, settings.history_slots, settings.market_start)
    backend = LocalBackend(settings.workdir / "jobs", market=market.replay(), seconds_per_slot=settings.seconds_per_slot)
    return SpotEnvironment(
        backend=backend,
        market=market,
        seconds_per_slot=settings.seconds_per_slot,
        default_checkpoint_uri=lambda job_id: str(settings.workdir / "checkpoints" / job_id),
        clock_start=backend.clock_start,
    )
