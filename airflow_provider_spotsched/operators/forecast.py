"""The forecast step on its own: market history in, the ``spotsched forecast`` document out.

For DAGs that want each step of the scheduler visible (and its output inspectable in XCom),
this operator does what ``spotsched forecast --at`` does: it cuts the market at ``at`` (nothing
later is read), forecasts the next ``horizon`` slots of every pool and returns the same JSON
document (:func:`~airflow_provider_spotsched.forecast.snapshot.forecast_document`), which
:class:`~airflow_provider_spotsched.operators.solver.SpotAllocationSolverOperator` and any
downstream task can read from XCom.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from airflow.sdk import BaseOperator

from airflow_provider_spotsched.forecast import LIVE_FORECASTERS, make_forecaster
from airflow_provider_spotsched.forecast.snapshot import (
    DEFAULT_HISTORY_HOURS,
    MAX_HORIZON,
    MAX_STALENESS_HOURS,
    check_history_hours,
    forecast_document,
    slot_snapshot_at,
)
from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.market.slots import pool_names
from airflow_provider_spotsched.market.trace import parse_instant
from airflow_provider_spotsched.scheduling.model import check_field


class SpotMarketForecastOperator(BaseOperator):
    """Forecast every pool's spot price and availability from ``at``; the document goes to XCom.

    :param market: the market: a :class:`MarketSpec`, its dict, or a trace name or path
        (``"gcp"``, ``"aws"``, ``/data/trace.csv.gz``).
    :param pools: the pools to forecast: a list, or one comma-separated string (what a template
        renders to); default every pool of the market.
    :param slot_hours: slot length in hours.
    :param at: the instant to forecast from (templated; a datetime or an ISO-8601 string);
        default the run's logical date, or now for a run without one. It may be up to
        ``max_staleness_hours`` later than the market's newest tick (live data lags the clock);
        the document then says how stale the data was (``staleness_seconds``).
    :param model: a forecaster of a live market (default ``"auto"``: a model chosen per pool); not
        the ``"oracle"``, which reads the future.
    :param horizon: slots to forecast, 1..48.
    :param at_least: counts n for which the document gives P(available >= n) (1 always).
    :param history_hours: hours of history before ``at`` to read: a day or more (a forecast needs
        a day of slots), at least one slot before ``at``'s where a slot is longer.
    :param max_staleness_hours: how far ``at`` may lie after the newest tick.
    """

    template_fields: Sequence[str] = ("at", "pools")
    ui_color = "#cfe8f3"

    def __init__(
        self,
        *,
        market: MarketSpec | Mapping[str, Any] | str,
        pools: Sequence[str] | str | None = None,
        slot_hours: float = 1.0,
        at: datetime | str | None = None,
        model: str = "auto",
        horizon: int = 24,
        at_least: Sequence[int] = (),
        history_hours: float = DEFAULT_HISTORY_HOURS,
        max_staleness_hours: float = MAX_STALENESS_HOURS,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if model not in LIVE_FORECASTERS:  # the oracle reads the future: refused here, not when the task runs
            raise ValueError(f"model={model!r}: not a forecaster of a live market; choose one of {sorted(LIVE_FORECASTERS)}")
        if isinstance(horizon, bool) or not isinstance(horizon, int) or not 1 <= horizon <= MAX_HORIZON:
            raise ValueError(f"horizon must be 1..{MAX_HORIZON} slots, got {horizon!r}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in at_least):
            raise ValueError(f"at_least must hold instance counts >= 1, got {list(at_least)!r}")
        check_field("slot_hours", slot_hours)  # a minute or more: a slot of 1e-9 h would ask for terabytes of slots
        check_history_hours(history_hours, slot_hours)  # a day or more: less would fail every run
        if isinstance(max_staleness_hours, bool) or not isinstance(max_staleness_hours, (int, float)) \
                or not max_staleness_hours >= 0:
            raise ValueError(f"max_staleness_hours must be a number >= 0, got {max_staleness_hours!r}")
        self.market = MarketSpec.coerce(market)
        self.pools = pools
        self.slot_hours = float(slot_hours)
        self.at = at
        self.model = model
        self.horizon = horizon
        self.at_least = tuple(at_least)
        self.history_hours = float(history_hours)
        self.max_staleness_hours = float(max_staleness_hours)

    def execute(self, context: Any) -> dict[str, Any]:
        at = forecast_instant(self.at, context)
        pools = None if self.pools is None or self.pools == "" else pool_names(self.pools)  # not a string's letters
        snapshot = slot_snapshot_at(self.market, at, self.slot_hours, pools, self.history_hours, self.max_staleness_hours)
        market = snapshot.market
        forecaster = make_forecaster(self.model, slot_hours=market.slot_hours)
        forecast = forecaster.forecast(market, self.horizon)
        document = forecast_document(forecast, market, at, self.at_least, forecaster.name, snapshot)
        self.log.info("forecast of %d slots after %s for %s", self.horizon, document["at"], ", ".join(market.pools))
        return document


def forecast_instant(at: datetime | str | None, context: Any) -> datetime:
    """``at`` as given, else the run's logical date, else now (a run without a logical date)."""
    if at is not None and at != "":
        return parse_instant(at, "at")
    logical = context.get("logical_date")
    return parse_instant(logical, "logical_date") if logical is not None else datetime.now(timezone.utc)
