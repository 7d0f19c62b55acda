"""Rolling-origin backtest: how far ahead each forecaster predicts a market, against persistence.

At every origin (a slot index, ``step`` slots apart, once ``min_history`` slots are known) each
model forecasts the ``horizon`` slots after the origin from ``market.prefix(origin + 1)`` alone,
exactly what a scheduler deciding that slot would see, and the forecast is compared with the
realised slots. Errors are kept per model, origin, horizon step and pool, so every aggregate
(MAE, MAPE, skill against persistence) is a plain mean over origins.

MAPE skips zero actuals: a pool with 0 instances available (or a zero price) has no relative
error, and substituting a scale would mix two different metrics in one column. On a 0/1
availability trace MAPE therefore measures the error in the slots where the pool was up; it is
NaN where every actual of a cell is zero. The skill ratio MAE_model / MAE_persistence is NaN
where persistence is exact (MAE 0, e.g. a constant price): nothing can beat an exact forecast.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast import Forecaster, make_forecaster
from airflow_provider_spotsched.market.slots import SlotMarket

QUANTITIES = ("spot_price", "available")
REFERENCE = "persistence"
TWO_WEEKS_HOURS = 14 * 24.0
ROW_COLUMNS = ("quantity", "model", "pool", "step", "lead_hours", "origins", "mae", "mape", "mape_points", "skill")


class BacktestError(ValueError):
    """A backtest that cannot run on the market given; the message names the field and the fix."""


def default_min_history(market: SlotMarket, horizon: int) -> int:
    """Two weeks of slots, or half of what the market leaves beyond one horizon if it is shorter."""
    two_weeks = int(round(TWO_WEEKS_HOURS / market.slot_hours))
    return max(1, min(two_weeks, (market.num_slots - horizon) // 2))


@dataclass(frozen=True)
class Backtest:
    """Every model's forecasts at every origin, with the market they are scored against.

    ``predicted[quantity]`` is ``[model, origin, step, pool]``; ``chosen[model][pool]`` counts
    the model names a forecaster reported for that pool (what an automatic choice picked).
    """

    market: SlotMarket
    models: tuple[str, ...]
    horizon: int
    origins: np.ndarray
    predicted: Mapping[str, np.ndarray]
    chosen: Mapping[str, tuple[Mapping[str, int], ...]]

    @property
    def pools(self) -> tuple[str, ...]:
        return self.market.pools

    @property
    def lead_hours(self) -> np.ndarray:
        """Hours from the origin's slot start to each forecast slot's start: step x slot_hours."""
        return np.arange(1, self.horizon + 1) * self.market.slot_hours

    def actual(self, quantity: str) -> np.ndarray:
        """The realised ``[origin, step, pool]`` values the forecasts are scored against."""
        rows = self.origins[:, None] + np.arange(1, self.horizon + 1)[None, :]
        return getattr(self.market, _checked(quantity))[rows].astype(float)

    def errors(self, quantity: str) -> np.ndarray:
        """Absolute errors ``[model, origin, step, pool]``."""
        return np.abs(self.predicted[_checked(quantity)] - self.actual(quantity)[None])

    def mae(self, quantity: str) -> np.ndarray:
        """Mean absolute error ``[model, step, pool]`` over the origins."""
        return self.errors(quantity).mean(axis=1)

    def mape(self, quantity: str) -> tuple[np.ndarray, np.ndarray]:
        """Mean absolute percentage error ``[model, step, pool]`` over nonzero actuals, and their count."""
        actual = self.actual(quantity)
        nonzero = actual != 0
        relative = np.where(nonzero[None], self.errors(quantity) / np.where(nonzero, np.abs(actual), 1.0)[None], 0.0)
        points = nonzero.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return 100.0 * relative.sum(axis=1) / points[None], points

    def skill(self, quantity: str) -> np.ndarray:
        """MAE_model / MAE_persistence ``[model, step, pool]``; below 1 beats persistence, NaN if it is exact."""
        mae = self.mae(quantity)
        reference = mae[self.models.index(REFERENCE)]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(reference[None] > 0, mae / np.where(reference > 0, reference, 1.0)[None], np.nan)

    def mean_mae(self, quantity: str, first_step: int = 1) -> np.ndarray:
        """MAE ``[model, pool]`` averaged over the steps ``first_step .. horizon``."""
        return self.mae(quantity)[:, first_step - 1 :].mean(axis=1)

    def to_rows(self) -> list[dict[str, Any]]:
        """One row per quantity, model, pool and step, with the columns of :data:`ROW_COLUMNS`."""
        rows = []
        for quantity in QUANTITIES:
            mae, skill = self.mae(quantity), self.skill(quantity)
            mape, points = self.mape(quantity)
            for i, model in enumerate(self.models):
                for m, pool in enumerate(self.pools):
                    for k in range(self.horizon):
                        rows.append({
                            "quantity": quantity, "model": model, "pool": pool, "step": k + 1,
                            "lead_hours": float(self.lead_hours[k]), "origins": len(self.origins),
                            "mae": float(mae[i, k, m]), "mape": _number(mape[i, k, m]),
                            "mape_points": int(points[k, m]), "skill": _number(skill[i, k, m]),
                        })
        return rows


def _checked(quantity: str) -> str:
    if quantity not in QUANTITIES:
        raise BacktestError(f"quantity must be one of {QUANTITIES}, got {quantity!r}")
    return quantity


def _number(value: float) -> float | None:
    return None if not np.isfinite(value) else float(value)


ProgressCallback = Callable[[int, int], None]
"""Called as ``(models_done, models_total)`` each time a model has forecast at every origin."""


def run_backtest(
    market: SlotMarket,
    models: Sequence[str],
    horizon: int,
    step: int = 6,
    min_history: int | None = None,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    workers: int = 1,
    on_progress: ProgressCallback | None = None,
) -> Backtest:
    """Backtest forecasters ``models`` (registry names, persistence added if missing) on ``market``.

    Origins run from slot ``min_history - 1`` (default :func:`default_min_history`) every
    ``step`` slots while ``horizon`` realised slots follow them. ``params`` maps a model name
    to the parameters it is built with. Each model runs through the origins in order, as a
    scheduler would call it hour after hour (so refit schedules and caches behave as in use);
    with ``workers`` > 1 the models run in that many processes at once.
    """
    if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)) or horizon < 1:
        raise BacktestError(f"horizon must be an integer >= 1 (slots ahead), got {horizon!r}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise BacktestError(f"step must be an integer >= 1 (slots between origins), got {step!r}")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise BacktestError(f"workers must be an integer >= 1 (processes), got {workers!r}")
    if len(set(models)) != len(models):
        raise BacktestError(f"models lists a model twice: {list(models)}")
    names = tuple(models) if REFERENCE in models else (*models, REFERENCE)
    history = default_min_history(market, horizon) if min_history is None else min_history
    if isinstance(history, bool) or not isinstance(history, (int, np.integer)) or history < 1:
        raise BacktestError(f"min_history must be an integer >= 1 (slots known at the first origin), got {history!r}")
    origins = np.arange(history - 1, market.num_slots - horizon, step)
    if len(origins) == 0:
        raise BacktestError(
            f"the market has {market.num_slots} slots; {history} of history plus {horizon} ahead leave no origin: "
            f"lower min_history or the horizon, or use a longer trace"
        )
    forecasters = {name: make_forecaster(name, (params or {}).get(name)) for name in names}
    if any(f.uses_future for f in forecasters.values()):
        raise BacktestError("models include the oracle, which reads the realised future; backtest real forecasters")
    runs: dict[str, ModelRun] = {}
    if workers == 1:
        for name in names:
            runs[name] = run_model(forecasters[name], market, origins, horizon)
            if on_progress is not None:
                on_progress(len(runs), len(names))
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(names))) as pool:
            futures = {pool.submit(run_model, forecasters[name], market, origins, horizon): name for name in names}
            for future in as_completed(futures):
                runs[futures[future]] = future.result()
                if on_progress is not None:
                    on_progress(len(runs), len(names))
    return Backtest(
        market=market,
        models=names,
        horizon=int(horizon),
        origins=origins,
        predicted={q: np.stack([runs[name].predicted[q] for name in names]) for q in QUANTITIES},
        chosen={name: runs[name].chosen for name in names},
    )


@dataclass(frozen=True)
class ModelRun:
    """One model's forecasts ``[origin, step, pool]`` per quantity, and its reported models per pool."""

    predicted: Mapping[str, np.ndarray]
    chosen: tuple[Mapping[str, int], ...]


def run_model(forecaster: Forecaster, market: SlotMarket, origins: np.ndarray, horizon: int) -> ModelRun:
    """``forecaster`` at every origin in order, each time from the slots up to the origin alone."""
    predicted = {q: np.empty((len(origins), horizon, market.num_pools)) for q in QUANTITIES}
    chosen: list[Counter[str]] = [Counter() for _ in market.pools]
    for o, origin in enumerate(origins):
        forecast = forecaster.forecast(market.prefix(int(origin) + 1), horizon)
        predicted["spot_price"][o] = forecast.spot_price
        predicted["available"][o] = forecast.available
        for m, model in enumerate(forecast.models or (forecaster.name,) * market.num_pools):
            chosen[m][model] += 1
    return ModelRun(predicted, tuple(dict(c) for c in chosen))
