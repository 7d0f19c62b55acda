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

Two ways to place and run the origins. By default every ``step`` slots, each model running
through them in order as a scheduler calls it hour after hour (its refits, cache and, for
``auto``, its choice carried from one origin to the next). With ``origins`` they are that many
slots spread evenly over the same span, fixed by the market's length alone; with ``fresh`` each
origin is forecast by a new forecaster that sees the history up to it and nothing of the other
origins, as a job submitted there would (``auto`` then chooses its models at every origin):
forecasts scored at instants nobody chose, independent of any model choice.

Besides the point errors, the backtest keeps what the uncertainty claims: each model's 80%
interval (its coverage: the share of actuals inside it, 80% when calibrated) and the chance of
at least n available instances for n in ``at_least`` (its Brier score against what happened,
and the reliability of its stated chances).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from airflow_provider_spotsched.forecast import Forecaster, make_forecaster
from airflow_provider_spotsched.market.slots import SlotMarket

QUANTITIES = ("spot_price", "available")
REFERENCE = "persistence"
TWO_WEEKS_HOURS = 14 * 24.0
ROW_COLUMNS = (
    "quantity", "model", "pool", "step", "lead_hours", "origins", "mae", "mape", "mape_points", "skill", "coverage80",
)


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
    ``lower`` and ``upper`` hold the 80% intervals the same way (NaN for a model that gives
    none), ``chances[i]`` the stated P(available >= ``at_least[i]``) ``[model, origin, step,
    pool]``; ``fresh`` says whether every origin had a new forecaster.
    """

    market: SlotMarket
    models: tuple[str, ...]
    horizon: int
    origins: np.ndarray
    predicted: Mapping[str, np.ndarray]
    chosen: Mapping[str, tuple[Mapping[str, int], ...]]
    lower: Mapping[str, np.ndarray] = field(default_factory=dict)
    upper: Mapping[str, np.ndarray] = field(default_factory=dict)
    at_least: tuple[int, ...] = ()
    chances: tuple[np.ndarray, ...] = ()
    fresh: bool = False

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

    def inside(self, quantity: str) -> np.ndarray:
        """``[model, origin, step, pool]``: 1 where the actual lies in the 80% interval, 0 outside,
        NaN where the model gave no interval."""
        lower, upper = self.lower.get(_checked(quantity)), self.upper.get(quantity)
        shape = self.predicted[quantity].shape
        if lower is None or upper is None:
            return np.full(shape, np.nan)
        actual = self.actual(quantity)[None]
        tolerance = 1e-9 * np.maximum(1.0, np.abs(actual))  # a zero-width interval on an exact forecast covers it
        hit = ((lower - tolerance <= actual) & (actual <= upper + tolerance)).astype(float)
        return np.where(np.isnan(lower) | np.isnan(upper), np.nan, hit)

    def coverage(self, quantity: str) -> np.ndarray:
        """``[model, step]`` share of actuals (over origins and pools) inside the 80% interval; NaN without one."""
        return self.inside(quantity).mean(axis=(1, 3))  # NaN propagates from a model without intervals

    def events(self, n: int) -> np.ndarray:
        """``[origin, step, pool]``: 1 where at least ``n`` instances were available, else 0."""
        return (self.actual("available") >= n).astype(float)

    def chance(self, n: int) -> np.ndarray:
        """The stated P(available >= ``n``) ``[model, origin, step, pool]``; ``n`` must be in ``at_least``."""
        if n not in self.at_least:
            raise BacktestError(f"the backtest kept the chance of at least {list(self.at_least)} instances, not {n}")
        return self.chances[self.at_least.index(n)]

    def brier(self, n: int) -> np.ndarray:
        """``[model, step]`` Brier score of P(available >= ``n``): mean squared gap to what happened (0 best)."""
        return ((self.chance(n) - self.events(n)[None]) ** 2).mean(axis=(1, 3))

    def climatology(self, n: int) -> np.ndarray:
        """``[origin, pool]`` the reference chance: the share of slots up to the origin with >= ``n`` available."""
        reached = self.market.available >= n
        return np.cumsum(reached, axis=0)[self.origins] / (self.origins[:, None] + 1.0)

    def brier_climatology(self, n: int) -> np.ndarray:
        """``[step]`` Brier score of :meth:`climatology` as the chance at every lead."""
        return ((self.climatology(n)[:, None, :] - self.events(n)) ** 2).mean(axis=(0, 2))

    def reliability(self, model: str, n: int, bins: int = 10) -> list[tuple[float, float, int, float, float]]:
        """Per bin of stated chance (``bins`` equal bins of [0, 1]): (low, high, points, mean stated,
        observed frequency), pooled over origins, leads and pools; bins without points are left out."""
        stated = self.chance(n)[self.models.index(model)].ravel()
        happened = self.events(n).ravel()
        which = np.minimum((stated * bins).astype(int), bins - 1)
        rows = []
        for b in range(bins):
            mask = which == b
            if mask.any():
                rows.append((b / bins, (b + 1) / bins, int(mask.sum()), float(stated[mask].mean()),
                             float(happened[mask].mean())))
        return rows

    def skill_interval(
        self, quantity: str, model: str, level: float = 0.9, draws: int = 1000, seed: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(low, high)`` per step: a ``level`` interval of the pooled skill of ``model`` against
        persistence by a moving-block bootstrap over origins (blocks as long as one horizon, so
        forecasts whose targets overlap are drawn together); NaN where persistence is exact."""
        errors = self.errors(quantity)
        mine = errors[self.models.index(model)].sum(axis=2)  # [origin, step], summed over pools
        reference = errors[self.models.index(REFERENCE)].sum(axis=2)
        count = len(self.origins)
        spacing = max(1, int(np.median(np.diff(self.origins)))) if count > 1 else 1
        block = min(count, -(-self.horizon // spacing))
        starts = np.random.default_rng(seed).integers(0, count - block + 1, size=(draws, -(-count // block)))
        rows = (starts[..., None] + np.arange(block)).reshape(draws, -1)[:, :count]
        total = reference[rows].sum(axis=1)  # [draw, step]
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = np.where(total > 0, mine[rows].sum(axis=1) / np.where(total > 0, total, 1.0), np.nan)
        low, high = np.full(self.horizon, np.nan), np.full(self.horizon, np.nan)
        tail = 50.0 * (1.0 - level)
        for k in np.flatnonzero(reference.sum(axis=0) > 0):
            values = ratios[:, k][~np.isnan(ratios[:, k])]
            if values.size:
                low[k], high[k] = np.percentile(values, [tail, 100.0 - tail])
        return low, high

    def mean_mae(self, quantity: str, first_step: int = 1) -> np.ndarray:
        """MAE ``[model, pool]`` averaged over the steps ``first_step .. horizon``."""
        return self.mae(quantity)[:, first_step - 1 :].mean(axis=1)

    def to_rows(self) -> list[dict[str, Any]]:
        """One row per quantity, model, pool and step, with the columns of :data:`ROW_COLUMNS`."""
        rows = []
        for quantity in QUANTITIES:
            mae, skill = self.mae(quantity), self.skill(quantity)
            mape, points = self.mape(quantity)
            covered = self.inside(quantity).mean(axis=1)
            for i, model in enumerate(self.models):
                for m, pool in enumerate(self.pools):
                    for k in range(self.horizon):
                        rows.append({
                            "quantity": quantity, "model": model, "pool": pool, "step": k + 1,
                            "lead_hours": float(self.lead_hours[k]), "origins": len(self.origins),
                            "mae": float(mae[i, k, m]), "mape": _number(mape[i, k, m]),
                            "mape_points": int(points[k, m]), "skill": _number(skill[i, k, m]),
                            "coverage80": _number(covered[i, k, m]),
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
    origins: int | None = None,
    fresh: bool = False,
    at_least: Sequence[int] = (),
) -> Backtest:
    """Backtest forecasters ``models`` (registry names, persistence added if missing) on ``market``.

    Origins run from slot ``min_history - 1`` (default :func:`default_min_history`) every
    ``step`` slots while ``horizon`` realised slots follow them; with ``origins``, that many
    slots spread evenly over the same span instead (its two ends included). ``params`` maps a
    model name to the parameters it is built with. Each model runs through the origins in order,
    as a scheduler would call it hour after hour (so refit schedules and caches behave as in
    use), or, with ``fresh``, a new forecaster forecasts at each origin. The chance of at least
    n available instances is kept for n = 1 and every count in ``at_least``. With ``workers``
    > 1 the models (and, with ``fresh``, stretches of the origins) run in that many processes.
    """
    if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)) or horizon < 1:
        raise BacktestError(f"horizon must be an integer >= 1 (slots ahead), got {horizon!r}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise BacktestError(f"step must be an integer >= 1 (slots between origins), got {step!r}")
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise BacktestError(f"workers must be an integer >= 1 (processes), got {workers!r}")
    if origins is not None and (isinstance(origins, bool) or not isinstance(origins, (int, np.integer)) or origins < 1):
        raise BacktestError(f"origins must be an integer >= 1 (forecast origins spread over the market), got {origins!r}")
    if any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in at_least):
        raise BacktestError(f"at_least must hold instance counts >= 1, got {list(at_least)!r}")
    if len(set(models)) != len(models):
        raise BacktestError(f"models lists a model twice: {list(models)}")
    names = tuple(models) if REFERENCE in models else (*models, REFERENCE)
    history = default_min_history(market, horizon) if min_history is None else min_history
    if isinstance(history, bool) or not isinstance(history, (int, np.integer)) or history < 1:
        raise BacktestError(f"min_history must be an integer >= 1 (slots known at the first origin), got {history!r}")
    slots = origin_slots(history, market.num_slots, horizon, step, origins)
    if len(slots) == 0:
        raise BacktestError(
            f"the market has {market.num_slots} slots; {history} of history plus {horizon} ahead leave no origin: "
            f"lower min_history or the horizon, or use a longer trace"
        )
    builders = {name: functools.partial(make_forecaster, name, (params or {}).get(name), market.slot_hours) for name in names}
    if any(builder().uses_future for builder in builders.values()):
        raise BacktestError("models include the oracle, which reads the realised future; backtest real forecasters")
    counts = tuple(sorted({1, *(int(n) for n in at_least)}))
    parts = max(1, min(workers, len(slots))) if fresh and workers > 1 else 1
    tasks = [(name, chunk) for name in names for chunk in np.array_split(np.arange(len(slots)), parts) if chunk.size]
    results: dict[tuple[str, int], ModelRun] = {}
    left = Counter(name for name, _ in tasks)

    def finished(name: str, chunk: np.ndarray, run: ModelRun) -> None:
        results[(name, int(chunk[0]))] = run
        left[name] -= 1
        if on_progress is not None and left[name] == 0:
            on_progress(sum(1 for n in names if left[n] == 0), len(names))

    if workers == 1:
        for name, chunk in tasks:
            finished(name, chunk, run_model(builders[name], market, slots[chunk], horizon, fresh, counts))
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(tasks))) as pool:
            futures = {
                pool.submit(run_model, builders[name], market, slots[chunk], horizon, fresh, counts): (name, chunk)
                for name, chunk in tasks
            }
            for future in as_completed(futures):
                finished(*futures[future], future.result())
    runs = {name: ModelRun.join([results[key] for key in sorted(k for k in results if k[0] == name)]) for name in names}
    stack = functools.partial(_stack, runs, names)
    return Backtest(
        market=market,
        models=names,
        horizon=int(horizon),
        origins=slots,
        predicted=stack("predicted"),
        chosen={name: runs[name].chosen for name in names},
        lower=stack("lower"),
        upper=stack("upper"),
        at_least=counts,
        chances=tuple(np.stack([runs[name].chances[i] for name in names]) for i in range(len(counts))),
        fresh=bool(fresh),
    )


def origin_slots(history: int, num_slots: int, horizon: int, step: int, origins: int | None = None) -> np.ndarray:
    """The origins' slot indices: from ``history - 1`` every ``step`` slots while ``horizon`` slots
    follow, or ``origins`` of them spread evenly over that span (both ends included; fewer where
    the span holds fewer slots)."""
    last = num_slots - horizon - 1
    if last < history - 1:
        return np.zeros(0, dtype=int)
    if origins is None:
        return np.arange(history - 1, last + 1, step)
    return np.unique(np.linspace(history - 1, last, origins).round().astype(int))


def _stack(runs: Mapping[str, ModelRun], names: Sequence[str], part: str) -> dict[str, np.ndarray]:
    return {q: np.stack([getattr(runs[name], part)[q] for name in names]) for q in QUANTITIES}


@dataclass(frozen=True)
class ModelRun:
    """One model's forecasts ``[origin, step, pool]`` per quantity (point, 80% interval bounds, NaN
    without one), its chances of at least n instances, and its reported models per pool."""

    predicted: Mapping[str, np.ndarray]
    chosen: tuple[Mapping[str, int], ...]
    lower: Mapping[str, np.ndarray]
    upper: Mapping[str, np.ndarray]
    chances: tuple[np.ndarray, ...]

    @staticmethod
    def join(runs: Sequence[ModelRun]) -> ModelRun:
        """Runs over consecutive stretches of the origins, as one run."""
        if len(runs) == 1:
            return runs[0]
        chosen: list[Counter[str]] = [Counter() for _ in runs[0].chosen]
        for run in runs:
            for counter, counts in zip(chosen, run.chosen):
                counter.update(counts)
        return ModelRun(
            {q: np.concatenate([r.predicted[q] for r in runs]) for q in QUANTITIES},
            tuple(dict(c) for c in chosen),
            {q: np.concatenate([r.lower[q] for r in runs]) for q in QUANTITIES},
            {q: np.concatenate([r.upper[q] for r in runs]) for q in QUANTITIES},
            tuple(np.concatenate([r.chances[i] for r in runs]) for i in range(len(runs[0].chances))),
        )


def run_model(
    build: Callable[[], Forecaster],
    market: SlotMarket,
    origins: np.ndarray,
    horizon: int,
    fresh: bool = False,
    at_least: Sequence[int] = (1,),
) -> ModelRun:
    """The forecaster ``build`` makes, at every origin in order, each time from the slots up to the
    origin alone: one forecaster through all of them, or a new one at each with ``fresh``."""
    shape = (len(origins), horizon, market.num_pools)
    predicted = {q: np.empty(shape) for q in QUANTITIES}
    lower = {q: np.full(shape, np.nan) for q in QUANTITIES}
    upper = {q: np.full(shape, np.nan) for q in QUANTITIES}
    chances = tuple(np.empty(shape) for _ in at_least)
    chosen: list[Counter[str]] = [Counter() for _ in market.pools]
    forecaster = build()
    for o, origin in enumerate(origins):
        if fresh and o > 0:
            forecaster = build()
        forecast = forecaster.forecast(market.prefix(int(origin) + 1), horizon)
        predicted["spot_price"][o] = forecast.spot_price
        predicted["available"][o] = forecast.available
        for quantity, interval in (("spot_price", forecast.spot_price_interval),
                                   ("available", forecast.available_interval)):
            if interval is not None:
                lower[quantity][o], upper[quantity][o] = interval
        for chance, n in zip(chances, at_least):
            chance[o] = forecast.p_available_at_least(n)
        for m, model in enumerate(forecast.models or (forecaster.name,) * market.num_pools):
            chosen[m][model] += 1
    return ModelRun(predicted, tuple(dict(c) for c in chosen), lower, upper, chances)
