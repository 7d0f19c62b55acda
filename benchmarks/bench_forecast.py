"""Time the statistical forecasters where they are used: a first fit, and the hourly call after it.

(1) Fit plus a 24-slot forecast for one pool from two weeks (336 slots) of hourly history, over
several pools and origins of both shipped traces, per model and for ``auto`` (which backtests
every candidate first). (2) With scheduled refits, one hourly forecast for GCP's 13 pools: a
first call fits, then ``--hours`` consecutive hourly calls are timed, against persistence timed
on the same calls. Targets from the issue: (1) under 1 s median, (2) under 200 ms median.
Plain script:

    python benchmarks/bench_forecast.py                   # 4 origins per trace, 48 hourly calls
    python benchmarks/bench_forecast.py --origins 2 --hours 24
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.forecast import make_forecaster
from airflow_provider_spotsched.market.slots import SlotMarket, resample
from airflow_provider_spotsched.market.trace import load_trace

HISTORY = 336  # two weeks of hourly slots
HORIZON = 24
MODELS = ("persistence", "seasonal-naive", "arima", "holt-winters", "markov-count", "auto")


def stats(seconds: list[float]) -> str:
    ms = 1000 * np.asarray(seconds)
    return f"{np.median(ms):9.1f} {np.percentile(ms, 90):9.1f} {ms.max():9.1f} {len(ms):5d}"


def one_pool(market: SlotMarket, pool: int, end: int, history: int) -> SlotMarket:
    """Pool ``pool`` alone, the ``history`` slots before slot ``end``."""
    window = market.window(end - history, history)
    return SlotMarket(
        (window.pools[pool],),
        window.start,
        window.slot_hours,
        window.spot_price[:, pool : pool + 1],
        window.available[:, pool : pool + 1],
        window.on_demand_price,
    )


def first_fits(names: list[str], markets: list[SlotMarket], origins: int, pools: int) -> dict[str, list[float]]:
    """Seconds of a fresh forecaster's first 24-slot forecast, per model, over pools and origins."""
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for market in markets:
        ends = np.linspace(HISTORY, market.num_slots, origins).astype(int)
        chosen = np.linspace(0, market.num_pools - 1, min(pools, market.num_pools)).astype(int)
        for end in ends:
            for pool in chosen:
                past = one_pool(market, int(pool), int(end), HISTORY)
                for name in names:
                    forecaster = make_forecaster(name)
                    began = time.perf_counter()
                    forecaster.forecast(past, HORIZON)
                    seconds[name].append(time.perf_counter() - began)
    return seconds


def hourly(market: SlotMarket, name: str, first: int, hours: int) -> tuple[list[float], tuple[str, ...]]:
    """Seconds of ``hours`` consecutive hourly forecasts after one untimed first call at ``first`` slots."""
    forecaster = make_forecaster(name)
    forecaster.forecast(market.prefix(first), HORIZON)
    seconds, models = [], ()
    for slots in range(first + 1, first + 1 + hours):
        past = market.prefix(slots)
        began = time.perf_counter()
        models = forecaster.forecast(past, HORIZON).models
        seconds.append(time.perf_counter() - began)
    return seconds, models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--origins", type=int, default=4, help="forecast origins per trace for the first-fit timing")
    parser.add_argument("--pools", type=int, default=3, help="pools per trace and origin for the first-fit timing")
    parser.add_argument("--hours", type=int, default=48, help="consecutive hourly calls timed on GCP")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated forecasters to time")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    names = [name for name in args.models.split(",") if name]
    aws = resample(load_trace(AWS_TRACE))
    gcp = resample(load_trace(GCP_TRACE))

    print(f"(1) fit + {HORIZON}-slot forecast, one pool, {HISTORY} hourly slots of history; times in ms")
    print(f"{'model':<32} {'median':>9} {'p90':>9} {'max':>9} {'n':>5}")
    for name, seconds in first_fits(names, [aws, gcp], args.origins, args.pools).items():
        print(f"{name:<32} {stats(seconds)}")

    first = gcp.num_slots - args.hours - 1
    print(f"\n(2) one hourly {HORIZON}-slot forecast, all {gcp.num_pools} GCP pools, refits on schedule, "
          f"{args.hours} calls after a first fit at {first} slots; times in ms")
    print(f"{'model':<32} {'median':>9} {'p90':>9} {'max':>9} {'n':>5}  vs persistence")
    baseline, _ = hourly(gcp, "persistence", first, args.hours)
    for name in names:
        seconds, models = hourly(gcp, name, first, args.hours)
        ratio = np.median(seconds) / np.median(baseline)
        print(f"{name:<32} {stats(seconds)}  x{ratio:.1f}")
        if name == "auto":
            print(f"  auto's choices: {sorted(set(models))}")


if __name__ == "__main__":
    main()
