"""How well a pool's drop in the next hour can be told from the past: a logistic regression on
`market.drops.drop_cases` (recent drops and rises of the pool, how long its count has held,
the other pools' drops this hour), fitted on the first half of a trace and scored on the
second: the area under the ROC curve (0.5 is chance), the Brier skill against the first half's
drop rate, and the share of cases, precision and recall above two probabilities. Hourly slots.
Plain script:

    python scripts/drop_predictability.py airflow_provider_spotsched/data/traces/*.csv.gz /tmp/sel/s41.csv.gz
"""

from __future__ import annotations

import argparse

import numpy as np
import statsmodels.api as sm

from airflow_provider_spotsched.market.drops import DROP_FEATURES, drop_cases
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.simulation.evaluation import trace_name

THRESHOLDS = (0.3, 0.5)


def area_under_roc(score: np.ndarray, positive: np.ndarray) -> float:
    """The chance that a random positive case scores above a random negative one (ties half)."""
    ranks = np.argsort(np.argsort(score, kind="stable"), kind="stable") + 1.0
    for value in np.unique(score):  # ties share their mean rank
        tied = score == value
        ranks[tied] = ranks[tied].mean()
    positives, negatives = positive.sum(), (~positive).sum()
    return float((ranks[positive].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="trace files (CSV or .csv.gz)")
    args = parser.parse_args()
    print("features:", "; ".join(DROP_FEATURES))
    for path in args.traces:
        available = resample(cached_trace(path), slot_hours=1.0).available
        half = available.shape[0] // 2
        train_x, train_y = drop_cases(available[: half + 1])
        test_x, test_y = drop_cases(available[half:])
        fit = sm.Logit(train_y.astype(float), sm.add_constant(train_x)).fit(disp=0)
        p = fit.predict(sm.add_constant(test_x, has_constant="add"))
        base = train_y.mean()
        skill = 1.0 - np.mean((p - test_y) ** 2) / np.mean((base - test_y) ** 2)
        above = "; ".join(
            f"p >= {t}: {np.mean(p >= t):.3f} of cases, precision {test_y[p >= t].mean() if (p >= t).any() else float('nan'):.2f}, "
            f"recall {test_y[p >= t].sum() / test_y.sum():.2f}"
            for t in THRESHOLDS
        )
        print(
            f"{trace_name(path)}: {len(test_y)} cases scored, drop rate {test_y.mean():.3f}; "
            f"AUC {area_under_roc(p, test_y):.3f}, Brier skill {skill:+.3f}; {above}; "
            f"coefficients {np.round(fit.params[1:], 2).tolist()} (intercept {fit.params[0]:.2f})"
        )


if __name__ == "__main__":
    main()
