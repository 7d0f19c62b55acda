"""What a run reads of the spot market: the history at submission, then one row per slot.

An :class:`~airflow_provider_spotsched.scheduling.online.OnlineRun` starts from a slot market that
ends with slot 0's state and then observes one row at every slot boundary. A feed answers both
questions for one kind of market: a live one (a :class:`MarketSource` such as the AWS or GCP
sources, read at wall-clock ``now``) or a trace replayed on an accelerated clock (the local
backend's, :class:`ReplayedMarket`), where slot ``k`` is a row of the trace whatever the wall
clock says.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import numpy as np

from airflow_provider_spotsched.market.slots import SlotMarket, resample, resample_until
from airflow_provider_spotsched.market.source import MarketSource
from airflow_provider_spotsched.market.trace import Trace, TraceError, format_timestamp


class NoMarketData(TraceError):
    """No pool had a tick in the window: every pool's availability is unknown (and counts as 0)."""


class MarketFeed(ABC):
    """The market one run reads: ``history`` at submission, then ``row`` at every boundary."""

    @abstractmethod
    def history(self, now: datetime, pools: Sequence[str] | None = None) -> SlotMarket:
        """Every pool's slots before submission, ending with the state at ``now`` (slot 0).

        Its on-demand price is the one a job on ``pools`` pays (default: on any pool): the cheapest
        of those pools' on-demand prices in force at submission, as the simulator's job market
        (:func:`~airflow_provider_spotsched.scheduling.replay.job_market`). Pools the market does
        not know are left out of that price, for the run to refuse them by name.
        """

    @abstractmethod
    def row(self, slot: int, pools: Sequence[str], now: datetime) -> tuple[np.ndarray, np.ndarray]:
        """Spot prices and available counts of ``pools`` (in that order) at the start of ``slot``."""


def check_feed_history(slot_hours: float, history_hours: float) -> None:
    """Refuse a live feed's slots that read less than one slot of history (callers that build the
    feed later, in the triggerer, check it when they are built)."""
    if not slot_hours > 0 or not history_hours >= slot_hours:
        raise ValueError(
            f"slot_hours must be > 0 and history_hours >= slot_hours, got {slot_hours!r} and {history_hours!r}; "
            "read at least one slot of history (e.g. history_hours=48)"
        )


class LiveMarketFeed(MarketFeed):
    """A live :class:`MarketSource` cut into slots, the last one starting at wall-clock ``now``."""

    def __init__(self, source: MarketSource, slot_hours: float = 1.0, history_hours: float = 48.0) -> None:
        check_feed_history(slot_hours, history_hours)
        self.source, self.slot_hours, self.history_hours = source, float(slot_hours), float(history_hours)

    def history(self, now: datetime, pools: Sequence[str] | None = None) -> SlotMarket:
        return self._slots(now, self.history_hours, pools)

    def row(self, slot: int, pools: Sequence[str], now: datetime) -> tuple[np.ndarray, np.ndarray]:
        try:
            market = self._slots(now, 2 * self.slot_hours)
        except NoMarketData:  # a feed silent for a while: its last prices, its capacity unknown (0)
            market = self._slots(now, self.history_hours)
        missing = [p for p in pools if p not in market.pools]
        if missing:
            raise TraceError(f"the market source has no recent ticks for pool(s) {missing}; check its connection")
        index = [market.pools.index(p) for p in pools]
        return market.spot_price[-1, index], market.available[-1, index]

    def _slots(self, now: datetime, hours: float, pools: Sequence[str] | None = None) -> SlotMarket:
        """Whole slots over the last ``hours``, the last one starting at ``now``: a pool whose newest
        tick is older than the hole threshold counts as unavailable now, whatever it last said.
        The on-demand price is the cheapest of ``pools``' (those with ticks) now."""
        now = now.astimezone(timezone.utc)
        trace = self.source.observe(now - timedelta(hours=hours), now)
        if not trace.pools:
            raise NoMarketData(
                f"the market source returned no ticks between {now - timedelta(hours=hours):%Y-%m-%d %H:%M} and "
                f"{now:%Y-%m-%d %H:%M} UTC: no pool had both a spot price and availability evidence (a placement "
                "score or a recorded launch) in force; check the market connection (market_conn_id) and the pools' regions"
            )
        market = resample_until(trace, now, self.slot_hours)
        priced = [p for p in pools or () if p in trace.pools]
        if not priced:
            return market
        return replace(market, on_demand_price=resample_until(trace, now, self.slot_hours, priced).on_demand_price)


class ReplayedMarket(MarketFeed):
    """A trace in slots: ``history_slots`` before submission, then the slots the run replays."""

    def __init__(self, trace: Trace, slot_hours: float, history_slots: int, start: datetime | None = None) -> None:
        first = datetime.fromtimestamp(trace.first_time, timezone.utc)
        chosen = start is not None
        start = start or first + timedelta(hours=history_slots * slot_hours)
        origin = start - timedelta(hours=history_slots * slot_hours)
        if origin < first:
            raise ValueError(
                f"market_start {format_timestamp(start)} leaves fewer than history_slots={history_slots} slots of "
                f"{trace.source} before it; choose a market_start at or after "
                f"{format_timestamp(first + timedelta(hours=history_slots * slot_hours))}"
            )
        self.trace, self.start, self.history_slots = trace, start, history_slots
        self.market: SlotMarket = resample(trace, origin, slot_hours)
        if self.market.num_slots <= history_slots:
            if not chosen:  # the default start is history_slots into the trace: the trace is too short
                total = resample(trace, first, slot_hours).num_slots
                raise ValueError(
                    f"{trace.source} holds {total} slot(s) of {slot_hours:g} h; a replay needs more than "
                    f"history_slots={history_slots} of them: give a smaller history_slots (--history-slots) or a longer trace"
                )
            raise ValueError(f"market_start {format_timestamp(start)} lies at the end of {trace.source}; choose an earlier one")

    def history(self, now: datetime, pools: Sequence[str] | None = None) -> SlotMarket:
        """The slots up to submission; ``self.market``'s on-demand price is the one at its first slot,
        so the job's is read again at submission, for its pools (as the simulator's job market)."""
        priced = [p for p in pools or () if p in self.market.pools] or None
        at_submission = resample(self.trace, self.start, self.market.slot_hours, 1, priced).on_demand_price
        return replace(self.market.prefix(self.history_slots + 1), on_demand_price=at_submission)

    def row(self, slot: int, pools: Sequence[str], now: datetime) -> tuple[np.ndarray, np.ndarray]:
        """Row ``slot`` of the replay; past the trace's end the last row holds (as the backend's clock)."""
        index = [self.market.pools.index(p) for p in pools]
        row = min(self.history_slots + slot, self.market.num_slots - 1)
        return self.market.spot_price[row, index], self.market.available[row, index]

    def replay(self) -> SlotMarket:
        """The slots from submission on: what the local backend's spot pools obey."""
        return self.market.window(self.history_slots)
