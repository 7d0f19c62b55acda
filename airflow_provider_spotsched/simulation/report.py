"""An evaluation's files: ``results.csv``, ``results.json``, ``summary.md`` and the plots.

The summary aggregates the rows of :mod:`.evaluation` per trace and overall; every number in it
can be recomputed from ``results.csv`` alone.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from airflow_provider_spotsched.simulation.evaluation import COLUMNS, POLICY_SPECS, Evaluation, Row, plain_chc_forecaster
from airflow_provider_spotsched.simulation.forecaster_value import LEADS, REFERENCE, mae_ratio

SUMMARY_HEADER = (
    "| policy | runs | excess cost vs optimal | utility / optimal | cost / on-demand "
    "| soft misses | hard misses | median decision ms |"
)


def write_report(evaluation: Evaluation, out: Path, command: str, when: datetime) -> list[Path]:
    """Write every file of the evaluation into ``out``; returns the paths written."""
    from airflow_provider_spotsched.simulation.plots import write_plots

    out.mkdir(parents=True, exist_ok=True)
    written = [write_csv(evaluation.rows, out / "results.csv"), out / "results.json", out / "summary.md"]
    ran_on = numerics()
    results = {"command": command, "date": when.isoformat(), "numerics": ran_on, "grid": evaluation.config.to_dict(),
               "selector": evaluation.selector, "forecast_errors": evaluation.forecast_errors}
    written[1].write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    written[2].write_text(summary_markdown(evaluation, command, when, ran_on), encoding="utf-8")
    return written + write_plots(evaluation, out)


def numerics() -> str:
    """The libraries whose floating point the rows rest on: numpy, statsmodels and the BLAS with
    the kernel it picked for this CPU. Where a rerun on another machine differs, this is the
    first thing to compare (docs/evaluation.md)."""
    import statsmodels
    from threadpoolctl import threadpool_info

    blas = [
        f"{lib['internal_api']} {lib['version']} ({lib.get('architecture') or 'kernel unknown'})"
        for lib in threadpool_info()
        if lib["user_api"] == "blas"
    ]
    return f"numpy {np.__version__}, statsmodels {statsmodels.__version__}, BLAS {', '.join(blas) or 'unknown'}"


def write_csv(rows: Iterable[Row], path: Path) -> Path:
    """Every row, one column per :data:`~.evaluation.COLUMNS` entry; an unknown relative is empty."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.to_dict().items()})
    return path


def summary_markdown(evaluation: Evaluation, command: str, when: datetime, ran_on: str) -> str:
    """The summary's text; ``ran_on`` is :func:`numerics` of the run."""
    config = evaluation.config
    traces = list(dict.fromkeys(row.trace for row in evaluation.rows))
    lines = [
        "# Evaluation summary",
        "",
        f"Produced by `{command}` on {when.strftime('%Y-%m-%d %H:%M UTC')}.",
        "",
        f"Numerics: {ran_on}.",
        "",
        f"Grid: {config.scenarios} start(s) per trace x N_max {list(config.n_max)} x slack {list(config.slack)} "
        f"x overhead {list(config.overhead)} h; job of {config.base_hours:g} h on N_max on-demand instances, "
        f"hard deadline factor {config.hard_deadline_factor:g}, value {config.value_factor:g} x on-demand cost.",
        "",
        "Means are over scenarios; relatives compare with the same scenario's `optimal` and `on-demand` runs "
        "(see docs/evaluation.md).",
    ]
    single = [p for p in config.policies if not all(POLICY_SPECS[p].runs_on(n) for n in config.n_max)]
    if single:
        lines += [
            "",
            f"{', '.join(f'`{p}`' for p in single)} run a single instance (as the SkyNomad artifact does) and are "
            "evaluated on the N_max = 1 scenarios only: their `runs` count those, and their means are over them.",
        ]
    sections = [("All traces", evaluation.rows)] + [(t, [r for r in evaluation.rows if r.trace == t]) for t in traces]
    for title, rows in sections:
        lines += ["", f"## {title}", "", SUMMARY_HEADER, "|" + " --- |" * 8]
        lines += [_summary_line(policy, group) for policy, group in _by_policy(rows, config.policies)]
    expected = selector_expected_excess(evaluation)
    if expected:
        lines += [
            "",
            "## Selector, expected over its draws",
            "",
            "Each job's member is drawn at random; this is the mean over jobs of the excess cost of every member "
            "weighted by the probability it was drawn with (its utility shortfall over optimal's cost: the excess cost "
            "when it finishes on time), the figure the regret bound speaks of, free of the "
            "draws' noise.",
            "",
            "| trace | runs | expected excess cost vs optimal |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {trace} | {len(values)} | {100 * float(np.mean(values)):+.1f}% |" for trace, values in expected.items()]
    lines += forecaster_value_lines(evaluation)
    return "\n".join(lines) + "\n"


def forecaster_value_lines(evaluation: Evaluation) -> list[str]:
    """The "what each forecaster buys" section: CHC's cost per forecaster beside its forecast error."""
    if not evaluation.forecast_errors:
        return []
    lines = [
        "",
        "## What each forecaster buys (CHC)",
        "",
        "Plain CHC (no cost guard) on each forecaster, on the same jobs. USD per job is the mean cost difference against CHC on "
        "persistence (negative: the forecaster saves money). MAE / persistence is the forecast's mean absolute "
        f"error relative to persistence's, at lead 1 and over leads 1-{LEADS}, at the jobs' submission times "
        "(a new forecaster at each).",
        "",
        "| trace | CHC on | runs | excess cost vs optimal | USD per job vs persistence "
        f"| MAE / persistence, availability (lead 1, 1-{LEADS}) | MAE / persistence, spot price (lead 1, 1-{LEADS}) |",
        "|" + " --- |" * 7,
    ]
    for trace, errors in evaluation.forecast_errors.items():
        rows = [r for r in evaluation.rows if r.trace == trace]
        reference = {r.scenario_key: r.cost for r in rows if plain_chc_forecaster(r.policy) == REFERENCE}
        for policy in evaluation.config.policies:
            forecaster = plain_chc_forecaster(policy)
            group = [r for r in rows if r.policy == policy]
            if forecaster is None or not group:
                continue
            saved = [r.cost - reference[r.scenario_key] for r in group if r.scenario_key in reference]
            usd = f"{float(np.mean(saved)):+.2f}" if saved else "n/a"
            available, price = (_ratio_cells(errors, forecaster, q) for q in ("available", "spot_price"))
            excess = _mean([r.excess_cost for r in group], percent=True)
            lines.append(f"| {trace} | {forecaster} | {len(group)} | {excess} | {usd} | {available} | {price} |")
    return lines


def _ratio_cells(errors: dict[str, dict[str, list[float]]], forecaster: str, quantity: str) -> str:
    model, reference = np.asarray(errors[forecaster][quantity]), np.asarray(errors[REFERENCE][quantity])
    first = f"{model[0] / reference[0]:.3f}" if reference[0] > 0 else "n/a"
    mean = mae_ratio(errors, forecaster, quantity)
    return f"{first}, {'n/a' if mean is None else f'{mean:.3f}'}"


def selector_expected_excess(evaluation: Evaluation) -> dict[str, list[float]]:
    """Per trace, each selector job's expected excess cost over optimal under its draw probabilities."""
    optimal = {row.scenario_key: row for row in evaluation.rows if row.policy == "optimal"}
    expected: dict[str, list[float]] = {}
    for trace, learning in evaluation.selector.items():
        for play in learning.get("plays", []):
            best = optimal.get((trace, play["start"], play["n_max"], play["slack"], play["overhead"]))
            if best is None or best.cost == 0:
                continue
            excess = sum(p * (best.utility - play["utilities"][m]) / best.cost for m, p in play["probabilities"].items())
            expected.setdefault(trace, []).append(excess)
    return expected


def _by_policy(rows: Sequence[Row], order: Sequence[str]) -> list[tuple[str, list[Row]]]:
    groups = [(policy, [r for r in rows if r.policy == policy]) for policy in order]
    return [(policy, group) for policy, group in groups if group]


def _summary_line(policy: str, rows: Sequence[Row]) -> str:
    cells = [
        policy,
        str(len(rows)),
        _mean([r.excess_cost for r in rows], percent=True),
        _mean([r.utility_vs_optimal for r in rows]),
        _mean([r.cost_vs_on_demand for r in rows]),
        str(sum(r.soft_miss for r in rows)),
        str(sum(r.hard_miss for r in rows)),
        f"{float(np.median([r.decision_ms_p50 for r in rows])):.3g}",
    ]
    return "| " + " | ".join(cells) + " |"


def _mean(values: Sequence[Any], percent: bool = False) -> str:
    known = [v for v in values if v is not None and math.isfinite(v)]
    if not known:
        return "n/a"
    mean = float(np.mean(known))
    return f"{100 * mean:+.1f}%" if percent else f"{mean:.3f}"
