"""Wait until the spot market is worth starting on, holding no worker slot while it waits.

:class:`SpotMarketSensor` defers at once to a
:class:`~airflow_provider_spotsched.triggers.market.SpotMarketTrigger`, which polls the market
in the triggerer until a start condition holds (a spot price under a threshold, n instances
likely available over the next hours, or the scheduler's plan starting the job on spot).

Its ``timeout`` does not fail the task: a job with a deadline cannot wait for a cheap market
forever, so at the timeout the sensor succeeds with ``{"start": true, "reason": "timeout",
"fallback": "on-demand"}`` and the downstream task starts on on-demand. The event is the
sensor's return value (XCom), whatever the reason, so downstream can branch on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import BaseSensorOperator
from airflow.sdk.exceptions import AirflowSkipException, AirflowTaskTimeout

from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.hooks.rendered import rendered_job, rendered_number
from airflow_provider_spotsched.market.feed import check_feed_history
from airflow_provider_spotsched.market.slots import pool_names
from airflow_provider_spotsched.market.trace import format_timestamp, parse_instant
from airflow_provider_spotsched.triggers.market import SpotMarketTrigger, StartConditions, check_live_forecaster

DEFAULT_TIMEOUT = timedelta(hours=6)
DEFAULT_POKE_INTERVAL = 300.0


class SpotMarketSensor(BaseSensorOperator):
    """Succeeds when the market is worth starting on, or at ``timeout`` with the on-demand fallback.

    Conditions (any one suffices; give at least one):

    :param price_below: a pool's spot price under this (USD per instance-hour), with capacity.
    :param min_available: n: in some pool P(available >= n) >= ``min_probability`` in each of the
        next ``hours_ahead`` hours, by ``forecaster``.
    :param job: the spec's job fields: the scheduler (``policy``, default ``"chc"``), started
        now on this job, runs its first slot on spot. A dict, or its JSON text (a template
        rendered with ``| tojson``); numbers rendered to text inside it are read as numbers.

    The market and the wait:

    :param market: a :class:`MarketSpec`, its dict, or a trace name or path.
    :param pools: the spot pools to watch; each must be a pool of the market (a trace market's are
        checked before the wait, a live one's on the trigger's first observation).
    :param timeout: how long to wait before falling back to on-demand (default 6 hours).
    :param poke_interval: seconds between market observations (default 300).
    :param slot_hours: slot length in hours (default 1).
    :param history_hours: hours of market history read at each observation, at least one slot
        (default 72).
    :param market_start: for a replayed trace: the trace instant the replay starts from; with
        ``seconds_per_slot`` wall-clock seconds per slot (demos and tests). ``None``: live time.
    :param deferrable: wait in the triggerer (default); ``False`` runs the same loop in the worker,
        ``mode="poke"`` only, and a failed wait is skipped under ``soft_fail``/``never_fail`` as a
        failed trigger is.
    """

    template_fields: Sequence[str] = ("pools", "price_below", "min_available", "job", "market_start")
    ui_color = "#fde2c3"

    def __init__(
        self,
        *,
        market: MarketSpec | Mapping[str, Any] | str,
        pools: Sequence[str],
        price_below: float | None = None,
        min_available: int | None = None,
        min_probability: float = 0.8,
        hours_ahead: float = 4.0,
        forecaster: str = "markov-count",
        job: Mapping[str, Any] | None = None,
        policy: str = "chc",
        policy_params: Mapping[str, Any] | None = None,
        slot_hours: float = 1.0,
        history_hours: float = 72.0,
        market_start: datetime | str | None = None,
        seconds_per_slot: float | None = None,
        deferrable: bool = True,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        poke_interval: timedelta | float = DEFAULT_POKE_INTERVAL,
        **kwargs: Any,
    ) -> None:
        super().__init__(timeout=timeout, poke_interval=poke_interval, **kwargs)
        if self.reschedule and not deferrable:
            raise ValueError(
                "mode='reschedule' with deferrable=False: the wait runs in the worker and would hold it to the end; "
                "use deferrable=True (the wait holds no worker slot) or mode='poke'"
            )
        if (market_start is None) != (seconds_per_slot is None):
            raise ValueError("market_start and seconds_per_slot go together (a replayed trace); give both or neither")
        self.market = MarketSpec.coerce(market)
        self.pools = pools
        self.price_below, self.min_available, self.min_probability = price_below, min_available, min_probability
        check_live_forecaster(forecaster)  # not templated: refused when the DAG is parsed
        self.hours_ahead, self.forecaster = hours_ahead, forecaster
        self.job, self.policy, self.policy_params = job, policy, policy_params
        self.slot_hours, self.history_hours = float(slot_hours), float(history_hours)
        check_feed_history(self.slot_hours, self.history_hours)  # when the DAG is parsed
        self.market_start, self.seconds_per_slot = market_start, seconds_per_slot
        self.deferrable = deferrable

    def execute(self, context: Any) -> dict[str, Any]:
        trigger = self.trigger(datetime.now(timezone.utc))
        if self.deferrable:
            self.defer(trigger=trigger, method_name="execute_complete")
        try:
            event = asyncio.run(first_event(trigger))
        except (Exception, AirflowTaskTimeout) as error:
            # as a failed trigger resumes a deferred sensor (BaseSensorOperator.resume_execution)
            if self.soft_fail or self.never_fail:
                raise AirflowSkipException(f"Skipping: the market wait failed ({type(error).__name__}: {error})") from error
            raise
        return self.execute_complete(context, event)

    def execute_complete(self, context: Any, event: Mapping[str, Any]) -> dict[str, Any]:
        """The trigger's event is the result: why to start, and on what."""
        if event["reason"] == "timeout":
            self.log.warning("no start condition held by %s: falling back to on-demand", event["details"]["timeout_at"])
        else:
            self.log.info("market worth starting on (%s): %s", event["reason"], event["details"])
        return dict(event)

    def trigger(self, now: datetime) -> SpotMarketTrigger:
        """The trigger for a wait starting at ``now``; its timeout is the absolute ``now + timeout``.
        A pool that a trace market lacks is refused here, before the wait."""
        price, count = self.price_below, self.min_available  # templated: text unless the DAG renders native objects
        conditions = StartConditions(
            price_below=None if price in (None, "") else rendered_number("price_below", price),
            min_available=None if count in (None, "") else rendered_number("min_available", count, integer=True),
            min_probability=self.min_probability,
            hours_ahead=self.hours_ahead,
            forecaster=self.forecaster,
            job=rendered_job("job", self.job),
            policy=self.policy,
            policy_params=dict(self.policy_params or {}),
        )
        replay = None
        if self.market_start is not None:
            if self.seconds_per_slot is None:  # __init__ takes both or neither
                raise ValueError("market_start and seconds_per_slot go together (a replayed trace); give both or neither")
            replay = {
                "origin": now.isoformat(),
                "market_start": format_timestamp(parse_instant(self.market_start, "market_start")),
                "seconds_per_slot": float(self.seconds_per_slot),
                "slot_hours": self.slot_hours,
            }
        pools = list(pool_names(self.pools))  # a rendered template gives 'a,b'
        self.market.check_offers(pools)
        return SpotMarketTrigger(
            market=self.market.to_dict(),
            pools=pools,
            conditions=conditions.to_dict(),
            timeout_at=(now + timedelta(seconds=self.timeout)).isoformat(),
            slot_hours=self.slot_hours,
            poll_interval=self.poke_interval,
            history_hours=self.history_hours,
            replay=replay,
        )


async def first_event(trigger: SpotMarketTrigger) -> dict[str, Any]:
    """The trigger's one event (what the triggerer would hand back to the task)."""
    async for event in trigger.run():
        return event.payload
    raise RuntimeError("the market trigger ended without an event")
