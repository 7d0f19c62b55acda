"""Committed horizon control (CHC): the prediction-based algorithm of arXiv 2512.20967.

Each time its commitment runs out, CHC forecasts the slots ahead (the current slot's prices
and availability are known exactly and lead the window), solves the next ``window`` slots
exactly with :func:`~airflow_provider_spotsched.scheduling.planner.solve_plan`, and commits to
the plan's first ``commit`` slots. Committing to several slots keeps the schedule from
reconfiguring on every forecast wobble; re-planning keeps it close to the news.

A window that ends before the job's horizon prices the work it leaves unfinished
(``terminal_price``) and must end in a state from which N_max on-demand instances still meet
the soft deadline. With ``uncertainty="quantile"`` each forecast slot is planned on what the
forecast gives with probability >= ``level``: per pool, the largest spot count
(:meth:`~airflow_provider_spotsched.forecast.base.Forecast.available_at_level`) and the price not
exceeded (:meth:`~airflow_provider_spotsched.forecast.base.Forecast.spot_price_at_level`). What
the forecast is unsure of is kept in reserve (planned on on-demand, or not deferred to), so the
reserve grows with the forecast's uncertainty and vanishes where it is certain; the planner stays
the exact one. A committed slot that held spot in reserve is re-planned when the market offers
more than it counted on, so that a cautious plan never buys on-demand next to spot it merely
doubted. Ties in the plan go to spot now and to the running allocation (``early_preference``:
a restart the forecast puts later waits for it), and on-demand waits while the job keeps pace
(``defer_on_demand``): a planned slot's on-demand instances are dropped, and the rest
re-planned next slot, while its spot alone keeps the job on Uniform Progress's line and
deadline-safe with a slot to spare. Reality overrides the plan: a committed allocation that
exceeds what the market offers now triggers a re-plan on the spot, and every decision passes
:func:`~airflow_provider_spotsched.scheduling.rules.is_deadline_safe` or becomes the safety net's
allocation (:func:`~airflow_provider_spotsched.scheduling.rules.safety_net_allocation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast import make_forecaster
from airflow_provider_spotsched.forecast.base import Forecaster
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import WORK_EPSILON, Allocation, Job
from airflow_provider_spotsched.scheduling.planner import CostLimit, PlanError, PlanRequest, solve_plan
from airflow_provider_spotsched.scheduling.policies.uniform_progress import expected_progress
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.rules import (
    cheapest_allocation,
    fits,
    is_deadline_safe,
    on_demand_fallback,
    safety_net_allocation,
    slot_progress,
    spot_only,
)

PLANNED_PRICE_DECIMALS = 6
"""Forecast prices are planned on to a millionth of a USD an hour, far below any real price step.
Fits of zones whose prices tie (a cloud's zones at one price) forecast that price to within
float noise, and the noise differs between CPUs (OpenBLAS picks its kernels by the CPU), so
unrounded it would decide which of the tied zones a plan takes, and a rerun on another machine
would schedule differently. Rounded, the tie is exact and the plan's own tie-breaks decide."""
CostLimitSource = Callable[[Observation, np.ndarray, np.ndarray], CostLimit]
"""What a cost guard gives CHC to plan within: the limit over a window of these prices and
available counts (row 0 the current slot)."""
TERMINAL_PRICES = ("marginal", "on-demand")
DEFAULT_EARLY_PREFERENCE = 0.001
"""Per slot, the share by which a window's spot prices rise with lead time in the plan (and the
terminal price of work deferred past the window, when spot prices it), and the share of a
restart's cost added to a plan that leaves the running allocation now: tie-breaks, far below
real price differences, so that at equal forecast cost spot work runs now rather than later and
a restart is made when it is needed rather than now."""
UNCERTAINTY = ("none", "quantile")


class CHCPolicy(Policy):
    """Plan ``window`` slots on a forecast, commit to ``commit`` of them, re-plan."""

    name = "chc"
    plans_within_guard = True
    """Under a cost guard, plan within its bound (the guard sets :attr:`cost_limit`)."""

    def __init__(
        self,
        window: int = 24,
        commit: int = 4,
        forecaster: str = "seasonal-naive",
        error: float = 0.0,
        seed: int = 0,
        lead: int | None = None,
        reveals: str = "all",
        terminal_price: str | float = "marginal",
        uncertainty: str = "none",
        level: float | None = None,
        early_preference: float = DEFAULT_EARLY_PREFERENCE,
        defer_on_demand: bool | None = None,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window must be an integer >= 1 (slots planned ahead), got {window!r}")
        if isinstance(commit, bool) or not isinstance(commit, (int, np.integer)) or not 1 <= commit <= window:
            raise ValueError(
                f"commit must be an integer in [1, window={window}] (slots committed per plan), got {commit!r}"
            )
        named = isinstance(terminal_price, str) and terminal_price in TERMINAL_PRICES
        number = (
            not isinstance(terminal_price, (bool, str))
            and isinstance(terminal_price, (int, float))
            and terminal_price >= 0
        )
        if not (named or number):
            raise ValueError(
                f"terminal_price must be one of {TERMINAL_PRICES} or a number >= 0 (USD per work unit), "
                f"got {terminal_price!r}"
            )
        if forecaster != "oracle" and (error or seed or lead is not None or reveals != "all"):
            raise ValueError(
                f"error, seed, lead and reveals apply to the oracle forecaster only; drop them for forecaster={forecaster!r}"
            )
        if uncertainty not in UNCERTAINTY:
            raise ValueError(
                f"uncertainty must be one of {UNCERTAINTY} (plan on the point forecast, or on the spot "
                f"capacity and price the forecast gives with probability >= level), got {uncertainty!r}"
            )
        if uncertainty == "quantile":
            if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
                raise ValueError(
                    "level must be a probability in (0, 1) with uncertainty='quantile' (plan only on spot "
                    f"available with at least this probability), got {level!r}"
                )
        elif level is not None:
            raise ValueError(f"level applies to uncertainty='quantile' only; drop it for uncertainty={uncertainty!r}")
        if isinstance(early_preference, bool) or not isinstance(early_preference, (int, float)) or not 0 <= early_preference < 0.1:
            raise ValueError(
                "early_preference must be a number in [0, 0.1) (the share per slot by which later spot is "
                f"planned dearer, a tie-break; 0 plans on the forecast as it is), got {early_preference!r}"
            )
        if defer_on_demand is not None and not isinstance(defer_on_demand, bool):
            raise ValueError(
                f"defer_on_demand must be true, false or null (true unless the forecaster is the oracle), got {defer_on_demand!r}"
            )
        params = {"error": error, "seed": seed, "lead": lead, "reveals": reveals} if forecaster == "oracle" else {}
        self.early_preference = float(early_preference)
        self.uncertainty, self.level = uncertainty, level
        self.window, self.commit = int(window), int(commit)
        self.terminal_price = terminal_price
        self.forecaster_name, self._forecaster_params = forecaster, params
        self.forecaster: Forecaster = make_forecaster(forecaster, params)
        self._built, self._built_for = self.forecaster, 1.0  # the forecaster CHC built, for slots of these hours
        self.uses_future = self.forecaster.uses_future
        # Waiting for spot to come back is a hedge against the forecast; the oracle's is the truth.
        self.defer_on_demand = not self.uses_future if defer_on_demand is None else defer_on_demand
        self._defer_default = defer_on_demand is None
        self.cost_limit: CostLimitSource | None = None
        """Set by a cost guard around CHC: every plan keeps the guard's bound on the forecast,
        so where the forecast is right the guard never overrules it (``docs/guard.md``)."""
        self._committed: list[Allocation] = []
        # Per committed slot and pool: the spot capacity counted on where some was held in
        # reserve, else inf (nothing held back, so more spot is no news).
        self._counted: list[np.ndarray] = []

    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"window": self.window, "commit": self.commit, "forecaster": self.forecaster_name}
        if self.forecaster_name == "oracle":
            params.update(self.forecaster.params())
        params["terminal_price"] = self.terminal_price
        if self.uncertainty != "none":
            params.update(uncertainty=self.uncertainty, level=self.level)
        if self.early_preference != DEFAULT_EARLY_PREFERENCE:
            params["early_preference"] = self.early_preference
        if not self._defer_default:
            params["defer_on_demand"] = self.defer_on_demand
        return params

    def reset(self, job: Job) -> None:
        self._committed, self._counted = [], []
        if self.forecaster is self._built and job.slot_hours != self._built_for:
            # A daily season of the job's slots; a forecaster a caller put in its place is kept.
            self.forecaster = self._built = make_forecaster(self.forecaster_name, self._forecaster_params, job.slot_hours)
            self._built_for = job.slot_hours

    def planned(self) -> list[Allocation]:
        return list(self._committed)

    def reveal(self, market: SlotMarket) -> None:
        """Forward the realised market to a forecaster that needs it (the oracle)."""
        self.forecaster.reveal(market)

    def decide(self, observation: Observation) -> Allocation:
        job = observation.job
        if self._committed and (not fits(self._committed[0], observation.available) or np.any(observation.available > self._counted[0])):
            self._committed, self._counted = [], []
        if not self._committed:
            self._committed, self._counted = self._plan(observation)
        choice = self._committed.pop(0)
        self._counted.pop(0)
        waiting = self._waiting(observation, choice) if self.defer_on_demand and choice.on_demand else None
        if waiting is not None:
            self._committed, self._counted = [], []
            choice = waiting
        if not is_deadline_safe(job, observation, choice):
            self._committed, self._counted = [], []
            return safety_net_allocation(observation)
        return choice

    def _waiting(self, observation: Observation, choice: Allocation) -> Allocation | None:
        """``choice`` without its on-demand instances, if that keeps the job on Uniform Progress's
        line L*t/d at the slot's end and deadline-safe with a slot to spare; else None."""
        job = observation.job
        spot = spot_only(choice, job)
        after = observation.work_done + slot_progress(job, spot, observation.previous)
        on_line = after >= expected_progress(job, observation.hours + job.slot_hours) - WORK_EPSILON
        return spot if on_line and is_deadline_safe(job, observation, spot, margin_hours=job.slot_hours) else None

    def _plan(self, observation: Observation) -> tuple[list[Allocation], list[np.ndarray]]:
        """Solve the window from now: the committed allocations and the capacity each counted on."""
        try:
            request, held = self._window(observation)
        except PlanError:  # a window no plan can be asked for (e.g. a forecast gap): the fallback
            return [on_demand_fallback(observation.job, observation.past.num_pools)], [np.full(observation.past.num_pools, np.inf)]
        # Where the forecast leaves no plan within a guard's bound, plan without it: the guard
        # then overrules, slot by slot, what would break the bound.
        attempts = [request] if request.cost_limit is None else [request, replace(request, cost_limit=None)]
        for attempt in attempts:
            try:
                plan = solve_plan(attempt)
            except PlanError:
                continue
            return plan.allocations[: self.commit], list(held[: self.commit])
        return [on_demand_fallback(observation.job, observation.past.num_pools)], [held[0]]

    def window_request(self, observation: Observation) -> PlanRequest:
        """The planning problem CHC solves at this observation: the window on the forecast."""
        return self._window(observation)[0]

    def _window(self, observation: Observation) -> tuple[PlanRequest, np.ndarray]:
        """The window's planning problem, and per slot and pool the capacity counted on where
        some was held in reserve (inf elsewhere)."""
        job = observation.job
        width = min(self.window, job.horizon_slots - observation.slot)
        reaches_horizon = observation.slot + width >= job.horizon_slots
        to_deadline = math.ceil((job.deadline_hours - observation.hours) / job.slot_hours - 1e-9)
        price, available, point = self._ahead(observation, width if reaches_horizon else max(width, to_deadline))
        # Every decision is deadline-safe, so the job always earns its full value: short of the
        # horizon the window only trades cost now against the terminal price of work left, and a
        # value credited to in-window completions alone would buy completion at any price.
        ramp = 1.0 + self.early_preference * np.arange(width + 1)
        request = PlanRequest(
            job=job if reaches_horizon else replace(job, value=0.0),
            start_hours=observation.hours,
            work_done=observation.work_done,
            previous=observation.previous,
            spot_price=price[:width] * ramp[:width, None],
            available=available[:width],
            on_demand_price=observation.on_demand_price,
            terminal_cost_per_work=None if reaches_horizon else self._ramped_terminal(observation, price, available, ramp[width]),
            deadline_safe_end=not reaches_horizon,
            deadline_safe=True,
            keep_preference=self._keep_preference(observation),
        )
        if self.cost_limit is not None:
            request = replace(request, cost_limit=self.cost_limit(observation, price[:width], available[:width]))
        return request, np.where(available < point, available, np.inf)[:width]

    def _keep_preference(self, observation: Observation) -> float:
        """What a plan that leaves the running allocation now pays on top, in the plan only:
        ``early_preference`` of the restart's cost (its overhead at the running allocation's
        price now). A restart the forecast puts a slot or more ahead then waits for it, since the
        forecast may be wrong, instead of being made now at the same forecast cost."""
        job, previous = observation.job, observation.previous
        hourly = previous.hourly_price(observation.past.spot_price[-1], observation.on_demand_price)
        return self.early_preference * job.reconfig_overhead_hours * hourly

    def _ahead(self, observation: Observation, slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Prices, planned and point availability of ``slots`` slots from now: the current one
        known, then forecast.

        The planned availability is the point forecast, or with ``uncertainty="quantile"`` the
        capacity available with probability >= ``level`` (never above the point).
        """
        price = observation.past.spot_price[-1:].astype(float)
        available = observation.past.available[-1:].astype(float)
        point = available
        if slots > 1:
            forecast = self.forecaster.forecast(observation.past, slots - 1)
            price = np.vstack([price, _planned(forecast.spot_price)])
            point = np.vstack([available, np.maximum(np.floor(forecast.available), 0.0)])
            ahead = point[1:]
            if self.level is not None:
                ahead = np.minimum(ahead, forecast.available_at_level(self.level))
                price[1:] = np.maximum(price[1:], _planned(forecast.spot_price_at_level(self.level)))
            available = np.vstack([available, ahead])
        return price, available, point

    def _ramped_terminal(self, observation: Observation, price: np.ndarray, available: np.ndarray, ramp: float) -> float:
        """The terminal price, raised by the window's last ``ramp`` where spot sets it, so that
        deferring spot work past the window is no cheaper than running it inside; an on-demand
        terminal price is left as it is (on-demand now is never made to look cheaper than later)."""
        terminal = self._terminal(observation, price, available)
        on_demand = fallback_unit_price(observation.job, observation.on_demand_price)
        return terminal * ramp if terminal < on_demand * (1 - 1e-9) else terminal

    def _terminal(self, observation: Observation, price: np.ndarray, available: np.ndarray) -> float:
        """USD per unit of work left after the window (see ``docs/policies-optimal-chc.md``).

        ``marginal``: the price of the last unit of work the job has to buy before its soft
        deadline. The forecast up to the deadline is the supply: each slot offers N_max
        instances, spot pools cheapest first and on-demand for the rest; bought cheapest first,
        the remaining work ends on that price. Work is then deferred past the window exactly
        when now is dearer than what the rest of the time to the deadline offers.
        ``on-demand``: the price of finishing on N_max on-demand instances (defers nothing).
        """
        job = observation.job
        if not isinstance(self.terminal_price, str):
            return float(self.terminal_price)
        on_demand = observation.on_demand_price
        slots_left = (job.deadline_hours - observation.hours) / job.slot_hours
        rows = min(len(price), math.ceil(slots_left - 1e-9))
        if self.terminal_price == "on-demand" or rows < 1:  # past d, only on-demand speed is left
            return fallback_unit_price(job, on_demand)
        unit_price, unit_work = supply_curve(job, price[:rows], available[:rows], on_demand)
        unit_work[-job.max_instances :] *= min(slots_left - (rows - 1), 1.0)  # the last slot may end after d
        order = np.argsort(unit_price, kind="stable")
        order = order[np.isfinite(unit_price[order])]  # an instance that adds no work buys none
        if not order.size:  # H(1) <= 0 and nothing more offered
            return fallback_unit_price(job, on_demand)
        bought = np.cumsum(unit_work[order])
        last = int(np.searchsorted(bought, observation.remaining_work - WORK_EPSILON))
        return float(unit_price[order][min(last, len(order) - 1)])


def _planned(forecast_price: np.ndarray) -> np.ndarray:
    """A forecast price as the plan takes it: to ``PLANNED_PRICE_DECIMALS`` places."""
    return np.round(forecast_price, PLANNED_PRICE_DECIMALS)


def fallback_unit_price(job: Job, on_demand_price: float) -> float:
    """USD per unit of work of the on-demand fallback (N_max on-demand instances)."""
    return job.max_instances * on_demand_price / job.rate(job.max_instances)


def supply_curve(
    job: Job, price: np.ndarray, available: np.ndarray, on_demand_price: float
) -> tuple[np.ndarray, np.ndarray]:
    """Every instance the slots offer up to N_max each: its price per unit of work and its work.

    In each slot the k-th instance is the k-th cheapest (spot pools by price, then on-demand); it
    adds H(k) - H(k-1) work units per hour, so its price per unit of work is its hourly price
    over that.
    """
    n_max = job.max_instances
    hourly = np.empty((len(price), n_max))
    for t, (row_price, row_available) in enumerate(zip(price, np.floor(available))):
        counts = cheapest_allocation(n_max, row_price, np.maximum(row_available, 0).astype(int), on_demand_price)
        spot = np.repeat(row_price, counts.spot)
        hourly[t] = np.concatenate([np.sort(spot), np.full(counts.on_demand, on_demand_price)])
    added = np.diff([job.rate(k) for k in range(n_max + 1)])
    # An instance that adds no work (H(1) <= 0 with beta <= -alpha) buys none: its price is inf.
    unit_price = np.divide(hourly, added, out=np.full_like(hourly, np.inf), where=added > 0)
    return unit_price.ravel(), np.tile(np.maximum(added, 0.0) * job.slot_hours, len(hourly))
