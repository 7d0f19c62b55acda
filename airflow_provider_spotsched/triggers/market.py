"""Waits, in the triggerer, until the spot market is worth starting on; or falls back to on-demand.

A :class:`SpotMarketTrigger` polls cheaply: one market observation per ``poll_interval`` (in a
thread: a cloud source makes API calls), then an ``asyncio.sleep``. The market is worth
starting on when any condition of :class:`StartConditions` holds, checked cheapest first:

- ``price``: a pool's spot price is under ``price_below`` and it has an instance to offer;
- ``availability``: in some pool, P(available >= ``min_available``) >= ``min_probability`` in
  each of the next ``hours_ahead`` hours, by the forecaster (forecasting runs in a thread);
- ``plan``: the scheduler, started now on ``job``, runs the job's first slot on spot
  (an :class:`~airflow_provider_spotsched.scheduling.online.OnlineRun` decides it).

At ``timeout_at`` it does not fail: it fires ``reason="timeout"`` with ``fallback="on-demand"``
so the downstream task starts on on-demand. A failed observation (a throttled or dropped call to
the market source) is logged and retried at the next poll; ``OBSERVE_FAILURES_TO_FAIL`` in a row
fail the wait with the last error (a source that is down), and so does at once a source that
refuses its input before it ever answered (misconfigured: :func:`misconfigured`). Every argument
is plain data and the instants are
absolute ISO strings (the timeout, the replay clock's origin), so a triggerer that restarts
rebuilds the trigger from :meth:`SpotMarketTrigger.serialize` and waits for the same instant.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_spotsched.forecast import LIVE_FORECASTERS, make_forecaster
from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.market.feed import LiveMarketFeed, NoMarketData, check_feed_history
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.market.trace import format_timestamp, parse_instant
from airflow_provider_spotsched.scheduling.model import Job
from airflow_provider_spotsched.scheduling.online import OnlineRun, RunConfig

PRICE, AVAILABILITY, PLAN, TIMEOUT = "price", "availability", "plan", "timeout"
OBSERVE_FAILURES_TO_FAIL = 5  # market observations failed in a row that fail the wait
ON_DEMAND = "on-demand"


def check_live_forecaster(forecaster: str) -> None:
    """Refuse a forecaster that cannot forecast a live market (the oracle reads the future): the
    sensor calls it when the DAG is parsed, the conditions again before the wait."""
    if forecaster not in LIVE_FORECASTERS:
        raise ValueError(f"forecaster={forecaster!r}: not a forecaster of a live market; choose one of {sorted(LIVE_FORECASTERS)}")


def misconfigured(error: Exception, answered: bool) -> bool:
    """Whether a failed observation says the source is misconfigured (fail the wait at once) rather
    than that a call was dropped (retry): a ``ValueError`` (a missing trace, options the source
    refuses) from a source that has never answered. One that has answered before refuses only what
    it was sent this time (a page cut short, parts compacted while read), and a ``ValueError`` that
    is also an ``OSError`` (requests' ``JSONDecodeError`` of a truncated body) is a dropped call."""
    return isinstance(error, ValueError) and not isinstance(error, OSError) and not answered


@dataclass(frozen=True)
class StartConditions:
    """When a market is worth starting on (see the module docstring); ``None`` turns one off."""

    price_below: float | None = None
    min_available: int | None = None
    min_probability: float = 0.8
    hours_ahead: float = 4.0
    forecaster: str = "markov-count"
    job: Mapping[str, Any] | None = None
    policy: str = "chc"
    policy_params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.price_below is None and self.min_available is None and self.job is None:
            raise ValueError("no start condition: give price_below, min_available or job (the scheduler's plan)")
        if self.price_below is not None and not (isinstance(self.price_below, (int, float)) and self.price_below > 0):
            raise ValueError(f"price_below must be a spot price > 0 (USD per instance-hour), got {self.price_below!r}")
        count = self.min_available
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"min_available must be an instance count >= 1, got {self.min_available!r}")
        if not 0 < self.min_probability <= 1:
            raise ValueError(f"min_probability must be in (0, 1], got {self.min_probability!r}")
        if not self.hours_ahead > 0:
            raise ValueError(f"hours_ahead must be > 0, got {self.hours_ahead!r}")
        check_live_forecaster(self.forecaster)
        if self.job is not None:
            Job.from_dict(self.job).check_feasible()

    def price(self, market: SlotMarket) -> dict[str, Any] | None:
        """The cheapest pool now under ``price_below`` with an instance to offer."""
        if self.price_below is None:
            return None
        price, available = market.spot_price[-1], market.available[-1]
        offered = [m for m in range(market.num_pools) if available[m] > 0 and price[m] < self.price_below]
        if not offered:
            return None
        best = min(offered, key=lambda m: price[m])
        return {"pool": market.pools[best], "spot_price": float(price[best]), "available": int(available[best])}

    def availability(self, market: SlotMarket) -> dict[str, Any] | None:
        """The pool most likely to offer ``min_available`` instances in every slot ahead."""
        if self.min_available is None:
            return None
        slots = max(1, math.ceil(self.hours_ahead / market.slot_hours - 1e-9))
        forecast = make_forecaster(self.forecaster, slot_hours=market.slot_hours).forecast(market, slots)
        chance = forecast.p_available_at_least(self.min_available)
        worst = chance.min(axis=0)
        best = int(np.argmax(worst))
        if worst[best] < self.min_probability:
            return None
        return {"pool": market.pools[best], "probability": float(worst[best]), "slots": slots}

    def plan(self, market: SlotMarket, pools: Sequence[str], now: datetime) -> dict[str, Any] | None:
        """This slot's allocation when the scheduler, started now, runs the job on spot."""
        if self.job is None:
            return None
        job = Job.from_dict(dict(self.job, slot_hours=market.slot_hours))
        config = RunConfig("market-sensor", job, tuple(pools), self.policy, dict(self.policy_params))
        record = OnlineRun.start(config, market, now).decide(0.0, now)
        if not sum(record.allocation["spot"].values()):
            return None
        return {"allocation": record.allocation, "plan": record.plan}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["job"] = dict(self.job) if self.job is not None else None
        data["policy_params"] = dict(self.policy_params)
        return data


class SpotMarketTrigger(BaseTrigger):
    """Fires once: when a start condition holds, or at ``timeout_at`` with the on-demand fallback.

    :param market: a :class:`MarketSpec` as a dict.
    :param pools: the pools to watch.
    :param conditions: :class:`StartConditions` as a dict.
    :param timeout_at: ISO-8601 UTC instant after which the trigger falls back to on-demand.
    :param slot_hours: slot length in hours.
    :param poll_interval: seconds between market observations.
    :param history_hours: hours of market history read at each poll (the forecaster's input).
    :param replay: for a trace replayed on an accelerated clock: ``{"origin": wall-clock ISO
        instant, "market_start": trace ISO instant at origin, "seconds_per_slot": s}``; ``None``
        for a live market, whose time is the wall clock.
    """

    def __init__(
        self,
        market: Mapping[str, Any],
        pools: Sequence[str],
        conditions: Mapping[str, Any],
        timeout_at: str,
        slot_hours: float = 1.0,
        poll_interval: float = 300.0,
        history_hours: float = 72.0,
        replay: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        if not pools:
            raise ValueError("pools is empty: name the spot pools to watch")
        self.market = MarketSpec.from_dict(market).to_dict()
        self.pools = list(pools)
        self.conditions = StartConditions(**conditions).to_dict()
        self.timeout_at = format_timestamp(parse_instant(timeout_at, "timeout_at"))
        self.slot_hours = float(slot_hours)
        self.poll_interval = float(poll_interval)
        self.history_hours = float(history_hours)
        self.replay = dict(replay) if replay else None
        if self.replay is not None:
            ReplayClock.from_dict(self.replay)
        check_feed_history(self.slot_hours, self.history_hours)  # before the task defers, not in run()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "market": self.market,
                "pools": self.pools,
                "conditions": self.conditions,
                "timeout_at": self.timeout_at,
                "slot_hours": self.slot_hours,
                "poll_interval": self.poll_interval,
                "history_hours": self.history_hours,
                "replay": self.replay,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        conditions = StartConditions(**self.conditions)
        feed = LiveMarketFeed(MarketSpec.from_dict(self.market), self.slot_hours, self.history_hours)
        clock = ReplayClock.from_dict(self.replay) if self.replay else None
        timeout_at = parse_instant(self.timeout_at, "timeout_at")
        failures = 0  # observations failed in a row
        answered = False  # whether the source has answered once: until then a refusal is its configuration
        while True:
            now = datetime.now(timezone.utc)
            if now >= timeout_at:
                yield TriggerEvent(self._event(TIMEOUT, now, None, {"timeout_at": self.timeout_at}))
                return
            market_now = clock.market_time(now) if clock else now
            try:
                market = await asyncio.to_thread(self._observe, feed, market_now)
            except Exception as error:
                if misconfigured(error, answered):
                    raise
                failures += 1
                if failures >= OBSERVE_FAILURES_TO_FAIL:
                    raise RuntimeError(
                        f"the market source failed {failures} times in a row, the last: {type(error).__name__}: {error}; "
                        "check the market's connection and options"
                    ) from error
                self.log.warning("market observation failed (%d in a row), retrying at the next poll: %s", failures, error)
                market = None
            else:
                failures, answered = 0, True
            if market is not None:
                reason, found = PRICE, conditions.price(market)
                if found is None:
                    reason, found = AVAILABILITY, await asyncio.to_thread(conditions.availability, market)
                if found is None:
                    reason, found = PLAN, await asyncio.to_thread(conditions.plan, market, self.pools, market_now)
                if found is not None:
                    yield TriggerEvent(self._event(reason, now, market_now, found))
                    return
            left = (timeout_at - datetime.now(timezone.utc)).total_seconds()
            await asyncio.sleep(max(min(self.poll_interval, left), 0.0))

    def _observe(self, feed: LiveMarketFeed, market_now: datetime) -> SlotMarket | None:
        """The watched pools' slots ending with the state in force at ``market_now``; ``None`` while
        no pool has any evidence. A watched pool without ticks counts as unavailable (unknown
        availability is 0, never a guess) at the on-demand price, so no condition holds on it (a
        pool the market does not offer at all is refused before the wait, :meth:`MarketSpec.check_offers`)."""
        try:
            market = feed.history(market_now, self.pools)
        except NoMarketData as exc:
            self.log.warning("%s; waiting for evidence", exc)
            return None
        missing = [p for p in self.pools if p not in market.pools]
        if missing:
            self.log.warning("no ticks for pool(s) %s in the last %g h: counted as unavailable", missing, self.history_hours)
        slots = market.num_slots
        prices = [market.spot_price[:, market.pools.index(p)] if p in market.pools else np.full(slots, market.on_demand_price)
                  for p in self.pools]
        counts = [market.available[:, market.pools.index(p)] if p in market.pools else np.zeros(slots, dtype=np.int64)
                  for p in self.pools]
        return SlotMarket(
            pools=tuple(self.pools),
            start=market.start,
            slot_hours=market.slot_hours,
            spot_price=np.stack(prices, axis=1),
            available=np.stack(counts, axis=1),
            on_demand_price=market.on_demand_price,
        )

    @staticmethod
    def _event(reason: str, now: datetime, market_now: datetime | None, details: dict[str, Any]) -> dict[str, Any]:
        return {
            "start": True,
            "reason": reason,
            "fallback": ON_DEMAND if reason == TIMEOUT else None,
            "time": now.isoformat(),
            "market_time": format_timestamp(market_now) if market_now else None,
            "details": details,
        }


@dataclass(frozen=True)
class ReplayClock:
    """Market time of a trace replayed from ``market_start`` at wall-clock ``origin``."""

    origin: datetime
    market_start: datetime
    seconds_per_slot: float
    slot_hours: float = 1.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplayClock:
        unknown = sorted(set(data) - {"origin", "market_start", "seconds_per_slot", "slot_hours"})
        if unknown:
            raise ValueError(f"replay: unknown field(s) {unknown}; use origin, market_start, seconds_per_slot, slot_hours")
        seconds = data.get("seconds_per_slot")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"replay: seconds_per_slot must be a number of seconds > 0, got {seconds!r}")
        return cls(
            parse_instant(data.get("origin", ""), "replay origin"),
            parse_instant(data.get("market_start", ""), "replay market_start"),
            float(seconds),
            float(data.get("slot_hours", 1.0)),
        )

    def market_time(self, now: datetime) -> datetime:
        elapsed = (now - self.origin).total_seconds() / self.seconds_per_slot * self.slot_hours
        return self.market_start + timedelta(hours=elapsed)
