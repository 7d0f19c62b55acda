"""A backtest's files: ``backtest.csv``, ``summary.md`` and two PNG figures.

The summary answers "how far ahead does each model predict, and by how much does it beat
persistence": MAE per lead time averaged over pools, the pooled skill ratio (sum of the model's
MAE over pools / sum of persistence's), and per pool the MAE at lead times of 3 hours and more.
Every number in it can be recomputed from ``backtest.csv``. Figures use :class:`Figure` directly
(Agg backend, no display), like :mod:`airflow_provider_spotsched.simulation.plots`.
"""

from __future__ import annotations

import csv
import math
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from airflow_provider_spotsched.forecast.backtest import QUANTITIES, REFERENCE, ROW_COLUMNS, Backtest
from airflow_provider_spotsched.market.trace import format_timestamp

LONG_LEAD_HOURS = 3.0
"""The lead time from which the report asks whether a model beats persistence."""

SHOWN_STEPS = (1, 2, 3, 6, 12, 24, 48)
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
    summary = out / "summary.md"
    summary.write_text(summary_markdown(backtest, command, when, trace), encoding="utf-8")
    written = [table, summary]
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


def summary_markdown(backtest: Backtest, command: str, when: datetime, trace: str) -> str:
    market, origins = backtest.market, backtest.origins
    slot = timedelta(hours=market.slot_hours)
    headline = headline_model(backtest)
    first = long_lead_step(backtest)
    step = int(origins[1] - origins[0]) if len(origins) > 1 else 0
    lines = [
        f"# Forecast backtest: {trace}",
        "",
        f"Produced by `{command}` on {when.strftime('%Y-%m-%d %H:%M UTC')}.",
        "",
        f"{market.describe()}. {len(origins)} origins every {step} slot(s), from "
        f"{format_timestamp(market.start + slot * int(origins[0]))} ({int(origins[0]) + 1} slots of history) to "
        f"{format_timestamp(market.start + slot * int(origins[-1]))}; each model forecasts {backtest.horizon} slots "
        f"ahead from the slots up to the origin only. Models: {', '.join(backtest.models)}.",
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
            "MAPE (%) by lead time over all pools' nonzero actuals:",
            "",
            *mape_table(backtest, quantity),
            "",
            f"Per pool, MAE averaged over lead times {first * market.slot_hours:g} h .. "
            f"{backtest.horizon * market.slot_hours:g} h: {verdict}.",
            "",
            *pools,
        ]
    if any(len(counts) > 1 for counts in backtest.chosen[headline]):
        lines += ["", f"## Models behind {headline}", "", "Origins at which each model was chosen, per pool:", "",
                  *chosen_table(backtest, headline)]
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

