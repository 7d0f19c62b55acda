"""The charts of one run's report, drawn from its decision log on the hours-since-first-slot axis.

The x axis of every chart is hours since the first slot on the market's clock, so a replay on
an accelerated clock reads the same as a real run. Charts are drawn with
:class:`matplotlib.figure.Figure` (Agg, no pyplot state) and keep their text as SVG text, which
the SVG writer escapes, so pool names cannot inject markup. Fields added to the log later
(``training``, ``deadline_hours``) may be absent from an older run's log: their charts then say so.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import colormaps, rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.typing import ColorType

from airflow_provider_spotsched.market.trace import parse_timestamp

PREEMPTION_COLOUR = "#d62728"
ON_DEMAND_COLOUR = "#7f7f7f"
# rcParams are process-wide and the API server renders pages in a thread pool: one SVG at a time
_SVG_RC_LOCK = threading.Lock()


class RunSeries:
    """The log as per-slot arrays on the hours-since-first-slot axis (NaN where unknown)."""

    def __init__(self, log: Sequence[Mapping[str, Any]]) -> None:
        self.log = log
        times = [parse_timestamp(str(entry["market_time"])) for entry in log]
        self.hours = np.array([(t - times[0]).total_seconds() / 3600 for t in times])
        steps = np.diff(self.hours)
        self.slot_hours = float(np.median(steps)) if len(steps) and np.median(steps) > 0 else 1.0
        applied_spot = [(entry.get("applied") or {"spot": {}})["spot"] for entry in log]
        self.pools = list(dict.fromkeys(
            pool for entry, spot in zip(log, applied_spot)
            for pool in [*entry["market"], *entry["allocation"]["spot"], *spot]
        ))
        self.preempted = np.diff(np.array([0] + [entry["preemptions"] for entry in log], dtype=float))

    def totals(self, key: str) -> np.ndarray:
        """Instances per slot of the ``allocation`` or ``applied`` field (NaN where absent)."""
        return np.array([_count(entry.get(key)) for entry in self.log])

    def spot(self, pool: str) -> np.ndarray:
        return np.array([entry["applied"]["spot"].get(pool, 0) if entry.get("applied") else np.nan
                         for entry in self.log], dtype=float)

    def on_demand(self) -> np.ndarray:
        return np.array([entry["applied"]["on_demand"] if entry.get("applied") else np.nan for entry in self.log],
                        dtype=float)

    def field(self, name: str) -> np.ndarray:
        return np.array([entry[name] for entry in self.log], dtype=float)

    def market(self, pool: str, name: str) -> np.ndarray:
        return np.array([entry["market"].get(pool, {}).get(name, np.nan) for entry in self.log], dtype=float)

    def one_slot_ahead(self, pool: str, name: str) -> np.ndarray:
        """What the previous slot's forecast said for each slot (NaN for the first slot)."""
        values = [np.nan]
        for entry in self.log[:-1]:
            series = ((entry.get("forecast") or {}).get(pool) or {}).get(name) or []
            values.append(series[0] if series else np.nan)
        return np.array(values, dtype=float)

    def preemption_hours(self) -> np.ndarray:
        return self.hours[self.preempted > 0]

    def training(self, name: str) -> np.ndarray:
        """A field of the runtime's last report at each decision (NaN where none was reported)."""
        values = [(entry.get("training") or {}).get(name) for entry in self.log]
        return np.array([np.nan if v is None else float(v) for v in values], dtype=float)

    def deadlines(self, result: Mapping[str, Any] | None) -> tuple[float | None, float | None]:
        """The soft and hard deadlines in hours: from the result once finished, else from the log."""
        source: Mapping[str, Any] = result if result is not None else self.log[-1]
        soft, hard = source.get("deadline_hours"), source.get("hard_deadline_hours")
        return (None if soft is None else float(soft)), (None if hard is None else float(hard))


def _count(allocation: Mapping[str, Any] | None) -> float:
    if allocation is None:
        return math.nan
    return float(sum(allocation["spot"].values()) + allocation["on_demand"])


def literal(text: str) -> str:
    """``text`` drawn as typed: a ``$`` in a pool or member name starts no mathtext (which would
    fail to parse, or draw something else)."""
    return text.replace("$", r"\$")


def figure_svg(figure: Figure) -> str:
    """The figure as an ``<svg>`` element to inline in HTML (no XML prolog, text kept as text).

    A fixed hash salt makes the element ids, and so the page, the same on every render.
    """
    buffer = io.StringIO()
    with _SVG_RC_LOCK, rc_context({"svg.fonttype": "none", "svg.hashsalt": "spotsched"}):
        figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def _steps(ax: Axes, series: RunSeries, values: np.ndarray, **style: Any) -> None:
    """A per-slot value as a step line covering each slot [start, start + slot)."""
    hours = np.append(series.hours, series.hours[-1] + series.slot_hours)
    ax.step(hours, np.append(values, values[-1]), where="post", **style)


def _mark_preemptions(ax: Axes, series: RunSeries) -> None:
    for n, hour in enumerate(series.preemption_hours()):
        ax.axvline(hour, color=PREEMPTION_COLOUR, linestyle="--", linewidth=1.2,
                   label="preemption" if n == 0 else None)


def _finish(ax: Axes, ylabel: str) -> None:
    ax.set_xlabel("hours since the first slot (market clock)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def plan_versus_actual(series: RunSeries) -> Figure:
    """The first plan, the plan one slot ahead, the decision and what actually ran, per slot."""
    figure = Figure(figsize=(10, 3.6))
    ax = figure.subplots()
    first_at = next((i for i, entry in enumerate(series.log) if entry.get("plan")), None)
    if first_at is not None:
        first, start = series.log[first_at], series.hours[first_at]
        planned = np.array([_count(step) for step in first["plan"]])
        hours = start + series.slot_hours * np.arange(len(planned) + 1)
        ax.step(hours, np.append(planned, planned[-1]), where="post", color="#9467bd", linestyle=":",
                linewidth=2, label=f"first plan (slot {first['slot']})")
    ahead = [np.nan] + [_count(entry["plan"][1]) if entry.get("plan") and len(entry["plan"]) > 1 else np.nan
                        for entry in series.log[:-1]]
    _steps(ax, series, np.array(ahead), color="#ff7f0e", linestyle="-.", label="planned one slot ahead")
    _steps(ax, series, series.totals("allocation"), color="#1f77b4", linestyle="--", label="decided")
    _steps(ax, series, series.totals("applied"), color="#2ca02c", linewidth=2, label="applied (ran)")
    _mark_preemptions(ax, series)
    ax.set_ylim(bottom=0)
    _finish(ax, "instances")
    return figure


def instances_over_time(series: RunSeries) -> Figure:
    """The applied allocation per slot: spot stacked per pool, on-demand on top."""
    figure = Figure(figsize=(10, 3.6))
    ax = figure.subplots()
    bottom = np.zeros(len(series.log))
    colours = colormaps["tab20"]
    # (label, per-slot values, colour, hatch): the on-demand layer alone has a hatch
    layers: list[tuple[str, np.ndarray, ColorType, str | None]] = [
        (pool, series.spot(pool), colours(i % 20), None) for i, pool in enumerate(series.pools)]
    layers.append(("on-demand", series.on_demand(), ON_DEMAND_COLOUR, "//"))
    for label, values, colour, hatch in layers:
        ax.bar(series.hours, np.nan_to_num(values), width=series.slot_hours, bottom=bottom, align="edge",
               color=colour, hatch=hatch, edgecolor="white", linewidth=0.5, label=literal(label))
        bottom += np.nan_to_num(values)
    pending = series.hours[np.isnan(series.on_demand())]
    if len(pending):
        ax.scatter(pending + series.slot_hours / 2, np.zeros(len(pending)), marker="^", color="black",
                   label="decided, not yet applied")
    _mark_preemptions(ax, series)
    _finish(ax, "instances running")
    return figure


def cost_against_on_demand(series: RunSeries, result: Mapping[str, Any] | None) -> Figure:
    """Cost so far at each slot start against N_max on-demand's, ending at completion if finished."""
    figure = Figure(figsize=(10, 3.6))
    ax = figure.subplots()
    hours, cost, on_demand = series.hours, series.field("cost_so_far"), series.field("on_demand_cost_so_far")
    if result is not None and result.get("completion_hours") is not None:
        hours = np.append(hours, float(result["completion_hours"]))
        cost = np.append(cost, float(result["cost"]))
        on_demand = np.append(on_demand, float(result["on_demand_cost"]))
    ax.plot(hours, on_demand, color=ON_DEMAND_COLOUR, linestyle="--", label="N_max on-demand")
    ax.plot(hours, cost, color="#1f77b4", marker=".", label="this run")
    preempted = series.preempted > 0
    ax.scatter(series.hours[preempted], series.field("cost_so_far")[preempted], marker="x", s=80,
               color=PREEMPTION_COLOUR, zorder=3, label="preemption")
    deadline, _ = series.deadlines(result)  # a live run's from its log
    if deadline is not None:
        ax.axvline(deadline, color="black", linestyle=":", label="deadline")
    ax.set_ylim(bottom=0)
    _finish(ax, "USD accumulated")
    return figure


def progress_against_deadline(series: RunSeries, result: Mapping[str, Any] | None) -> Figure:
    """Work done against the straight pace that ends the job at the deadline, and both deadlines."""
    figure = Figure(figsize=(10, 3.6))
    ax = figure.subplots()
    total = float(series.log[-1]["work_total"])
    hours, done = series.hours, series.field("work_done")
    if result is not None and result.get("completion_hours") is not None:
        hours, done = np.append(hours, float(result["completion_hours"])), np.append(done, total)
    soft, hard = series.deadlines(result)
    if soft:
        ax.plot([0.0, soft], [0.0, total], color=ON_DEMAND_COLOUR, linestyle="--", label="required pace")
        ax.axvline(soft, color="black", linestyle=":", label="deadline")
    if hard and soft and hard > soft + 1e-9:
        ax.axvline(hard, color=PREEMPTION_COLOUR, linestyle=":", label="hard deadline")
    ax.axhline(total, color="black", linewidth=0.8, alpha=0.5)
    ax.plot(hours, done, color="#1f77b4", marker=".", label="work done (checkpointed)")
    _mark_preemptions(ax, series)
    ax.set_ylim(bottom=0)
    _finish(ax, "samples")
    return figure


def training_over_time(series: RunSeries) -> Figure:
    """The runtime's reported training loss and measured throughput at each decision."""
    figure = Figure(figsize=(10, 3.2))
    axes = figure.subplots(1, 2)
    for ax, name, ylabel, colour in ((axes[0], "loss", "training loss", "#1f77b4"),
                                     (axes[1], "samples_per_second", "samples per second (measured)", "#2ca02c")):
        values = series.training(name)
        if np.isnan(values).all():
            ax.text(0.5, 0.5, "not reported yet", ha="center", va="center", transform=ax.transAxes, color="#59636e")
        else:
            ax.plot(series.hours, values, color=colour, marker=".")
        for hour in series.preemption_hours():
            ax.axvline(hour, color=PREEMPTION_COLOUR, linestyle="--", linewidth=1.2)
        ax.set_xlabel("hours since the first slot")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    return figure


def forecast_versus_realised(series: RunSeries, pool: str) -> Figure:
    """Realised spot price and availability of one pool against the logged forecasts."""
    figure = Figure(figsize=(10, 3.2))
    axes = figure.subplots(1, 2)
    first_at = next((i for i, entry in enumerate(series.log) if (entry.get("forecast") or {}).get(pool)), None)
    for ax, name, ylabel in ((axes[0], "spot_price", "USD per instance-hour"), (axes[1], "available", "instances")):
        realised = series.market(pool, name)
        ahead = series.one_slot_ahead(pool, name)
        ax.plot(series.hours, realised, color="black", marker=".", label="realised")
        ax.plot(series.hours, ahead, color="#ff7f0e", linestyle="--", label="forecast one slot ahead")
        if first_at is not None:
            first = series.log[first_at]
            values = first["forecast"][pool][name]
            ax.plot(series.hours[first_at] + series.slot_hours * np.arange(1, len(values) + 1), values,
                    color="#9467bd", linestyle=":", label=f"forecast at slot {first['slot']}")
        if name == "spot_price":
            ax.plot(series.hours, series.field("on_demand_price"), color=ON_DEMAND_COLOUR, linewidth=1,
                    label="on-demand price")
        errors = np.abs(ahead - realised)
        known = errors[~np.isnan(errors)]
        error_text = f", one-slot-ahead MAE {known.mean():.3g}" if len(known) else ""
        ax.set_title(f"{'spot price' if name == 'spot_price' else 'availability'}{error_text}", fontsize="medium")
        ax.set_xlabel("hours since the first slot")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return figure
