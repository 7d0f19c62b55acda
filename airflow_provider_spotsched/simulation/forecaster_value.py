"""What each forecaster buys: CHC's cost on it, beside its forecast error at the same jobs.

A forecast is worth what the decisions it causes save. The evaluation runs plain CHC (no cost
guard) once per real forecaster (``chc-persistence``, ``chc-arima``, ...) on the same jobs; this
module pairs each forecaster's mean cost (in USD per job, against CHC on persistence, the forecast of doing
nothing) with its mean absolute error at leads 1..:data:`LEADS`, relative to persistence, at
the jobs' own submission times: the origins the evaluation drew, which nobody chose for a
forecaster. Each origin gets a new forecaster, as a job submitted there does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from airflow_provider_spotsched.forecast import make_forecaster
from airflow_provider_spotsched.scheduling.replay import JobMarket

LEADS = 6
REFERENCE = "persistence"
QUANTITIES = ("available", "spot_price")


@dataclass(frozen=True)
class Origin:
    """A job's submission on a trace: its market (history, then the job's slots) and its start."""

    trace: str
    start: str
    market: JobMarket


def absolute_errors(forecaster: str, origins: Sequence[Origin]) -> dict[str, np.ndarray]:
    """Per quantity, |forecast - realised| of a new ``forecaster`` at every origin: (origins, LEADS, pools)."""
    errors: dict[str, list[np.ndarray]] = {q: [] for q in QUANTITIES}
    for origin in origins:
        market, offset = origin.market.market, origin.market.offset
        forecast = make_forecaster(forecaster, slot_hours=market.slot_hours).forecast(market.prefix(offset + 1), LEADS)
        realised = {"available": market.available, "spot_price": market.spot_price}
        predicted = {"available": forecast.available, "spot_price": forecast.spot_price}
        for quantity in QUANTITIES:
            actual = np.asarray(realised[quantity][offset + 1 : offset + 1 + LEADS], dtype=float)
            errors[quantity].append(np.abs(np.asarray(predicted[quantity], dtype=float) - actual))
    return {q: np.stack(errors[q]) for q in QUANTITIES}


def submission_errors(
    origins: Mapping[str, Sequence[Origin]], forecasters: Sequence[str], workers: int = 1
) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Per trace and forecaster, the MAE per lead (pooled over origins and pools) for each quantity.

    Persistence is always scored, since every ratio is taken against it.
    """
    names = list(dict.fromkeys([REFERENCE, *forecasters]))
    tasks = [(trace, name) for trace in origins for name in names]
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(tasks)))) as pool:
        futures = {task: pool.submit(absolute_errors, task[1], origins[task[0]]) for task in tasks}
        results = {task: future.result() for task, future in futures.items()}
    return {
        trace: {
            name: {q: results[(trace, name)][q].mean(axis=(0, 2)).tolist() for q in QUANTITIES} for name in names
        }
        for trace in origins
    }


def mae_ratio(errors: Mapping[str, Mapping[str, Sequence[float]]], forecaster: str, quantity: str) -> float | None:
    """The forecaster's MAE over all leads / persistence's; None where persistence is exact at every lead."""
    model = float(np.mean(errors[forecaster][quantity]))
    reference = float(np.mean(errors[REFERENCE][quantity]))
    return model / reference if reference > 0 else None
