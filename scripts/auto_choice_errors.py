"""Where `auto`'s availability forecast gains or loses against persistence, by the model behind it.

At origins spread over a trace (the same ones as `spotsched forecast --backtest --fresh --origins
N`), a new `auto` forecaster forecasts from the history up to the origin alone; for each lead
1..6 and each model that forecast that lead of a pool (its label, `lead_models`), the script sums
`auto`'s absolute error and persistence's over those pool-origins. Where `auto` kept persistence
the two are equal, so every gain or loss of the pooled ratio in `docs/forecasting.md` sits in the
other rows: which choices pay, and which lose. Plain script, about 4 minutes for a 21-day
synthetic market at 80 origins and 10 for the AWS trace at 160, on one core:

    python scripts/auto_choice_errors.py /tmp/sel/s41.csv.gz --origins 80
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from airflow_provider_spotsched.forecast import make_forecaster
from airflow_provider_spotsched.forecast.backtest import origin_slots
from airflow_provider_spotsched.forecast.backtest_report import lead_models
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.market.slots import resample

LEADS = 6
HORIZON = 24  # as the fresh backtests forecast, so the origins are theirs
MIN_HISTORY = 168


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="trace file (CSV or .csv.gz)")
    parser.add_argument("--origins", type=int, default=80, help="origins spread evenly after a week of history")
    args = parser.parse_args()
    market = resample(cached_trace(args.trace), slot_hours=1.0)
    errors: dict[tuple[int, str], np.ndarray] = defaultdict(lambda: np.zeros(3))  # pool-origins, auto, persistence
    for origin in origin_slots(MIN_HISTORY, market.num_slots, HORIZON, 1, args.origins):
        forecast = make_forecaster("auto").forecast(market.prefix(int(origin) + 1), HORIZON)
        now = market.available[origin]
        for pool, label in enumerate(forecast.models):
            availability_label = label.split("+")[1]
            for lead, model in enumerate(lead_models(availability_label, LEADS), start=1):
                actual = market.available[origin + lead, pool]
                errors[(lead, model)] += (1, abs(forecast.available[lead - 1, pool] - actual), abs(now[pool] - actual))
    print(f"{'lead':>4} {'model behind auto':<18} {'pool-origins':>12} {'auto MAE sum':>12} {'persistence':>12} {'ratio':>7}")
    for (lead, model), (cases, own, persistence) in sorted(errors.items()):
        ratio = f"{own / persistence:.3f}" if persistence else "n/a"
        print(f"{lead:>4} {model:<18} {int(cases):>12} {own:>12.1f} {persistence:>12.1f} {ratio:>7}")


if __name__ == "__main__":
    main()
