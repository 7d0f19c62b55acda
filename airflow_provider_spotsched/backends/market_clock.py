"""A slot market replayed on an accelerated wall clock: what the local backend's spot pools obey.

Slot ``t`` of the market lasts ``seconds_per_slot`` seconds of wall time from ``start`` (UTC epoch
seconds), so ``slot = floor((now - start) / seconds_per_slot)``; before ``start`` the first slot
holds and after the last slot the last one holds (a replay never runs out under a long job).
Only the available counts matter here: they cap how many spot workers of each pool may run.

The notice period shrinks with the clock: AWS gives 120 s of notice before a spot interruption
and GCP 30 s, on a clock that runs ``slot_hours * 3600 / seconds_per_slot`` times faster than real
time. The clock is plain data (:meth:`to_dict`) so that every process of a job replays the same one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from airflow_provider_spotsched.market.slots import SlotMarket

AWS_NOTICE_SECONDS = 120.0  # EC2's spot interruption notice


@dataclass(frozen=True)
class MarketClock:
    """Available spot counts ``[slots, pools]`` replayed at ``seconds_per_slot`` from ``start``."""

    pools: tuple[str, ...]
    available: tuple[tuple[int, ...], ...]
    slot_hours: float
    seconds_per_slot: float
    start: float
    notice_seconds: float

    def __post_init__(self) -> None:
        if not self.available or any(len(row) != len(self.pools) for row in self.available):
            raise ValueError(f"available must hold at least one slot of {len(self.pools)} counts (one per pool)")
        for name in ("slot_hours", "seconds_per_slot"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not (math.isfinite(self.notice_seconds) and self.notice_seconds >= 0):
            raise ValueError(f"notice_seconds must be a number >= 0, got {self.notice_seconds!r}")

    @classmethod
    def replay(
        cls,
        market: SlotMarket,
        seconds_per_slot: float,
        start: float | None = None,
        notice_seconds: float | None = None,
        provider_notice_seconds: float = AWS_NOTICE_SECONDS,
    ) -> MarketClock:
        """Replay ``market`` from ``start`` (default: now); the notice defaults to the provider's, sped up."""
        if not seconds_per_slot > 0:
            raise ValueError(f"seconds_per_slot must be > 0, got {seconds_per_slot!r}")
        if notice_seconds is None:
            notice_seconds = provider_notice_seconds / speed_up(market.slot_hours, seconds_per_slot)
        return cls(
            pools=tuple(market.pools),
            available=tuple(tuple(int(a) for a in row) for row in np.asarray(market.available)),
            slot_hours=float(market.slot_hours),
            seconds_per_slot=float(seconds_per_slot),
            start=time.time() if start is None else float(start),
            notice_seconds=float(notice_seconds),
        )

    @property
    def num_slots(self) -> int:
        return len(self.available)

    def slot(self, now: float | None = None) -> int:
        """The market slot in force at wall time ``now`` (clamped to the replayed slots)."""
        now = time.time() if now is None else now
        elapsed = math.floor((now - self.start) / self.seconds_per_slot)
        return min(max(elapsed, 0), self.num_slots - 1)

    def seconds_to_next_slot(self, now: float | None = None) -> float:
        """Wall seconds from ``now`` until the next slot starts (until slot 0 before the start)."""
        now = time.time() if now is None else now
        if now < self.start:
            return self.start - now
        return self.start + (math.floor((now - self.start) / self.seconds_per_slot) + 1) * self.seconds_per_slot - now

    def capacity(self, pool: str, now: float | None = None) -> int:
        """How many spot workers pool ``pool`` may run at wall time ``now``."""
        try:
            m = self.pools.index(pool)
        except ValueError:
            raise ValueError(f"pool {pool!r} is not in the replayed market; its pools are {list(self.pools)}") from None
        return self.available[self.slot(now)][m]

    def to_dict(self) -> dict[str, Any]:
        return {
            "pools": list(self.pools),
            "available": [list(row) for row in self.available],
            "slot_hours": self.slot_hours,
            "seconds_per_slot": self.seconds_per_slot,
            "start": self.start,
            "notice_seconds": self.notice_seconds,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MarketClock:
        return cls(
            pools=tuple(data["pools"]),
            available=tuple(tuple(int(a) for a in row) for row in data["available"]),
            slot_hours=float(data["slot_hours"]),
            seconds_per_slot=float(data["seconds_per_slot"]),
            start=float(data["start"]),
            notice_seconds=float(data["notice_seconds"]),
        )


def speed_up(slot_hours: float, seconds_per_slot: float) -> float:
    """How many times faster than real time a clock of ``seconds_per_slot`` per slot runs."""
    return slot_hours * 3600.0 / seconds_per_slot
