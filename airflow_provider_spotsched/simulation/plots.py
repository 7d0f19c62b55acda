"""The evaluation's figures, as PNG files.

Figures are built with :class:`matplotlib.figure.Figure` directly, not through pyplot, so they
render with the Agg backend, need no display and leave a caller's pyplot state alone. A figure
whose policies were not part of the run is skipped rather than drawn empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from airflow_provider_spotsched.simulation.evaluation import POLICY_SPECS, Evaluation, Row


def write_plots(evaluation: Evaluation, out: Path) -> list[Path]:
    """Draw every figure the rows allow into ``out``; returns the files written."""
    rows = evaluation.rows
    traces = list(dict.fromkeys(row.trace for row in rows))
    policies = [p for p in evaluation.config.policies if any(r.policy == p for r in rows)]
    figures = [
        ("cost_per_policy.png", cost_per_policy(rows, traces, policies)),
        ("utility_vs_slack.png", utility_vs_slack(rows, traces, policies)),
        ("chc_forecast_error.png", chc_forecast_error(rows, traces)),
        ("selector_weights.png", selector_weights(evaluation.selector)),
    ]
    written = []
    for name, figure in figures:
        if figure is not None:
            figure.savefig(out / name, dpi=120, bbox_inches="tight")
            written.append(out / name)
    return written


def _panels(count: int, width: float = 6.0, height: float = 4.0) -> tuple[Figure, Sequence[Axes]]:
    figure = Figure(figsize=(width * count, height))
    return figure, list(figure.subplots(1, count, squeeze=False)[0])


def _style(index: int) -> dict[str, Any]:
    """A distinct look per series: ten colours, then the next ten dashed with another marker."""
    lap = index // 10
    return {
        "color": colormaps["tab10"](index % 10),
        "marker": "o^sDv"[lap % 5],
        "linestyle": ("-", "--", ":")[lap % 3],
    }


def _legend_below(figure: Figure, axes: Sequence[Axes], columns: int) -> None:
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=columns, fontsize="small")


def _values(rows: Sequence[Row], column: str) -> list[float]:
    return [v for v in (getattr(r, column) for r in rows) if v is not None and np.isfinite(v)]


def _mean(rows: Sequence[Row], column: str) -> float:
    """The mean of ``column`` over ``rows`` where it is known; NaN (a gap in a line) if nowhere."""
    values = _values(rows, column)
    return float(np.mean(values)) if values else float("nan")


def cost_per_policy(rows: Sequence[Row], traces: Sequence[str], policies: Sequence[str]) -> Figure | None:
    """Box plot per trace of each policy's cost relative to on-demand (1 = on-demand's cost)."""
    if not any(r.policy == "on-demand" for r in rows):
        return None
    figure, axes = _panels(len(traces), width=max(6.0, 0.6 * len(policies)))
    for ax, trace in zip(axes, traces):
        data = [_values([r for r in rows if r.trace == trace and r.policy == p], "cost_vs_on_demand") for p in policies]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(policies) + 1), policies, rotation=60, ha="right")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_title(trace)
        ax.set_ylabel("cost / on-demand cost")
    figure.suptitle("Cost per policy, relative to on-demand (lower is cheaper)")
    return figure


def utility_vs_slack(rows: Sequence[Row], traces: Sequence[str], policies: Sequence[str]) -> Figure | None:
    """Mean utility relative to optimal against the deadline slack, one line per policy."""
    if not any(r.policy == "optimal" for r in rows):
        return None
    figure, axes = _panels(len(traces))
    for ax, trace in zip(axes, traces):
        for i, policy in enumerate(policies):
            mine = [r for r in rows if r.trace == trace and r.policy == policy]
            slacks = sorted({r.slack for r in mine})
            means = [_mean([r for r in mine if r.slack == s], "utility_vs_optimal") for s in slacks]
            ax.plot(slacks, means, label=policy, **_style(i))
        ax.set_title(trace)
        ax.set_xlabel("deadline slack (deadline / on-demand time)")
        ax.set_ylabel("utility / optimal utility (mean)")
    _legend_below(figure, axes, columns=4)
    figure.suptitle("Utility relative to the hindsight optimum, by deadline slack")
    return figure


def chc_forecast_error(rows: Sequence[Row], traces: Sequence[str]) -> Figure | None:
    """CHC's mean utility relative to optimal against the oracle's injected forecast error.

    The dotted (and, when it was run, dashed) lines per trace are CHC with the real forecasters:
    the per-pool automatic choice of ``docs/forecasting.md`` (and seasonal-naive), for reference.
    """
    errors = {key: spec.forecast_error for key, spec in POLICY_SPECS.items() if spec.forecast_error is not None}
    oracle = [r for r in rows if r.policy in errors]
    if not oracle or not any(r.policy == "optimal" for r in rows):
        return None
    figure, axes = _panels(1)
    ax = axes[0]
    policies = sorted({r.policy for r in oracle}, key=errors.__getitem__)
    for trace in traces:
        mine = [r for r in rows if r.trace == trace]
        means = [_mean([r for r in mine if r.policy == p], "utility_vs_optimal") for p in policies]
        (line,) = ax.plot([errors[p] for p in policies], means, marker="o", label=f"{trace}: oracle + error")
        for policy, style in (("chc-seasonal-naive", "--"), ("chc-auto", ":")):
            real = [r for r in mine if r.policy == policy]
            if real:
                ax.axhline(_mean(real, "utility_vs_optimal"), color=line.get_color(), linestyle=style,
                           label=f"{trace}: {policy.removeprefix('chc-')}")
    ax.set_xlabel("injected relative forecast error")
    ax.set_ylabel("utility / optimal utility (mean)")
    ax.legend(fontsize="small")
    figure.suptitle("CHC's sensitivity to forecast error")
    return figure


def selector_weights(selector: dict[str, Any]) -> Figure | None:
    """The probability each pool member was drawn with, averaged over each start's jobs, per trace.

    Every kind of job has its own weights; averaging over a start's jobs shows how the learner
    as a whole moves between members as rounds come back.
    """
    traces = [t for t, learning in selector.items() if learning.get("plays")]
    if not traces:
        return None
    figure, axes = _panels(len(traces))
    for ax, trace in zip(axes, traces):
        plays = selector[trace]["plays"]
        starts = list(dict.fromkeys(play["start"] for play in plays))
        for i, member in enumerate(selector[trace]["members"]):
            means = [np.mean([p["probabilities"].get(member, 0.0) for p in plays if p["start"] == s]) for s in starts]
            ax.plot(range(1, len(starts) + 1), means, label=member, **_style(i))
        ax.set_title(trace)
        ax.set_xlabel("start time (1 = first; each kind of job warms up before it)")
        ax.set_ylabel("probability played (mean over a start's jobs)")
        ax.set_ylim(bottom=0)
    _legend_below(figure, axes, columns=2)
    figure.suptitle("Selector: member weights over rounds")
    return figure
