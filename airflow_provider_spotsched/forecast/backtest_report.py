"""A backtest's files: ``backtest.csv``, ``calibration.csv``, ``reliability.csv``, ``summary.md``
and two PNG figures.

The summary answers "how far ahead does each model predict, and by how much does it beat
persistence": MAE per lead time averaged over pools, the pooled skill ratio (sum of the model's
MAE over pools / sum of persistence's), per lead 1..6 with a bootstrap interval for the headline
model, and per pool the MAE at lead times of 3 hours and more. Then whether the uncertainty is
right: the coverage of the 80% intervals, the Brier score of P(available >= n) against the
climatological chance, and a reliability table of those chances. Every number in it but the
bootstrap intervals can be recomputed from the CSV files. Figures use :class:`Figure` directly
(Agg backend, no display), like :mod:`airflow_provider_spotsched.simulation.plots`.
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from airflow_provider_spotsched.forecast.backtest import QUANTITIES, REFERENCE, ROW_COLUMNS, Backtest
from airflow_provider_spotsched.market.trace import format_timestamp

LONG_LEAD_HOURS = 3.0
"""The lead time from which the report asks whether a model beats persistence."""

SHOWN_STEPS = (1, 2, 3, 4, 5, 6, 12, 24, 48)
NEAR_STEPS = 6
"""The leads a commitment acts on: the report gives every model's skill at each of leads 1..6."""
SKILL_AXIS_TOP = 2.0
LABELS = {"spot_price": "spot price (USD/h)", "available": "available count"}


def headline_model(backtest: Backtest) -> str:
    """The model the report is about: ``auto`` when backtested, else the first non-persistence one."""
    if "auto" in backtest.models:
        return "auto"
    return next((m for m in backtest.models if m != REFERENCE), REFERENCE)


def long_lead_step(backtest: Backtest) -> int:
    """The first step whose lead time is at least :data:`LONG_LEAD_HOURS` (capped at the horizon)."""
    return min(backtest.horizon, max(1, math.ceil(LONG_LEAD_HOURS / backtest.market.slot_hours - 1e-9)))


def pooled_skill(backtest: Backtest, quantity: str) -> np.ndarray:
    """``[model, step]`` sum over pools of MAE / the same sum for persistence; NaN where that is 0."""
    total = backtest.mae(quantity).sum(axis=2)
    reference = total[backtest.models.index(REFERENCE)]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(reference > 0, total / np.where(reference > 0, reference, 1.0), np.nan)


def write_backtest_report(backtest: Backtest, out: Path, command: str, when: datetime, trace: str) -> list[Path]:
    """Write the CSV, the summary and the figures into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    table = write_rows(backtest, out / "backtest.csv")
    calibration = write_calibration(backtest, out / "calibration.csv")
    reliability = write_reliability(backtest, out / "reliability.csv")
    summary = out / "summary.md"
    summary.write_text(summary_markdown(backtest, command, when, trace), encoding="utf-8")
    written = [table, calibration, reliability, summary]
    for name, figure in (("error_vs_horizon.png", error_vs_horizon(backtest, trace)),
                         ("forecast_vs_actual.png", forecast_vs_actual(backtest, trace))):
        figure.savefig(out / name, dpi=90, bbox_inches="tight")
        written.append(out / name)
    return written


def write_rows(backtest: Backtest, path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=ROW_COLUMNS)
        writer.writeheader()
        for row in backtest.to_rows():
            writer.writerow({k: "" if v is None else (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return path


CALIBRATION_COLUMNS = ("quantity", "at_least", "model", "step", "lead_hours", "points", "coverage80", "brier",
                       "brier_climatology")
RELIABILITY_COLUMNS = ("model", "at_least", "bin_low", "bin_high", "points", "stated", "observed")


def calibration_rows(backtest: Backtest) -> list[dict[str, object]]:
    """Per quantity, model and step, pooled over origins and pools: the 80% intervals' coverage;
    per count n, model and step: the Brier score of P(available >= n) and the climatology's."""
    rows: list[dict[str, object]] = []
    points = len(backtest.origins) * len(backtest.pools)
    for quantity in QUANTITIES:
        coverage = backtest.coverage(quantity)
        for i, model in enumerate(backtest.models):
            for k in range(backtest.horizon):
                rows.append({"quantity": quantity, "at_least": "", "model": model, "step": k + 1,
                             "lead_hours": float(backtest.lead_hours[k]), "points": points,
                             "coverage80": coverage[i, k], "brier": None, "brier_climatology": None})
    for n in backtest.at_least:
        brier, reference = backtest.brier(n), backtest.brier_climatology(n)
        for i, model in enumerate(backtest.models):
            for k in range(backtest.horizon):
                rows.append({"quantity": "available", "at_least": n, "model": model, "step": k + 1,
                             "lead_hours": float(backtest.lead_hours[k]), "points": points, "coverage80": None,
                             "brier": brier[i, k], "brier_climatology": reference[k]})
    return rows


def _csv_value(value: object) -> object:
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return ""
    return f"{value:.6g}" if isinstance(value, (float, np.floating)) else value


def write_calibration(backtest: Backtest, path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=CALIBRATION_COLUMNS)
        writer.writeheader()
        for row in calibration_rows(backtest):
            writer.writerow({k: _csv_value(v) for k, v in row.items()})
    return path


def write_reliability(backtest: Backtest, path: Path) -> Path:
    """Every model's reliability table for every count n (see :meth:`Backtest.reliability`)."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=RELIABILITY_COLUMNS)
        writer.writeheader()
        for n in backtest.at_least:
            for model in backtest.models:
                for low, high, count, stated, observed in backtest.reliability(model, n):
                    writer.writerow({k: _csv_value(v) for k, v in zip(
                        RELIABILITY_COLUMNS, (model, n, low, high, count, stated, observed))})
    return path


def _cell(value: float, digits: int = 3) -> str:
    return "n/a" if not np.isfinite(value) else f"{value:.{digits}f}"


def lead_table(backtest: Backtest, quantity: str) -> list[str]:
    """Markdown rows: per model, MAE averaged over pools with the pooled skill in parentheses."""
    steps = [k for k in SHOWN_STEPS if k <= backtest.horizon]
    mae = backtest.mae(quantity).mean(axis=2)
    skill = pooled_skill(backtest, quantity)
    hours = [f"{k * backtest.market.slot_hours:g} h" for k in steps]
    lines = ["| model | " + " | ".join(hours) + " |", "| --- |" + " --- |" * len(steps)]
    for i, model in enumerate(backtest.models):
        cells = [f"{_cell(mae[i, k - 1], 4)} ({_cell(skill[i, k - 1], 2)})" for k in steps]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return lines


def mape_table(backtest: Backtest, quantity: str) -> list[str]:
    """Markdown rows: per model, MAPE (%) over every pool's nonzero actuals, per lead time."""
    steps = [k for k in SHOWN_STEPS if k <= backtest.horizon]
    mape, points = backtest.mape(quantity)
    weights = points[None].astype(float)
    with np.errstate(invalid="ignore"):
        pooled = np.nansum(np.nan_to_num(mape) * weights, axis=2) / weights.sum(axis=2)
    lines = ["| model | " + " | ".join(f"{k * backtest.market.slot_hours:g} h" for k in steps) + " |",
             "| --- |" + " --- |" * len(steps)]
    for i, model in enumerate(backtest.models):
        lines.append(f"| {model} | " + " | ".join(_cell(pooled[i, k - 1], 1) for k in steps) + " |")
    return lines


def near_table(backtest: Backtest, quantity: str, headline: str) -> list[str]:
    """Markdown rows: per model, the pooled skill at each lead 1..6 and over leads 1..6 together,
    then the headline model's 90% block-bootstrap interval per lead."""
    steps = list(range(1, min(NEAR_STEPS, backtest.horizon) + 1))
    total = backtest.mae(quantity).sum(axis=2)[:, : len(steps)]  # [model, step], summed over pools
    skill = pooled_skill(backtest, quantity)
    reference = total[backtest.models.index(REFERENCE)]
    hours = [f"{k * backtest.market.slot_hours:g} h" for k in steps]
    first, last = hours[0], hours[-1]
    lines = ["| model | " + " | ".join(hours) + f" | {first} .. {last} |", "| --- |" + " --- |" * (len(steps) + 1)]
    for i, model in enumerate(backtest.models):
        overall = total[i].sum() / reference.sum() if reference.sum() > 0 else float("nan")
        cells = [_cell(skill[i, k - 1], 3) for k in steps] + [_cell(overall, 3)]
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    low, high = backtest.skill_interval(quantity, headline)
    cells = ["n/a" if not np.isfinite(low[k - 1]) else f"{low[k - 1]:.3f}-{high[k - 1]:.3f}" for k in steps]
    lines.append(f"| {headline}, 90% interval | " + " | ".join(cells) + " | |")
    return lines


def coverage_table(backtest: Backtest, quantity: str) -> list[str]:
    """Markdown rows: per model, the share of actuals inside its 80% interval per lead time."""
    steps = [k for k in SHOWN_STEPS if k <= backtest.horizon]
    coverage = backtest.coverage(quantity)
    lines = ["| model | " + " | ".join(f"{k * backtest.market.slot_hours:g} h" for k in steps) + " |",
             "| --- |" + " --- |" * len(steps)]
    for i, model in enumerate(backtest.models):
        lines.append(f"| {model} | " + " | ".join(_cell(100 * coverage[i, k - 1], 1) for k in steps) + " |")
    return lines


def brier_table(backtest: Backtest, n: int) -> list[str]:
    """Markdown rows: per model, the Brier score of P(available >= n) per lead time, then the climatology's."""
    steps = [k for k in SHOWN_STEPS if k <= backtest.horizon]
    brier, reference = backtest.brier(n), backtest.brier_climatology(n)
    lines = ["| model | " + " | ".join(f"{k * backtest.market.slot_hours:g} h" for k in steps) + " |",
             "| --- |" + " --- |" * len(steps)]
    for i, model in enumerate(backtest.models):
        lines.append(f"| {model} | " + " | ".join(_cell(brier[i, k - 1], 4) for k in steps) + " |")
    lines.append("| climatology | " + " | ".join(_cell(reference[k - 1], 4) for k in steps) + " |")
    return lines


def reliability_table(backtest: Backtest, model: str, n: int) -> list[str]:
    """Markdown rows: per bin of stated P(available >= n), the points, mean stated and observed frequency."""
    lines = ["| stated chance | points | mean stated | observed |", "| --- | --- | --- | --- |"]
    for low, high, count, stated, observed in backtest.reliability(model, n):
        lines.append(f"| {low:.1f}-{high:.1f} | {count} | {stated:.3f} | {observed:.3f} |")
    return lines


def pool_table(backtest: Backtest, quantity: str, headline: str) -> tuple[list[str], int, int]:
    """Markdown rows: per pool, every model's MAE over lead times >= 3 h, and whether ``headline`` beats persistence.

    Returns the rows, the number of pools where it does, and the number where persistence is exact.
    """
    first = long_lead_step(backtest)
    mae = backtest.mean_mae(quantity, first)
    ref, best = backtest.models.index(REFERENCE), backtest.models.index(headline)
    lines = ["| pool | " + " | ".join(backtest.models) + f" | {headline} / persistence | {headline} beats persistence |",
             "| --- |" + " --- |" * (len(backtest.models) + 2)]
    wins = exact = 0
    for m, pool in enumerate(backtest.pools):
        if mae[ref, m] == 0:
            verdict, ratio = ("no: persistence is exact" if mae[best, m] > 0 else "tie: both exact"), float("nan")
            exact += 1
        else:
            ratio = mae[best, m] / mae[ref, m]
            verdict = "yes" if ratio < 1 else "no"
            wins += ratio < 1
        cells = " | ".join(_cell(mae[i, m], 4) for i in range(len(backtest.models)))
        lines.append(f"| {pool} | {cells} | {_cell(ratio, 2)} | {verdict} |")
    return lines, wins, exact


def chosen_table(backtest: Backtest, model: str) -> list[str]:
    """Markdown rows: how often each model behind ``model`` was picked for each pool."""
    names = sorted({name for counts in backtest.chosen[model] for name in counts})
    lines = ["| pool | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for pool, counts in zip(backtest.pools, backtest.chosen[model]):
        lines.append(f"| {pool} | " + " | ".join(str(counts.get(name, 0)) for name in names) + " |")
    return lines


MAX_LABEL_COLUMNS = 8
"""Up to this many distinct choices, the report lists them per pool; beyond, by lead time only."""


def lead_models(label: str, horizon: int) -> list[str]:
    """The model behind each lead 1..``horizon`` of one series' label, e.g. ``persistence@1-2/
    holt-winters(N,A)@3-`` (a label without ``@`` is one model for every lead), without orders."""
    models = [""] * horizon
    for part in label.split("/"):
        name, _, leads = part.partition("@")
        first, _, last = leads.partition("-")
        start = int(first) if first else 1
        stop = int(last) if last else (start if leads and "-" not in leads else horizon)
        for k in range(start - 1, min(stop, horizon)):
            models[k] = name.split("(")[0]
    return models


def lead_choice_table(backtest: Backtest, model: str) -> list[str]:
    """Markdown rows: per series and lead time, the share of pool-origins at which each model
    forecast that lead in ``model``'s choice (``price-model+availability-model`` labels)."""
    steps = [k for k in SHOWN_STEPS if k <= backtest.horizon]
    shares: dict[tuple[int, int], Counter[str]] = {}
    for counts in backtest.chosen[model]:
        for label, times in counts.items():
            for side, series in enumerate(label.split("+")[:2]):
                for k, name in enumerate(lead_models(series, backtest.horizon)):
                    shares.setdefault((side, k), Counter())[name] += times
    names = sorted({name for counter in shares.values() for name in counter})
    lines = ["| series | lead | " + " | ".join(names) + " |", "| --- | --- |" + " --- |" * len(names)]
    for side, series_name in enumerate(("price", "availability")):
        for k in steps:
            counter = shares.get((side, k - 1), Counter())
            total = sum(counter.values()) or 1
            cells = " | ".join(f"{100 * counter[name] / total:.0f}%" for name in names)
            lines.append(f"| {series_name} | {k * backtest.market.slot_hours:g} h | {cells} |")
    return lines


def summary_markdown(backtest: Backtest, command: str, when: datetime, trace: str) -> str:
    market, origins = backtest.market, backtest.origins
    slot = timedelta(hours=market.slot_hours)
    headline = headline_model(backtest)
    first = long_lead_step(backtest)
    gaps = sorted({int(g) for g in np.diff(origins)})
    spacing = f"every {gaps[0]} slot(s)" if len(gaps) == 1 else (
        f"spread evenly ({gaps[0]}-{gaps[-1]} slots apart)" if gaps else "")
    running = (
        "each forecast by a new forecaster that sees the slots up to that origin only (a job submitted there)"
        if backtest.fresh else
        "each model running through them in order, as a scheduler calls it hour after hour"
    )
    lines = [
        f"# Forecast backtest: {trace}",
        "",
        f"Produced by `{command}` on {when.strftime('%Y-%m-%d %H:%M UTC')}.",
        "",
        f"{market.describe()}. {len(origins)} origins {spacing}, from "
        f"{format_timestamp(market.start + slot * int(origins[0]))} ({int(origins[0]) + 1} slots of history) to "
        f"{format_timestamp(market.start + slot * int(origins[-1]))}, {running}; each model forecasts "
        f"{backtest.horizon} slots ahead from the slots up to the origin only. Models: {', '.join(backtest.models)}.",
        "",
        "MAE is the mean absolute error over origins; skill = MAE / persistence's MAE (below 1 beats persistence; "
        "n/a where persistence is exact). MAPE skips zero actuals. `backtest.csv` holds every pool, model and step.",
    ]
    for quantity in QUANTITIES:
        pools, wins, exact = pool_table(backtest, quantity, headline)
        varying = len(backtest.pools) - exact
        verdict = (
            f"**{headline} beats persistence in {wins} of {varying} pools where persistence errs** "
            f"({exact} pool(s) where persistence is exact)"
            if varying
            else "persistence is exact in every pool (the series never changes): no model can beat it"
        )
        lines += [
            "",
            f"## {LABELS[quantity]}",
            "",
            "MAE by lead time, mean over pools (pooled skill vs persistence):",
            "",
            *lead_table(backtest, quantity),
            "",
            f"Pooled skill (MAE / persistence's MAE, summed over pools) at each lead a commitment acts on; "
            f"the last row is a 90% interval for {headline}'s, from a moving-block bootstrap over the origins:",
            "",
            *near_table(backtest, quantity, headline),
            "",
            "Coverage of the 80% intervals (% of actuals inside; n/a: the model gives none):",
            "",
            *coverage_table(backtest, quantity),
            "",
            "MAPE (%) by lead time over all pools' nonzero actuals:",
            "",
            *mape_table(backtest, quantity),
            "",
            f"Per pool, MAE averaged over lead times {first * market.slot_hours:g} h .. "
            f"{backtest.horizon * market.slot_hours:g} h: {verdict}.",
            "",
            *pools,
        ]
    for n in backtest.at_least:
        lines += [
            "",
            f"## P(available >= {n})",
            "",
            f"Brier score (mean squared gap between the stated chance and what happened, over origins and pools; "
            f"0 is perfect). A model without a count distribution states 0 or 1 from its point forecast; "
            f"the climatology states the share of slots up to the origin with at least {n} available:",
            "",
            *brier_table(backtest, n),
            "",
            f"Reliability of {headline}'s chances, all leads and pools (calibrated: observed = stated):",
            "",
            *reliability_table(backtest, headline, n),
        ]
    if any(len(counts) > 1 for counts in backtest.chosen[headline]):
        lines += ["", f"## Models behind {headline}", ""]
        labels = {label for counts in backtest.chosen[headline] for label in counts}
        if all("+" in label for label in labels):
            lines += ["Share of pool-origins at which each model forecast each lead time:", "",
                      *lead_choice_table(backtest, headline), ""]
        if len(labels) <= MAX_LABEL_COLUMNS:
            lines += ["Origins at which each choice was made, per pool:", "", *chosen_table(backtest, headline)]
        else:
            lines += [f"({len(labels)} different choices over the pools and origins; `Backtest.chosen` has them all.)"]
    return "\n".join(lines) + "\n"


def text_table(backtest: Backtest) -> str:
    """The lead-time tables as plain text for the terminal."""
    out = []
    for quantity in QUANTITIES:
        out += [f"{LABELS[quantity]}: MAE mean over pools (skill vs persistence)", *lead_table(backtest, quantity), ""]
    return "\n".join(out)


def _colour(index: int) -> tuple[float, ...]:
    return colormaps["tab10"](index % 10)


def error_vs_horizon(backtest: Backtest, trace: str) -> Figure:
    """MAE (top) and pooled skill vs persistence (bottom) by lead time, for price and availability."""
    figure = Figure(figsize=(10, 6.5))
    axes = figure.subplots(2, 2, sharex=True)
    lead = backtest.lead_hours
    for column, quantity in enumerate(QUANTITIES):
        mae = backtest.mae(quantity).mean(axis=2)
        skill = pooled_skill(backtest, quantity)
        for i, model in enumerate(backtest.models):
            style = {"color": _colour(i), "label": model, "linestyle": "--" if model == REFERENCE else "-"}
            axes[0, column].plot(lead, mae[i], **style)
            axes[1, column].plot(lead, skill[i], **style)
        axes[0, column].set_title(LABELS[quantity], fontsize="medium")
        axes[0, column].set_ylabel("MAE, mean over pools")
        axes[1, column].axhline(1.0, color="grey", linewidth=0.8)
        axes[1, column].set_ylabel("MAE / persistence MAE")
        axes[1, column].set_xlabel("lead time (h)")
        if np.all(np.isnan(skill)):
            axes[1, column].text(0.5, 0.5, "persistence is exact", ha="center", transform=axes[1, column].transAxes)
        elif np.nanmax(skill) > SKILL_AXIS_TOP:  # a model far worse than persistence would flatten the rest
            axes[1, column].set_ylim(top=SKILL_AXIS_TOP)
            axes[1, column].set_ylabel(f"MAE / persistence MAE (cut at {SKILL_AXIS_TOP:g})")
    axes[0, 0].legend(fontsize="small")
    figure.suptitle(f"{trace}: error against lead time")
    return figure


def sample_pool(backtest: Backtest) -> int:
    """The pool whose availability persistence misses most: where forecasting has most to show."""
    return int(np.argmax(backtest.mean_mae("available")[backtest.models.index(REFERENCE)]))


def forecast_vs_actual(backtest: Backtest, trace: str, context_slots: int = 48) -> Figure:
    """One pool's realised price and availability around the middle origin, and each model's forecast from it."""
    m = sample_pool(backtest)
    o = len(backtest.origins) // 2
    origin = int(backtest.origins[o])
    first = max(0, origin - context_slots + 1)
    hours = (np.arange(first, origin + backtest.horizon + 1) - origin) * backtest.market.slot_hours
    origin_time = backtest.market.start + timedelta(hours=origin * backtest.market.slot_hours)
    figure = Figure(figsize=(10, 3.6))
    axes = figure.subplots(1, 2)
    for ax, quantity in zip(axes, QUANTITIES):
        actual = getattr(backtest.market, quantity)[first : origin + backtest.horizon + 1, m]
        ax.step(hours, actual, where="post", color="black", linewidth=1.5, label="actual")
        for i, model in enumerate(backtest.models):
            ax.step(backtest.lead_hours, backtest.predicted[quantity][i, o, :, m], where="post", color=_colour(i),
                    linestyle="--" if model == REFERENCE else "-", label=model)
        ax.axvline(0.0, color="grey", linewidth=0.8)
        ax.set_xlabel(f"hours from the origin {format_timestamp(origin_time)}")
        ax.set_title(LABELS[quantity], fontsize="medium")
    axes[0].legend(fontsize="small")
    figure.suptitle(f"{trace}, pool {backtest.pools[m]}: forecasts from one origin against what happened")
    return figure

