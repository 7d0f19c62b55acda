"""One run's report page: a summary and inline-SVG charts, from the operator's two XCom values.

The page is a single self-contained HTML document (no script, no external file, no network),
so it renders the same in the Airflow UI's API server, in a saved file and in a headless
browser. It is built from the run's ``decision_log`` (one entry per slot) and its result (the
operator's return value, ``None`` while the run is in progress), and knows nothing of Airflow:
the plugin fetches the XComs and wraps this function.

The x axis of every chart is hours since the first slot on the market's clock, so a replay on
an accelerated clock reads the same as a real run. Charts are drawn with
:class:`matplotlib.figure.Figure` (Agg, no pyplot state) and keep their text as SVG text, which
the SVG writer escapes, so pool names cannot inject markup.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

import numpy as np
from matplotlib import colormaps, rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.typing import ColorType

from airflow_provider_spotsched.market.trace import parse_timestamp

LOG_FIELDS = ("slot", "market_time", "market", "on_demand_price", "allocation", "work_done", "work_total",
              "cost_so_far", "on_demand_cost_so_far", "preemptions")
RESULT_FIELDS = ("cost", "on_demand_cost", "savings", "savings_fraction", "completion_hours", "deadline_met",
                 "preemptions", "policy")
PREEMPTION_COLOUR = "#d62728"
# rcParams are process-wide and the API server renders pages in a thread pool: one SVG at a time
_SVG_RC_LOCK = threading.Lock()
ON_DEMAND_COLOUR = "#7f7f7f"

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #1f2328; background: #fff; }
h1 { font-size: 1.4em; margin-bottom: 4px; }
.status { display: inline-block; padding: 2px 10px; border-radius: 10px; font-weight: 600; }
.finished { background: #dafbe1; } .running { background: #fff8c5; } .missed { background: #ffebe9; }
table.summary { border-collapse: collapse; margin: 12px 0 20px; }
table.summary th { text-align: left; font-weight: 500; color: #59636e; padding: 3px 16px 3px 0; }
table.summary td { padding: 3px 16px 3px 0; font-variant-numeric: tabular-nums; }
figure { margin: 0 0 28px; } figcaption { font-weight: 600; margin-bottom: 4px; }
figure svg { max-width: 100%; height: auto; }
details { margin-bottom: 8px; } summary { cursor: pointer; }
p.empty { padding: 12px; background: #f6f8fa; border: 1px solid #d1d9e0; }
"""


def render_run_report(
    decision_log: Sequence[Mapping[str, Any]] | None,
    result: Mapping[str, Any] | None,
    title: str,
    *,
    data_url: str | None = None,
) -> str:
    """The HTML page for one run; ``result`` is ``None`` while the run is in progress.

    :param data_url: where the raw log and result are served, linked from the page if given.
    :raises ValueError: a log entry or the result lacks a field or holds a wrong type.
    """
    log = check_decision_log(decision_log)
    checked = check_result(result)
    parts = [f"<h1>{escape(title)}</h1>", _summary(log, checked)]
    if data_url:
        parts.append(f'<p><a href="{escape(data_url, quote=True)}">Raw decision log and result (JSON)</a></p>')
    if not log:
        parts.append('<p class="empty">No decision has been recorded for this run yet: the task pushes its '
                     "decision log (XCom key <code>decision_log</code>) once it has decided its first slot.</p>")
    else:
        parts.extend(_charts(RunSeries(log), checked))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )


def check_decision_log(decision_log: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    """The log as a list, or a ValueError naming the first entry and field that are wrong."""
    if decision_log is None:
        return []
    if isinstance(decision_log, (str, bytes, Mapping)) or not isinstance(decision_log, Sequence):
        raise ValueError(f"decision_log must be a list of per-slot entries, got {type(decision_log).__name__}")
    for i, entry in enumerate(decision_log):
        if not isinstance(entry, Mapping):
            raise ValueError(f"decision_log[{i}] must be an object, got {type(entry).__name__}")
        missing = [name for name in LOG_FIELDS if name not in entry]
        if missing:
            raise ValueError(f"decision_log[{i}] lacks {', '.join(missing)}; each entry needs {', '.join(LOG_FIELDS)}")
        for name in ("work_done", "work_total", "cost_so_far", "on_demand_cost_so_far", "on_demand_price",
                     "preemptions"):
            if not _is_number(entry[name]):
                raise ValueError(f"decision_log[{i}].{name} must be a number, got {entry[name]!r}")
        for name in ("allocation", "applied"):
            allocation = entry.get(name)
            if allocation is not None and not _is_allocation(allocation):
                raise ValueError(f'decision_log[{i}].{name} must be {{"spot": {{pool: n}}, "on_demand": n}}, '
                                 f"got {allocation!r}")
        try:
            parse_timestamp(str(entry["market_time"]))
        except ValueError:
            raise ValueError(f"decision_log[{i}].market_time must be a UTC ISO-8601 timestamp, "
                             f"got {entry['market_time']!r}") from None
    return list(decision_log)


def check_result(result: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The result unchanged, or a ValueError naming the missing field."""
    if result is None:
        return None
    if not isinstance(result, Mapping):
        raise ValueError(f"result must be the operator's return value (an object), got {type(result).__name__}")
    missing = [name for name in RESULT_FIELDS if name not in result]
    if missing:
        raise ValueError(f"result lacks {', '.join(missing)}; "
                         f"the operator's return value holds {', '.join(RESULT_FIELDS)}")
    return result


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_allocation(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("spot"), Mapping) and _is_number(value.get("on_demand"))


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


def _count(allocation: Mapping[str, Any] | None) -> float:
    if allocation is None:
        return math.nan
    return float(sum(allocation["spot"].values()) + allocation["on_demand"])


def _summary(log: Sequence[Mapping[str, Any]], result: Mapping[str, Any] | None) -> str:
    """The status line and the table of headline figures (final if finished, so far if not)."""
    rows: list[tuple[str, str]] = []
    if result is not None:
        met = bool(result["deadline_met"])
        status = ('<span class="status finished">finished, deadline met</span>' if met
                  else '<span class="status missed">finished, deadline missed</span>')
        completion = result["completion_hours"]
        deadline = result.get("deadline_hours")
        rows += [
            ("Policy", escape(str(result["policy"]))),
            ("Cost", _usd(result["cost"])),
            ("On-demand cost (N_max on-demand)", _usd(result["on_demand_cost"])),
            ("Savings", f"{_usd(result['savings'])} ({100 * float(result['savings_fraction']):.1f} %)"),
            ("Completion", "never" if completion is None else f"{float(completion):.2f} h"
             + ("" if deadline is None else f" (deadline {float(deadline):.2f} h)")),
            ("Deadline met", "yes" if met else "no"),
            ("Preemptions", str(int(result["preemptions"]))),
        ]
        rows += [(label, fmt(result[key])) for key, label, fmt in (
            ("utility", "Utility (value - cost)", _usd), ("value", "Value", _usd),
            ("slots", "Slots", lambda v: str(int(v))), ("job_id", "Job id", lambda v: escape(str(v))),
        ) if result.get(key) is not None]
    else:
        status = '<span class="status running">in progress</span>'
    if log and result is None:
        last = log[-1]
        done = float(last["work_done"])
        total = float(last["work_total"])
        rows += [
            ("Cost so far", _usd(last["cost_so_far"])),
            ("On-demand cost so far", _usd(last["on_demand_cost_so_far"])),
            ("Work done", f"{done:.4g} of {total:.4g} ({100 * done / total if total else 0:.1f} %)"),
            ("Preemptions so far", str(int(last["preemptions"]))),
            ("Slots decided", str(len(log))),
            ("Last decision", escape(str(last.get("time") or last["market_time"]))),
        ]
    table = "".join(f"<tr><th>{label}</th><td>{value}</td></tr>" for label, value in rows)
    return f"<p>{status}</p><table class=\"summary\">{table}</table>"


def _usd(value: Any) -> str:
    return f"{float(value):,.2f} USD"


def _charts(series: RunSeries, result: Mapping[str, Any] | None) -> list[str]:
    """The four charts as ``<figure>`` elements; forecasts get one collapsible figure per pool."""
    parts = [
        _figure("Plan versus actual: instances per slot", plan_versus_actual(series)),
        _figure("Spot and on-demand instances over time", instances_over_time(series)),
        _figure("Cost accumulated against the on-demand line", cost_against_on_demand(series, result)),
        "<h2>Forecast versus realised price and availability</h2>",
    ]
    for i, pool in enumerate(series.pools):
        open_attribute = " open" if i == 0 else ""
        parts.append(f"<details{open_attribute}><summary>{escape(pool)}</summary>"
                     + _figure(f"Pool {pool}", forecast_versus_realised(series, pool)) + "</details>")
    return parts


def _figure(caption: str, figure: Figure) -> str:
    return f"<figure><figcaption>{escape(caption)}</figcaption>{figure_svg(figure)}</figure>"


def figure_svg(figure: Figure) -> str:
    """The figure as an ``<svg>`` element to inline in HTML (no XML prolog, text kept as text)."""
    buffer = io.StringIO()
    with _SVG_RC_LOCK, rc_context({"svg.fonttype": "none"}):
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
               color=colour, hatch=hatch, edgecolor="white", linewidth=0.5, label=label)
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
    if result is not None and result.get("deadline_hours") is not None:
        ax.axvline(float(result["deadline_hours"]), color="black", linestyle=":", label="deadline")
    ax.set_ylim(bottom=0)
    _finish(ax, "USD accumulated")
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
