"""The fleet dashboard's page: the summary of :mod:`.fleet` as one self-contained HTML document.

Charts are drawn with :class:`matplotlib.figure.Figure` as inline SVG and kept by a digest of
what they draw, so a reload over an unchanged fleet draws nothing; every id, pool and member
name is escaped. Links go to each run's report page (:mod:`.run_report`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from html import escape
from typing import Any
from urllib.parse import urlencode

from matplotlib import colormaps, dates
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from airflow_provider_spotsched.market.slots import cloud_region
from airflow_provider_spotsched.simulation.fleet import parse_bound, utc
from airflow_provider_spotsched.simulation.run_charts import ON_DEMAND_COLOUR, figure_svg, literal
from airflow_provider_spotsched.simulation.run_report import run_path

MAX_SELECTOR_CHARTS = 4  # kinds of job whose weights are drawn (the most recently learnt); all are tabled
MARKED_ROUNDS = 40  # up to this many rounds a weight chart marks every round's point
SVG_CACHE_SIZE = 32  # drawn charts kept, by what they draw: an unchanged fleet is not drawn again
SAVED_COLOUR = "#2ca02c"
SPEND_COLOUR = "#1f77b4"

# -- charts --------------------------------------------------------------------------------


def savings_chart(series: Mapping[str, Any]) -> Figure:
    """Cumulative spend against what N_max on-demand instances would have cost; the gap is saved."""
    figure = Figure(figsize=(10, 3.6))
    ax = figure.subplots()
    points = series["points"]
    times = [datetime.fromisoformat(p["time"].replace("Z", "+00:00")) for p in points]
    cost = [p["cumulative_cost"] for p in points]
    reference = [p["cumulative_on_demand_cost"] for p in points]
    # the lines start at zero and hold their last level a little past the last run, so both ends show
    pad = max((times[-1] - times[0]) / 40, timedelta(minutes=1))
    times = [times[0] - pad, *times, times[-1] + pad]
    cost, reference = [0.0, *cost, cost[-1]], [0.0, *reference, reference[-1]]
    x = dates.date2num(times)
    ax.fill_between(x, cost, reference, step="post", color=SAVED_COLOUR, alpha=0.25,
                    label=f"saved: {points[-1]['cumulative_savings']:,.2f} USD")
    ax.step(x, reference, where="post", color=ON_DEMAND_COLOUR, linestyle="--", label="N_max on-demand")
    ax.step(x, cost, where="post", color=SPEND_COLOUR, linewidth=2, label="spent")
    locator = dates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(dates.ConciseDateFormatter(locator))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("run end (UTC)")
    ax.set_ylabel("USD, cumulative")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return figure


def preemptions_chart(preemptions: Mapping[str, Any]) -> Figure:
    """Preemptions per pool (zone), coloured by region, beside their roll-up per region."""
    by_pool, by_region = preemptions["by_pool"], preemptions["by_region"]
    regions = list(by_region)
    colours = colormaps["tab10"]
    colour = {region: colours(i % 10) for i, region in enumerate(regions)}
    rows = max(len(by_pool), len(by_region), 1)
    figure = Figure(figsize=(10, 1.2 + 0.32 * rows), layout="constrained")
    left, right = figure.subplots(1, 2, width_ratios=(3, 2))
    pools = list(by_pool)[::-1]
    left.barh([literal(p) for p in pools], [by_pool[p] for p in pools], color=[colour[cloud_region(p)] for p in pools])
    left.set_title("per pool (zone)", fontsize="medium")
    names = regions[::-1]
    right.barh([literal(r) for r in names], [by_region[r] for r in names], color=[colour[r] for r in names])
    right.set_title("rolled up per region", fontsize="medium")
    for ax in (left, right):
        ax.set_xlabel("preemptions")
        ax.grid(axis="x", alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return figure


def selector_chart(kind: Mapping[str, Any]) -> Figure:
    """One kind of job: each member's weight over the rounds learnt, the played member marked."""
    figure = Figure(figsize=(10, 3.4))
    ax = figure.subplots()
    colours = colormaps["tab10"]
    rounds = kind["rounds"]
    for i, member in enumerate(kind["members"]):
        values = [math.nan if w is None else w for w in kind["weights"][member]]
        ax.plot(rounds, values, marker="." if len(rounds) <= MARKED_ROUNDS else None, color=colours(i % 10), label=literal(member))
    played = [(r, kind["weights"][m][j]) for j, (r, m) in enumerate(zip(rounds, kind["played"]))
              if m in kind["weights"] and kind["weights"][m][j] is not None]
    if played:
        ax.scatter([r for r, _ in played], [w for _, w in played], s=70 if len(rounds) <= MARKED_ROUNDS else 16,
                   facecolors="none", edgecolors="black",
                   zorder=3, label="member played that round")
    ax.set_xlabel("round (jobs of this kind learnt from)")
    ax.set_ylabel("weight (draw probability)")
    ax.set_ylim(0, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="x-small", frameon=False)
    return figure


# -- the page ------------------------------------------------------------------------------

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #1f2328; background: #fff; }
h1 { font-size: 1.4em; margin-bottom: 4px; } h2 { font-size: 1.15em; margin-top: 28px; }
p.note { color: #59636e; margin: 4px 0 12px; font-size: 0.9em; }
form.filters { display: flex; flex-wrap: wrap; gap: 12px; align-items: end; padding: 12px;
  background: #f6f8fa; border: 1px solid #d1d9e0; border-radius: 6px; margin: 12px 0 20px; }
form.filters label { display: flex; flex-direction: column; font-size: 0.85em; color: #59636e; gap: 4px; }
form.filters select, form.filters input { font: inherit; padding: 4px 6px; min-width: 12em; }
form.filters button { font: inherit; padding: 5px 14px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(190px, 1fr)); gap: 12px; margin: 8px 0 16px; }
.card { border: 1px solid #d1d9e0; border-radius: 6px; padding: 10px 14px; }
.card .label { color: #59636e; font-size: 0.85em; } .card .value { font-size: 1.5em; font-weight: 600; white-space: nowrap; }
.card .value small { font-size: 0.6em; font-weight: 500; }
.card .detail { color: #59636e; font-size: 0.8em; margin-top: 2px; }
.card.good .value { color: #1a7f37; } .card.bad .value { color: #cf222e; }
figure { margin: 0 0 24px; } figcaption { font-weight: 600; margin-bottom: 4px; }
figure svg { max-width: 100%; height: auto; }
p.empty { padding: 12px; background: #f6f8fa; border: 1px solid #d1d9e0; }
table.runs { border-collapse: collapse; font-size: 0.85em; font-variant-numeric: tabular-nums; margin-bottom: 12px; }
table.runs th, table.runs td { border-bottom: 1px solid #d1d9e0; padding: 3px 6px; text-align: right; vertical-align: top;
  white-space: nowrap; }
div.scroll { overflow-x: auto; }
table.runs th { background: #f6f8fa; } table.runs td.text, table.runs th.text { text-align: left; }
.tag { display: inline-block; padding: 0 8px; border-radius: 8px; font-size: 0.9em; }
.met { background: #dafbe1; } .soft_miss { background: #fff8c5; } .hard_miss, .missed, .no_result, .unreadable { background: #ffebe9; }
.in_flight { background: #ddf4ff; }
details { margin-bottom: 8px; } summary { cursor: pointer; }
"""

_OUTCOME_LABEL = {"met": "met", "soft_miss": "soft miss", "hard_miss": "hard miss", "missed": "missed (hard: unknown)"}
_STATUS_LABEL = {"in_flight": "in flight", "no_result": "ended, no result", "unreadable": "unreadable result"}


@dataclass(frozen=True)
class FleetFilters:
    """What the page is filtered on, and the DAGs the viewer may pick from."""

    readable_dags: Sequence[str]
    dag_ids: Sequence[str] = ()
    since: str | None = None  # as given, for the form
    until: str | None = None


def render_fleet_page(summary: Mapping[str, Any], selector: Mapping[str, Any], filters: FleetFilters, *,
                      data_url: str | None = None, generated: datetime | None = None) -> str:
    """The dashboard's HTML page from :func:`summarise` and :func:`selector_view`."""
    totals = summary["totals"]
    scope = (", ".join(filters.dag_ids) if filters.dag_ids else
             f"all {len(filters.readable_dags)} DAG(s) with spot runs you may read")
    if filters.since or filters.until:
        scope += f"; run dates from {filters.since or 'the first'} to {filters.until or 'now'}"
    parts = [
        "<h1>Spot fleet</h1>",
        f'<p class="note">{escape(scope)}. Times in UTC'
        + (f"; as of {escape(utc(generated).strftime('%Y-%m-%d %H:%M'))}" if generated else "") + ".</p>",
        _filter_form(filters),
        _cards(summary),
        _missing_note(totals),
        "<h2>Money saved against on-demand</h2>",
        _figure("Cumulative spend against N_max on-demand instances, by run end", savings_chart,
                summary["savings_over_time"])
        if summary["savings_over_time"]["points"] else '<p class="empty">No finished run with a cost to draw yet.</p>',
        "<h2>Preemptions</h2>",
        _preemptions(summary["preemptions"]),
        "<h2>Per DAG</h2>",
        _dag_table(summary["dags"], filters),
        "<h2>Most recent runs</h2>",
        _recent_table(summary["recent_runs"], totals["runs"]),
        "<h2>The selector's weights per kind of job</h2>",
        _selector_section(selector),
    ]
    if data_url:
        parts.append(f'<p class="note"><a href="{escape(data_url, quote=True)}">The same data as JSON</a></p>')
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>Spot fleet</title>'
            f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(p for p in parts if p) + "\n</body></html>\n")


def _filter_form(filters: FleetFilters) -> str:
    chosen = set(filters.dag_ids)
    multiple = " multiple" if len(chosen) > 1 else ""
    options = ['<option value="">all DAGs you may read</option>'] + [
        f'<option value="{escape(dag, quote=True)}"{" selected" if dag in chosen else ""}>{escape(dag)}</option>'
        for dag in sorted({*filters.readable_dags, *chosen})]
    fields = [f'<label>DAG<select name="dag_id"{multiple}>{"".join(options)}</select></label>']
    for name, label, value in (("since", "run date from", filters.since), ("until", "up to and including", filters.until)):
        kind = "datetime-local" if value and "T" in value else "date"
        shown = value or ""
        if kind == "datetime-local":
            try:
                shown = parse_bound(value or "", upper=False).strftime("%Y-%m-%dT%H:%M")
            except ValueError:
                pass
        fields.append(f'<label>{label}<input type="{kind}" name="{name}" value="{escape(shown, quote=True)}"></label>')
    return (f'<form class="filters" method="get" action="fleet">{"".join(fields)}'
            '<button type="submit">Apply</button><a href="fleet">reset</a></form>')


def _card(label: str, value: str, detail: str = "", tone: str = "") -> str:
    tone_class = f" {tone}" if tone else ""
    return (f'<div class="card{tone_class}"><div class="label">{escape(label)}</div><div class="value">{value}</div>'
            + (f'<div class="detail">{detail}</div>' if detail else "") + "</div>")


def _cards(summary: Mapping[str, Any]) -> str:
    totals, budget, flying = summary["totals"], summary["budget"], summary["in_flight"]
    deadline = totals["deadline"]
    fraction = totals["savings_fraction"]
    hit = deadline["hit_rate"]
    cards = [
        _card("Runs", str(totals["runs"]), f"{totals['finished']} finished, {totals['in_flight']} in flight"
              + (f", {totals['ended_without_result']} ended without a result" if totals["ended_without_result"] else "")
              + (f", {totals['unreadable_results']} unreadable" if totals["unreadable_results"] else "")),
        _card("Saved against on-demand", _usd_card(totals["savings"]),
              f"{100 * fraction:.1f} % of {_usd(totals['on_demand_cost'])}" if fraction is not None else "",
              "good" if totals["savings"] > 0 else ""),
        _card("Spent", _usd_card(totals["cost"]), "by finished runs"),
        _card("Deadline hit rate", "-" if hit is None else f"{100 * hit:.1f} %",
              f"{deadline['met']} of {deadline['known']} met", "good" if hit == 1 else "bad" if hit is not None and hit < 1 else ""),
        _card("Soft misses", str(deadline["soft_miss"]), "late, by the hard deadline", "bad" if deadline["soft_miss"] else ""),
        _card("Hard misses", str(deadline["hard_miss"]), "after the hard deadline, or never"
              + (f"; {deadline['missed']} late of unknown kind" if deadline["missed"] else ""),
              "bad" if deadline["hard_miss"] else ""),
        _card("Preemptions", _count(totals["preemptions"]), f"in {len(summary['preemptions']['by_pool'])} pool(s)"),
        _card("Spend against budget", "-" if budget["fraction"] is None else f"{100 * budget['fraction']:.1f} %",
              "no run set a budget" if not budget["runs"] else
              f"{_usd(budget['spend'])} of {_usd(budget['budget'])} over {budget['runs']} run(s) with a budget"
              + (f"; highest {100 * budget['highest']['fraction']:.1f} %" if budget["highest"] else "")
              + (f"; {budget['over_budget']} over" if budget["over_budget"] else ""),
              "bad" if budget["over_budget"] else ""),
        _card("In flight", str(flying["runs"]),
              f"{_usd(flying['cost_so_far'])} spent so far, {_count(flying['preemptions_so_far'])} preemption(s)"
              f" ({flying['with_progress']} with a decision logged)" if flying["runs"] else "none running"),
    ]
    return f'<div class="cards">{"".join(cards)}</div>'


def _missing_note(totals: Mapping[str, Any]) -> str:
    missing = totals["missing"]
    if not missing:
        return ""
    listed = ", ".join(f"{escape(key)} ({n})" for key, n in missing.items())
    return (f'<p class="note">Some finished runs\' results lack a field (written by an older version of the operator); '
            f"they are left out of that field's figure: {listed}.</p>")


def _preemptions(preemptions: Mapping[str, Any]) -> str:
    parts = []
    if preemptions["by_pool"]:
        parts.append(_figure("Preemptions per pool (zone) and per region", preemptions_chart, preemptions))
        rows = "".join(f'<tr><td class="text">{escape(region)}</td><td>{_count(n)}</td></tr>'
                       for region, n in preemptions["by_region"].items())
        parts.append('<p class="note">Regions are read from the pool names: a zone <code>us-east4-a</code> is in region '
                     "<code>us-east4</code>, <code>us-east-1a</code> in <code>us-east-1</code>.</p>"
                     f'<table class="runs"><tr><th class="text">region</th><th>preemptions</th></tr>{rows}</table>')
    elif not preemptions["total"]:
        parts.append('<p class="empty">No finished run was preempted.</p>')
    if preemptions["unattributed"]:
        parts.append(f'<p class="note">{_count(preemptions["unattributed"])} preemption(s) of runs whose result records '
                     "no pool (older results) are counted in the total only.</p>")
    return "\n".join(parts)


def _dag_table(rows: Sequence[Mapping[str, Any]], filters: FleetFilters) -> str:
    if not rows:
        return '<p class="empty">No spot run matches these filters.</p>'
    head = ("<tr><th class=\"text\">DAG</th><th>runs</th><th>finished</th><th>in flight</th><th>cost</th>"
            "<th>on-demand</th><th>saved</th><th>hit rate</th><th>soft misses</th><th>hard misses</th><th>preemptions</th></tr>")
    body = []
    for row in rows:
        query = urlencode({"dag_id": row["dag_id"], **{k: v for k, v in (("since", filters.since), ("until", filters.until)) if v}})
        hit = row["deadline"]["hit_rate"]
        body.append(
            f'<tr><td class="text"><a href="fleet?{escape(query, quote=True)}">{escape(row["dag_id"])}</a></td>'
            f"<td>{row['runs']}</td><td>{row['finished']}</td><td>{row['in_flight']}</td><td>{_money(row['cost'])}</td>"
            f"<td>{_money(row['on_demand_cost'])}</td><td>{_money(row['savings'])}</td>"
            f"<td>{'-' if hit is None else f'{100 * hit:.0f} %'}</td><td>{row['deadline']['soft_miss']}</td>"
            f"<td>{row['deadline']['hard_miss']}</td><td>{_count(row['preemptions'])}</td></tr>")
    return f'<div class="scroll"><table class="runs">{head}{"".join(body)}</table></div>'


def _recent_table(rows: Sequence[Mapping[str, Any]], total: int) -> str:
    if not rows:
        return '<p class="empty">No spot run matches these filters.</p>'
    head = ("<tr><th class=\"text\">DAG</th><th class=\"text\">run</th><th class=\"text\">task</th>"
            "<th class=\"text\">ended (UTC)</th><th class=\"text\">outcome</th><th>cost</th><th>on-demand</th>"
            "<th>saved</th><th>preempt.</th><th class=\"text\">policy</th></tr>")
    body = []
    for row in rows:
        link = run_path(row["dag_id"], row["run_id"], row["task_id"], row["map_index"])
        task = row["task_id"] + (f" [{row['map_index']}]" if row["map_index"] >= 0 else "")
        if row["status"] == "finished":
            kind = row["outcome"]
            tag = (f'<span class="tag {kind}">{_OUTCOME_LABEL[kind]}</span>' if kind else "unknown")
            figures = (f"<td>{_money(row['cost'])}</td><td>{_money(row['on_demand_cost'])}</td>"
                       f"<td>{_money(row['savings'])}</td><td>{_count(row['preemptions'])}</td>"
                       f'<td class="text">{escape(row["policy"] or "-")}</td>')
        else:
            tag = f'<span class="tag {row["status"]}">{_STATUS_LABEL[row["status"]]}</span>'
            progress = row.get("progress")
            if progress:
                done = progress["work_fraction"]
                figures = (f"<td>{_money(progress['cost_so_far'])}</td><td>{_money(progress['on_demand_cost_so_far'])}</td>"
                           f'<td class="text">{"-" if done is None else f"{100 * done:.0f} % done"}</td>'
                           f"<td>{_count(progress['preemptions'])}</td><td class=\"text\">so far</td>")
            else:
                figures = '<td></td><td></td><td></td><td></td><td class="text">-</td>'
        ended = row["end_date"] or (f"started {row['start_date']}" if row["start_date"] else "-")
        body.append(f'<tr><td class="text">{escape(row["dag_id"])}</td>'
                    f'<td class="text"><a href="{escape(link, quote=True)}">{escape(row["run_id"])}</a></td>'
                    f'<td class="text">{escape(task)}</td><td class="text">{escape(_short_time(ended))}</td>'
                    f'<td class="text">{tag}</td>{figures}</tr>')
    note = f'<p class="note">The {len(rows)} runs that moved last, of {total}; each opens its run report.</p>'
    return f'{note}<div class="scroll"><table class="runs">{head}{"".join(body)}</table></div>'


def _selector_section(selector: Mapping[str, Any]) -> str:
    intro = (f'<p class="note">From the Variable <code>{escape(selector["variable"])}</code>, which every run sharing it '
             "updates: the weights are learnt from all of them, including runs of DAGs not shown here.</p>")
    if not selector["contexts"]:
        return intro + f'<p class="empty">{escape(selector["message"])}</p>'
    parts = [intro]
    parts.append(_leaders_table(selector["contexts"]))
    for kind in selector["contexts"][:MAX_SELECTOR_CHARTS]:
        parts.append(_figure(f"{kind['context']} ({len(kind['rounds'])} round(s))", selector_chart, kind))
    rest = len(selector["contexts"]) - MAX_SELECTOR_CHARTS
    if rest > 0:
        parts.append(f'<p class="note">{rest} more kind(s) of job, learnt from earlier, are in the table only.</p>')
    if selector["skipped_entries"]:
        parts.append(f'<p class="note">{selector["skipped_entries"]} history entr(ies) without a kind, round or weights '
                     "were skipped.</p>")
    return "\n".join(parts)


_svg_cache: OrderedDict[str, str] = OrderedDict()
_svg_cache_lock = threading.Lock()


def chart_svg(draw: Callable[[Any], Figure], data: Any) -> str:
    """``draw(data)`` as inline SVG, from a small cache keyed by the chart and a digest of its data.

    Drawing is most of a page's time (a tenth of a second per chart), and the charts change only
    when a run finishes or the selector learns a round, so a page reloaded over the same data
    reuses them. The SVG of the same data is the same (:func:`figure_svg` fixes its ids).
    """
    key = hashlib.sha256(json.dumps([draw.__qualname__, data], sort_keys=True, default=str).encode()).hexdigest()
    with _svg_cache_lock:
        if key in _svg_cache:
            _svg_cache.move_to_end(key)
            return _svg_cache[key]
    svg = figure_svg(draw(data))
    with _svg_cache_lock:
        _svg_cache[key] = svg
        while len(_svg_cache) > SVG_CACHE_SIZE:
            _svg_cache.popitem(last=False)
    return svg


def clear_chart_cache() -> None:
    """Forget every drawn chart (for measuring a page drawn from scratch)."""
    with _svg_cache_lock:
        _svg_cache.clear()


def _leaders_table(kinds: Sequence[Mapping[str, Any]]) -> str:
    """Every kind of job: its rounds and the member it now draws most often."""
    rows = []
    for kind in kinds:
        last = {m: kind["weights"][m][-1] for m in kind["members"] if kind["weights"][m][-1] is not None}
        leader = max(last, key=lambda m: last[m]) if last else None
        rows.append(f'<tr><td class="text">{escape(kind["context"])}</td><td>{len(kind["rounds"])}</td>'
                    f'<td class="text">{escape(leader or "-")}</td>'
                    f"<td>{'-' if leader is None else f'{last[leader]:.2f}'}</td></tr>")
    head = ('<tr><th class="text">kind of job</th><th>rounds</th><th class="text">leading member now</th>'
            "<th>its weight</th></tr>")
    return f'<div class="scroll"><table class="runs">{head}{"".join(rows)}</table></div>'


def _figure(caption: str, draw: Callable[[Any], Figure], data: Any) -> str:
    return f"<figure><figcaption>{escape(caption)}</figcaption>{chart_svg(draw, data)}</figure>"


def _usd(value: float) -> str:
    return f"{value:,.2f} USD"


def _usd_card(value: float) -> str:
    return f"{value:,.2f} <small>USD</small>"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _short_time(text: str) -> str:
    """``2025-10-07T12:34:56.789Z`` as ``2025-10-07 12:34``."""
    return re.sub(r"(\d{4}-\d{2}-\d{2})T(\d{2}:\d{2})[:\d.]*(Z|[+-]\d{2}:\d{2})?", r"\1 \2", text)
