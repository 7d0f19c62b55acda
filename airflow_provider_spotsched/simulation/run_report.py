"""One run's report page: summary, charts and a per-slot table, from the operator's two XComs.

The page is one self-contained HTML document (no external file, no network), so it renders the
same in the Airflow UI's API server, in a saved file and in a headless browser. It is built from
the run's ``decision_log`` (one entry per slot) and its result (the operator's return value,
``None`` while the run is in progress), and knows nothing of Airflow: the plugin fetches the
XComs and wraps these functions.

A live run's page carries one small inline script: every ``poll_seconds`` it fetches the live
view (:class:`LiveView`: the body rendered again, with :func:`report_version`) and swaps the body
in when the version changed; it stops once the view says the run is no longer live. Without
scripts the page is complete as served. Charts are in :mod:`.run_charts`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any
from urllib.parse import quote

import numpy as np
from matplotlib.figure import Figure

from airflow_provider_spotsched.market.trace import parse_timestamp
from airflow_provider_spotsched.simulation.run_charts import (
    RunSeries,
    cost_against_on_demand,
    figure_svg,
    forecast_versus_realised,
    instances_over_time,
    plan_versus_actual,
    progress_against_deadline,
    training_over_time,
)

LOG_FIELDS = ("slot", "market_time", "market", "on_demand_price", "allocation", "work_done", "work_total",
              "cost_so_far", "on_demand_cost_so_far", "preemptions")
RESULT_FIELDS = ("cost", "on_demand_cost", "savings", "savings_fraction", "completion_hours", "deadline_met",
                 "preemptions", "policy")
ALLOCATION_FORMAT = '{"spot": {pool: n}, "on_demand": n}'  # as error messages spell it

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #1f2328; background: #fff; }
h1 { font-size: 1.4em; margin-bottom: 4px; } h2 { font-size: 1.15em; }
.status { display: inline-block; padding: 2px 10px; border-radius: 10px; font-weight: 600; }
.finished { background: #dafbe1; } .running { background: #fff8c5; } .missed { background: #ffebe9; }
table.summary { border-collapse: collapse; margin: 12px 0 20px; }
table.summary th { text-align: left; font-weight: 500; color: #59636e; padding: 3px 16px 3px 0; }
table.summary td { padding: 3px 16px 3px 0; font-variant-numeric: tabular-nums; }
.layout { display: grid; grid-template-columns: minmax(0, 1fr); gap: 24px; }
@media (min-width: 1500px) { .layout { grid-template-columns: minmax(0, 3fr) minmax(420px, 2fr); } }
figure { margin: 0 0 28px; } figcaption { font-weight: 600; margin-bottom: 4px; }
figure svg { max-width: 100%; height: auto; }
details { margin-bottom: 8px; } summary { cursor: pointer; }
p.empty { padding: 12px; background: #f6f8fa; border: 1px solid #d1d9e0; }
table.slots { border-collapse: collapse; font-size: 0.85em; font-variant-numeric: tabular-nums; }
table.slots th, table.slots td { border-bottom: 1px solid #d1d9e0; padding: 3px 8px; text-align: right;
  vertical-align: top; }
table.slots th { background: #f6f8fa; position: sticky; top: 0; }
table.slots td.text { text-align: left; } table.slots tr.preempted td { background: #ffebe9; }
"""

LIVE_SCRIPT = """
(function () {
  var body = document.getElementById("report");
  var every = 1000 * Number(body.dataset.pollSeconds);
  function poll() {
    fetch(body.dataset.live, {credentials: "same-origin", cache: "no-store"})
      .then(function (r) { if (!r.ok) { throw new Error(r.status); } return r.json(); })
      .then(function (view) {
        body.dataset.polls = String(Number(body.dataset.polls || 0) + 1);
        if (view.version !== body.dataset.version) { body.innerHTML = view.html; body.dataset.version = view.version; }
        if (view.live) { setTimeout(poll, every); } else { body.dataset.stopped = "true"; }
      })
      .catch(function () { setTimeout(poll, 2 * every); });
  }
  setTimeout(poll, every);
})();
"""


@dataclass(frozen=True)
class LiveView:
    """Where a live run's page polls for its redrawn body, and how often."""

    url: str
    poll_seconds: float


def render_run_report(
    decision_log: Sequence[Mapping[str, Any]] | None,
    result: Mapping[str, Any] | None,
    title: str,
    *,
    data_url: str | None = None,
    live: LiveView | None = None,
    not_a_run: str | None = None,
) -> str:
    """The HTML page for one run; ``result`` is ``None`` while the run is in progress.

    :param data_url: where the raw log and result are served, linked from the page if given.
    :param live: the run is live: the page polls this view until it says otherwise.
    :param not_a_run: why the page has no run to show (a task of another operator).
    :raises ValueError: a log entry or the result lacks a field or holds a wrong type.
    """
    body = render_run_body(decision_log, result, title, data_url=data_url, not_a_run=not_a_run)
    attributes = f' data-version="{report_version(decision_log, result)}"'
    script = ""
    if live is not None:
        attributes += (f' data-live="{escape(live.url, quote=True)}" data-poll-seconds="{live.poll_seconds:g}"'
                       ' data-polls="0"')
        script = f"<script>{LIVE_SCRIPT}</script>"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
        f'<div id="report"{attributes}>\n{body}\n</div>\n{script}'
        "\n</body></html>\n"
    )


def render_run_body(
    decision_log: Sequence[Mapping[str, Any]] | None,
    result: Mapping[str, Any] | None,
    title: str,
    *,
    data_url: str | None = None,
    not_a_run: str | None = None,
) -> str:
    """The page's body (what the live view swaps in): summary, charts and the slot table."""
    log = check_decision_log(decision_log)
    checked = check_result(result)
    parts = [f"<h1>{escape(title)}</h1>", _summary(log, checked)]
    if data_url:
        parts.append(f'<p><a href="{escape(data_url, quote=True)}">Raw decision log and result (JSON)</a></p>')
    if not log:
        parts.append(f'<p class="empty">{escape(not_a_run)}</p>' if not_a_run else
                     '<p class="empty">No decision has been recorded for this run yet: the task pushes its '
                     "decision log (XCom key <code>decision_log</code>) once it has decided its first slot.</p>")
    else:
        series = RunSeries(log)
        parts.append('<div class="layout"><div>' + "\n".join(_charts(series, checked)) + "</div>"
                     f"<div><h2>Slot by slot</h2>{_slot_table(series)}</div></div>")
    return "\n".join(parts)


def run_path(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """Where a run's report lies below the pages' prefix: ``runs/{dag_id}/{run_id}/{task_id}``,
    each id percent-encoded, with ``?map_index=N`` for a mapped task."""
    path = "/".join(quote(part, safe="") for part in (dag_id, run_id, task_id))
    return f"runs/{path}" + (f"?map_index={map_index}" if map_index >= 0 else "")


def report_version(decision_log: Sequence[Mapping[str, Any]] | None, result: Mapping[str, Any] | None) -> str:
    """A short digest of what the page shows: it changes whenever the log or the result does."""
    text = json.dumps([decision_log, result], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_decision_log(decision_log: Sequence[Mapping[str, Any]] | None) -> list[Mapping[str, Any]]:
    """The log as a list, or a ValueError naming the first entry and field that are wrong.

    Every field the page reads is checked here, so damaged XComs are refused with the field named
    rather than failing somewhere in the drawing.
    """
    if decision_log is None:
        return []
    if isinstance(decision_log, (str, bytes, Mapping)) or not isinstance(decision_log, Sequence):
        raise ValueError(f"decision_log must be a list of per-slot entries, got {type(decision_log).__name__}")
    for i, entry in enumerate(decision_log):
        where = f"decision_log[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be an object, got {type(entry).__name__}")
        missing = [name for name in LOG_FIELDS if name not in entry]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}; each entry needs {', '.join(LOG_FIELDS)}")
        _check_numbers(where, entry, ("slot", "work_done", "work_total", "cost_so_far", "on_demand_cost_so_far",
                                      "on_demand_price", "preemptions"))
        _check_numbers(where, entry, ("deadline_hours", "hard_deadline_hours"), optional=True)
        for name in ("allocation", "applied"):
            allocation = entry.get(name)
            if allocation is not None and not _is_allocation(allocation):
                raise ValueError(f"{where}.{name} must be {ALLOCATION_FORMAT}, got {allocation!r}")
        plan = entry.get("plan")
        if plan is not None and not (isinstance(plan, list) and all(_is_allocation(step) for step in plan)):
            raise ValueError(f"{where}.plan must be a list of {ALLOCATION_FORMAT}, got {plan!r}")
        _check_market(where, entry["market"])
        _check_forecast(where, entry.get("forecast"))
        training = entry.get("training")
        if training is not None:
            _check_numbers(f"{where}.training", _object(f"{where}.training", training),
                           ("loss", "samples_per_second", "world_size"), optional=True)
        throughput = entry.get("throughput")
        if throughput:  # an empty one is none, as the summary reads it
            _check_numbers(f"{where}.throughput", _object(f"{where}.throughput", throughput), ("alpha",))
            _check_numbers(f"{where}.throughput", throughput, ("beta",), optional=True)
        try:
            parse_timestamp(str(entry["market_time"]))
        except ValueError:
            raise ValueError(f"{where}.market_time must be a UTC ISO-8601 timestamp, "
                             f"got {entry['market_time']!r}") from None
    return list(decision_log)


def check_result(result: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The result unchanged, or a ValueError naming the field that is missing or of a wrong type."""
    if result is None:
        return None
    if not isinstance(result, Mapping):
        raise ValueError(f"result must be the operator's return value (an object), got {type(result).__name__}")
    missing = [name for name in RESULT_FIELDS if name not in result]
    if missing:
        raise ValueError(f"result lacks {', '.join(missing)}; "
                         f"the operator's return value holds {', '.join(RESULT_FIELDS)}")
    _check_numbers("result", result, ("cost", "on_demand_cost", "savings", "savings_fraction", "preemptions"))
    _check_numbers("result", result, ("completion_hours", "deadline_hours", "hard_deadline_hours", "utility", "value",
                                      "slots"), optional=True)
    if not isinstance(result["deadline_met"], (bool, np.bool_)):
        raise ValueError(f"result.deadline_met must be true or false, got {result['deadline_met']!r}")
    return result


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _is_allocation(value: Any) -> bool:
    return (isinstance(value, Mapping) and isinstance(value.get("spot"), Mapping)
            and all(_is_number(n) for n in value["spot"].values()) and _is_number(value.get("on_demand")))


def _check_numbers(where: str, fields: Mapping[str, Any], names: Sequence[str], *, optional: bool = False) -> None:
    """A ValueError naming ``where.name`` for the first of ``names`` that is no number (``optional``: or null)."""
    for name in names:
        value = fields.get(name)
        if not (_is_number(value) or optional and value is None):
            raise ValueError(f"{where}.{name} must be a number{' or null' if optional else ''}, got {value!r}")


def _object(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be an object, got {value!r}")
    return value


def _check_market(where: str, market: Any) -> None:
    """The market seen: ``{pool: {"spot_price": x, "available": n}}``."""
    for pool, seen in _object(f"{where}.market", market).items():
        _check_numbers(f"{where}.market[{pool!r}]", _object(f"{where}.market[{pool!r}]", seen),
                       ("spot_price", "available"))


def _check_forecast(where: str, forecast: Any) -> None:
    """The forecast over the slots ahead, if any: ``{pool: {"spot_price": [x...], "available": [n...]}}``."""
    if forecast is None:
        return
    for pool, ahead in _object(f"{where}.forecast", forecast).items():
        for name in ("spot_price", "available"):
            values = _object(f"{where}.forecast[{pool!r}]", ahead).get(name)
            if not (isinstance(values, list) and all(_is_number(v) for v in values)):
                raise ValueError(f"{where}.forecast[{pool!r}].{name} must be a list of numbers, got {values!r}")


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
            ("Running now", escape(describe_allocation(last.get("applied") or last["allocation"]))
             + ("" if last.get("applied") else " (decided, being applied)")),
            ("Slots decided", str(len(log))),
            ("Last decision", escape(str(last.get("time") or last["market_time"]))),
        ]
        if last.get("next_decision"):
            rows.append(("Next decision", escape(str(last["next_decision"]))))
        training = last.get("training") or {}
        if training.get("loss") is not None:
            rows.append(("Training loss", f"{float(training['loss']):.4g}"))
        if training.get("samples_per_second"):
            rows.append(("Measured throughput", f"{float(training['samples_per_second']):.4g} samples/s on "
                         f"{int(training.get('world_size') or 0)} worker(s)"))
        planned = last.get("throughput")
        if planned:  # the estimate from the work measured so far (throughput_estimate); older logs lack it
            rows.append(("Planning on", f"H(n) = {float(planned['alpha']):.4g} n + {float(planned.get('beta', 0.0)):.4g} "
                         "work units/h (measured so far)"))
    table = "".join(f"<tr><th>{label}</th><td>{value}</td></tr>" for label, value in rows)
    return f"<p>{status}</p><table class=\"summary\">{table}</table>"


def _usd(value: Any) -> str:
    return f"{float(value):,.2f} USD"


def _charts(series: RunSeries, result: Mapping[str, Any] | None) -> list[str]:
    """The charts as ``<figure>`` elements; forecasts get one collapsible figure per pool."""
    parts = [
        _figure("Progress against the deadline", progress_against_deadline(series, result)),
        _figure("Plan versus actual: instances per slot", plan_versus_actual(series)),
        _figure("Spot and on-demand instances over time", instances_over_time(series)),
        _figure("Cost accumulated against the on-demand line", cost_against_on_demand(series, result)),
        _figure("Training: loss and measured throughput", training_over_time(series)),
        "<h2>Forecast versus realised price and availability</h2>",
    ]
    for i, pool in enumerate(series.pools):
        open_attribute = " open" if i == 0 else ""
        parts.append(f"<details{open_attribute}><summary>{escape(pool)}</summary>"
                     + _figure(f"Pool {pool}", forecast_versus_realised(series, pool)) + "</details>")
    return parts


def _figure(caption: str, figure: Figure) -> str:
    return f"<figure><figcaption>{escape(caption)}</figcaption>{figure_svg(figure)}</figure>"


def _slot_table(series: RunSeries) -> str:
    """One row per slot: when, the market of the pools in play, the decision, what ran, the money."""
    start = parse_timestamp(str(series.log[0]["market_time"]))
    head = ("<tr><th>slot</th><th>h</th><th>decided</th><th>ran</th><th>market (USD/h, available)</th>"
            "<th>work done</th><th>cost so far</th><th>preempt.</th></tr>")
    rows = []
    for entry, preempted in zip(series.log, series.preempted):
        hours = (parse_timestamp(str(entry["market_time"])) - start).total_seconds() / 3600
        in_play = {*entry["allocation"]["spot"], *((entry.get("applied") or {}).get("spot") or {})}
        market = "<br>".join(
            f"{escape(pool)} {float(entry['market'][pool]['spot_price']):.3g}, {int(entry['market'][pool]['available'])}"
            for pool in sorted(in_play) if pool in entry["market"])
        ran = describe_allocation(entry["applied"]) if entry.get("applied") else "(pending)"
        row_class = ' class="preempted"' if preempted > 0 else ""
        rows.append(
            f"<tr{row_class}><td>{int(entry['slot'])}</td><td>{hours:.1f}</td>"
            f'<td class="text">{escape(describe_allocation(entry["allocation"]))}</td><td class="text">{escape(ran)}</td>'
            f'<td class="text">{market or "-"}</td><td>{float(entry["work_done"]):.4g}</td>'
            f"<td>{float(entry['cost_so_far']):,.2f}</td><td>{int(entry['preemptions'])}</td></tr>")
    return f'<table class="slots">{head}{"".join(rows)}</table>'


def describe_allocation(allocation: Mapping[str, Any] | None) -> str:
    """``2 us-east4-a + 1 on-demand``; ``idle`` for nothing."""
    if not allocation:
        return "idle"
    parts = [f"{int(n)} {pool}" for pool, n in allocation["spot"].items() if n]
    if allocation["on_demand"]:
        parts.append(f"{int(allocation['on_demand'])} on-demand")
    return " + ".join(parts) or "idle"
