"""The fleet dashboard: every spot run a user may read, summed up, and the selector's learning.

Airflow-free, like :mod:`.run_report`: the plugin (:mod:`airflow_provider_spotsched.plugins.fleet_pages`)
reads the runs from the metadata database as :class:`FleetRun` records (one per task instance of
the fine-tuning operator, with its result, the operator's XCom ``return_value``) and the
selector's Variable as text; this module sums them up (:func:`summarise`, JSON-ready) and draws
the page (:func:`render_fleet_page`, one self-contained HTML document, charts as inline SVG).

Results written by older versions of the operator lack the newer keys (``hard_deadline_met``,
``preemptions_by_pool``, ``budget``...): a missing or non-numeric field is *unknown*, left out of
its sum and counted in ``missing``, never an error. Runs whose task has not ended are *in
flight*; their figures so far come from the last decision-log entry where the plugin loaded it
(it loads those of the most recent in-flight runs only, never a finished run's log).

A finished run's deadline outcome is one of ``met``; ``soft_miss`` (finished after the deadline
but by the hard deadline); ``hard_miss`` (after the hard deadline, or never); ``missed`` (after
the deadline, the hard deadline's outcome unknown: an old result).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import re
import threading
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from matplotlib import colormaps, dates
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from airflow_provider_spotsched.simulation.run_charts import ON_DEMAND_COLOUR, figure_svg

# a task instance in one of these states will not change its XComs again
ENDED_STATES = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})
OUTCOMES = ("met", "soft_miss", "hard_miss", "missed")
KEYS_ADDED_LATER = ("hard_deadline_met", "preemptions_by_pool", "budget")
RECENT_RUNS = 50  # rows of the page's table of the most recent runs
MAX_SELECTOR_CHARTS = 4  # kinds of job whose weights are drawn (the most recently learnt); all are tabled
MARKED_ROUNDS = 40  # up to this many rounds a weight chart marks every round's point
SVG_CACHE_SIZE = 32  # drawn charts kept, by what they draw: an unchanged fleet is not drawn again
PER_RUN_POINTS = 500  # up to this many finished runs the savings chart has a point per run
HOURLY_SPAN = timedelta(days=14)  # above PER_RUN_POINTS runs: hourly points over this span, else daily
# a pool named like a zone: GCP ``us-east4-a`` (region ``us-east4``), AWS ``us-east-1a`` (``us-east-1``)
_ZONE = re.compile(r"^(?P<region>.*\d)-?[a-z]$")
SAVED_COLOUR = "#2ca02c"
SPEND_COLOUR = "#1f77b4"


@dataclass(frozen=True)
class FleetRun:
    """One task instance of the fine-tuning operator, as the dashboard sees it.

    :param state: the task instance's state (``None``: not scheduled yet).
    :param run_after: the DAG run's date (Airflow's ``run_after``), the time filters' axis.
    :param result: the XCom ``return_value`` as stored (``None`` until the run finishes); anything
        that is not an object counts as unreadable.
    :param last_entry: the decision log's last entry, for an in-flight run (``None`` if not loaded).
    """

    dag_id: str
    run_id: str
    task_id: str
    map_index: int = -1
    state: str | None = None
    start_date: datetime | None = None
    end_date: datetime | None = None
    run_after: datetime | None = None
    result: Any = None
    last_entry: Mapping[str, Any] | None = None

    @property
    def in_flight(self) -> bool:
        """The task has not ended: its result may still come."""
        return self.state not in ENDED_STATES

    @property
    def status(self) -> str:
        """``in_flight``, ``finished`` (a result), ``no_result`` (ended without one) or ``unreadable``."""
        if self.in_flight:
            return "in_flight"
        if self.result is None:
            return "no_result"
        return "finished" if isinstance(self.result, Mapping) else "unreadable"

    @property
    def when(self) -> datetime | None:
        """When the run last moved: its end, else its start, else its date."""
        return self.end_date or self.start_date or self.run_after


def number(value: Any) -> float | None:
    """``value`` as a finite float, or ``None`` (unknown) for a bool, a string, NaN or nothing."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def outcome(result: Mapping[str, Any]) -> str | None:
    """The deadline outcome of a finished run's result (see the module doc); ``None``: unknown."""
    met = result.get("deadline_met")
    if not isinstance(met, bool):
        return None
    if met:
        return "met"
    hard = result.get("hard_deadline_met")
    if isinstance(hard, bool):
        return "soft_miss" if hard else "hard_miss"
    if "completion_hours" in result and result["completion_hours"] is None:
        return "hard_miss"  # never finished
    completion, hard_hours = number(result.get("completion_hours")), number(result.get("hard_deadline_hours"))
    if completion is not None and hard_hours is not None:
        return "soft_miss" if completion <= hard_hours + 1e-9 else "hard_miss"
    return "missed"


def whole(value: float) -> float | int:
    """A count summed as floats, as an int when it is whole (``3.0`` -> ``3``)."""
    return int(value) if float(value).is_integer() else value


def _whole_or_none(value: float | None) -> float | int | None:
    return None if value is None else whole(value)


def savings_of(result: Mapping[str, Any]) -> float | None:
    """The run's savings against N_max on-demand: its ``savings``, else on-demand cost - cost."""
    saved = number(result.get("savings"))
    if saved is not None:
        return saved
    cost, reference = number(result.get("cost")), number(result.get("on_demand_cost"))
    return None if cost is None or reference is None else reference - cost


def region_of(pool: str) -> str:
    """The region of a pool named like a zone (``us-east4-a`` -> ``us-east4``); else the pool itself."""
    found = _ZONE.match(pool)
    return found.group("region") if found else pool


@dataclass(slots=True)
class _Facts:
    """What the sums need of one run, read from its result once."""

    run: FleetRun
    status: str
    cost: float | None = None
    on_demand_cost: float | None = None
    savings: float | None = None
    preemptions: float | None = None
    budget: float | None = None
    outcome: str | None = None
    missing: tuple[str, ...] = ()


def _facts(run: FleetRun) -> _Facts:
    status = run.status
    if status != "finished":
        return _Facts(run, status)
    result: Mapping[str, Any] = run.result
    facts = _Facts(run, status, cost=number(result.get("cost")), on_demand_cost=number(result.get("on_demand_cost")),
                   savings=savings_of(result), preemptions=number(result.get("preemptions")),
                   budget=number(result.get("budget")), outcome=outcome(result))
    # an older operator's result lacks the newer keys: unknown, not zero
    missing = [key for key in ("cost", "on_demand_cost", "savings", "preemptions") if getattr(facts, key) is None]
    missing += [key for key in KEYS_ADDED_LATER if key not in result]
    if facts.outcome is None:
        missing.append("deadline_met")
    facts.missing = tuple(missing)
    return facts


class _Totals:
    """Running sums over runs: the fleet's and each DAG's."""

    def __init__(self) -> None:
        self.runs = self.finished = self.in_flight = self.no_result = self.unreadable = 0
        self.cost = self.on_demand_cost = self.savings = self.preemptions = 0.0
        self.savings_base = self.on_demand_base = 0.0  # over runs whose savings and on-demand cost are known
        self.outcomes: Counter[str] = Counter()
        self.missing: Counter[str] = Counter()

    def add(self, facts: _Facts) -> None:
        self.runs += 1
        if facts.status != "finished":
            setattr(self, facts.status, getattr(self, facts.status) + 1)
            return
        self.finished += 1
        self.cost += facts.cost or 0.0
        self.on_demand_cost += facts.on_demand_cost or 0.0
        self.preemptions += facts.preemptions or 0.0
        if facts.savings is not None:
            self.savings += facts.savings
            if facts.on_demand_cost is not None:
                self.savings_base += facts.savings
                self.on_demand_base += facts.on_demand_cost
        if facts.outcome is not None:
            self.outcomes[facts.outcome] += 1
        self.missing.update(facts.missing)

    def as_dict(self) -> dict[str, Any]:
        known = sum(self.outcomes.values())
        return {
            "runs": self.runs, "finished": self.finished, "in_flight": self.in_flight,
            "ended_without_result": self.no_result, "unreadable_results": self.unreadable,
            "cost": self.cost, "on_demand_cost": self.on_demand_cost, "savings": self.savings,
            "savings_fraction": self.savings_base / self.on_demand_base if self.on_demand_base else None,
            "deadline": {"known": known, **{kind: self.outcomes[kind] for kind in OUTCOMES},
                         "hit_rate": self.outcomes["met"] / known if known else None},
            "preemptions": whole(self.preemptions),
            "missing": dict(sorted(self.missing.items())),
        }


def summarise(runs: Iterable[FleetRun], *, recent: int = RECENT_RUNS) -> dict[str, Any]:
    """Everything the dashboard shows, JSON-ready (times as ISO-8601 UTC).

    ``totals`` and ``dags`` (one row per DAG) sum the finished runs' results; ``preemptions``
    splits their preemptions per pool (zone), rolls them up per region and counts those no pool
    was recorded for (old results); ``budget`` compares the spend of runs that had a budget with
    the sum of their budgets; ``savings_over_time`` accumulates cost, on-demand cost and savings by
    end date; ``in_flight`` sums what the loaded in-flight runs' last decisions say so far;
    ``recent_runs`` are the ``recent`` runs that moved last.
    """
    runs = list(runs)
    facts = [_facts(run) for run in runs]
    totals, per_dag = _Totals(), {}
    by_pool: defaultdict[str, float] = defaultdict(float)
    unattributed = 0.0
    for fact in facts:
        totals.add(fact)
        if fact.run.dag_id not in per_dag:
            per_dag[fact.run.dag_id] = _Totals()
        per_dag[fact.run.dag_id].add(fact)
        if fact.status == "finished":
            unattributed += _add_pools(fact, by_pool)
    by_region: defaultdict[str, float] = defaultdict(float)
    for pool, count in by_pool.items():
        by_region[region_of(pool)] += count
    newest = heapq.nlargest(max(recent, 0), runs, key=_recency)
    return {
        "totals": totals.as_dict(),
        "preemptions": {
            "total": whole(totals.preemptions),
            "by_pool": {pool: whole(n) for pool, n in sorted(by_pool.items(), key=lambda item: (-item[1], item[0]))},
            "by_region": {region: whole(n) for region, n in sorted(by_region.items(), key=lambda item: (-item[1], item[0]))},
            "unattributed": whole(unattributed),
        },
        "budget": _budget(facts),
        "savings_over_time": _savings_over_time(facts),
        "in_flight": _in_flight(runs),
        "dags": [{"dag_id": dag_id, **per_dag[dag_id].as_dict()} for dag_id in sorted(per_dag)],
        "recent_runs": [_row(run) for run in newest],
    }


def _add_pools(facts: _Facts, by_pool: defaultdict[str, float]) -> float:
    """Add the run's preemptions per pool; returns those its result attributes to no pool."""
    pools = facts.run.result.get("preemptions_by_pool")
    attributed = 0.0
    if isinstance(pools, Mapping):
        for pool, count in pools.items():
            value = number(count)
            if value:
                by_pool[str(pool)] += value
                attributed += value
    return max(facts.preemptions - attributed, 0.0) if facts.preemptions is not None else 0.0


def _budget(facts: Sequence[_Facts]) -> dict[str, Any]:
    spend = budget = 0.0
    counted = over = 0
    highest: dict[str, Any] | None = None
    for fact in facts:
        cap, cost = fact.budget, fact.cost
        if cap is None or cap <= 0 or cost is None:
            continue
        counted += 1
        spend, budget = spend + cost, budget + cap
        over += cost > cap + 1e-9
        if highest is None or cost / cap > highest["fraction"]:
            highest = {**_ids(fact.run), "cost": cost, "budget": cap, "fraction": cost / cap}
    return {"runs": counted, "spend": spend, "budget": budget, "fraction": spend / budget if budget else None,
            "over_budget": over, "highest": highest}


def _savings_over_time(facts: Sequence[_Facts]) -> dict[str, Any]:
    """Cumulative spend, on-demand cost and savings of finished runs by end date, per run/hour/day."""
    ended = sorted(((_utc(f.run.when), f) for f in facts if f.status == "finished" and f.run.when is not None
                    and f.cost is not None and f.on_demand_cost is not None), key=lambda item: item[0])
    if not ended:
        return {"bucket": None, "points": []}
    span = ended[-1][0] - ended[0][0]
    bucket = "run" if len(ended) <= PER_RUN_POINTS else "hour" if span <= HOURLY_SPAN else "day"
    points: list[dict[str, Any]] = []
    cumulative = {"cost": 0.0, "on_demand_cost": 0.0, "savings": 0.0}
    for when, fact in ended:
        key = _bucket_start(when, bucket)
        if not points or points[-1]["time"] != key:
            points.append({"time": key, "runs": 0, "cost": 0.0, "on_demand_cost": 0.0, "savings": 0.0})
        point = points[-1]
        point["runs"] += 1
        for name, value in (("cost", fact.cost), ("on_demand_cost", fact.on_demand_cost), ("savings", fact.savings)):
            value = value or 0.0  # known: savings follow from the two costs
            point[name] += value
            cumulative[name] += value
            point[f"cumulative_{name}"] = cumulative[name]
    for point in points:
        point["time"] = _iso(point["time"])
    return {"bucket": bucket, "points": points}


def _bucket_start(when: datetime, bucket: str) -> datetime:
    if bucket == "hour":
        return when.replace(minute=0, second=0, microsecond=0)
    if bucket == "day":
        return when.replace(hour=0, minute=0, second=0, microsecond=0)
    return when


def _in_flight(runs: Sequence[FleetRun]) -> dict[str, Any]:
    flying = [run for run in runs if run.in_flight]
    seen = [run.last_entry for run in flying if isinstance(run.last_entry, Mapping)]
    return {
        "runs": len(flying), "with_progress": len(seen),
        "cost_so_far": sum(number(entry.get("cost_so_far")) or 0.0 for entry in seen),
        "on_demand_cost_so_far": sum(number(entry.get("on_demand_cost_so_far")) or 0.0 for entry in seen),
        "preemptions_so_far": whole(sum(number(entry.get("preemptions")) or 0.0 for entry in seen)),
    }


def _recency(run: FleetRun) -> tuple[datetime, str, str, str, int]:
    floor = datetime.min.replace(tzinfo=timezone.utc)
    return (_utc(run.when) if run.when else floor, run.dag_id, run.run_id, run.task_id, run.map_index)


def _ids(run: FleetRun) -> dict[str, Any]:
    return {"dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id, "map_index": run.map_index}


def _row(run: FleetRun) -> dict[str, Any]:
    """One run of the recent-runs table."""
    row: dict[str, Any] = {**_ids(run), "state": run.state, "status": run.status,
                           "start_date": _iso(run.start_date), "end_date": _iso(run.end_date),
                           "run_after": _iso(run.run_after)}
    if run.status == "finished":
        result = run.result
        row.update({"cost": number(result.get("cost")), "on_demand_cost": number(result.get("on_demand_cost")),
                    "savings": savings_of(result), "outcome": outcome(result),
                    "preemptions": _whole_or_none(number(result.get("preemptions"))),
                    "budget": number(result.get("budget")),
                    "policy": None if result.get("policy") is None else str(result["policy"])})
    elif run.in_flight and isinstance(run.last_entry, Mapping):
        entry = run.last_entry
        done, total = number(entry.get("work_done")), number(entry.get("work_total"))
        row["progress"] = {"cost_so_far": number(entry.get("cost_so_far")),
                           "on_demand_cost_so_far": number(entry.get("on_demand_cost_so_far")),
                           "preemptions": _whole_or_none(number(entry.get("preemptions"))),
                           "work_fraction": done / total if done is not None and total else None,
                           "slot": entry.get("slot") if isinstance(entry.get("slot"), int) else None,
                           "last_decision": str(entry.get("time") or entry.get("market_time") or "") or None}
    return row


# -- the time range ------------------------------------------------------------------------


def parse_bound(text: str, *, upper: bool) -> datetime:
    """A filter bound: an ISO date or date-time (naive means UTC) as an aware UTC datetime.

    A date alone is its midnight as a lower bound (``since``) and the next midnight as an upper
    bound (``until``), so ``until=2025-10-07`` includes all of 7 October. Bounds are half-open:
    ``since <= run date < until``.

    :raises ValueError: not an ISO-8601 date or date-time.
    """
    text = text.strip()
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            start = datetime.combine(date.fromisoformat(text), time(0), tzinfo=timezone.utc)
            return start + timedelta(days=1) if upper else start
        return _utc(datetime.fromisoformat(text.replace("Z", "+00:00").replace(" ", "T", 1)))
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO-8601 date (2025-10-07) or date-time (2025-10-07T12:00Z)") from None


def _utc(value: datetime) -> datetime:
    if value.tzinfo is timezone.utc:
        return value
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else _utc(value).isoformat().replace("+00:00", "Z")


# -- the selector's weights ----------------------------------------------------------------


def selector_view(variable: str, text: str | None) -> dict[str, Any]:
    """The selector's member weights per kind of job over rounds, from its Variable's text.

    ``text`` is ``None`` when the Variable does not exist. Only the weights, kinds of job, rounds
    and played members are kept: the history's job ids name the DAGs they ran in, which the
    viewer may not be allowed to read. ``status`` says what was found (``ok``, ``missing``,
    ``not_json``, ``not_a_document``, ``no_history``) and ``message`` says it in words.
    """
    view: dict[str, Any] = {"variable": variable, "status": "ok", "message": "", "contexts": [], "skipped_entries": 0}
    if text is None:
        return {**view, "status": "missing",
                "message": f"The selector's Variable {variable!r} does not exist: no run has closed a selector round yet."}
    try:
        document = json.loads(text)
    except (TypeError, ValueError):
        return {**view, "status": "not_json",
                "message": f"The selector's Variable {variable!r} does not hold JSON; its weights cannot be shown."}
    if not isinstance(document, Mapping):
        return {**view, "status": "not_a_document",
                "message": f"The selector's Variable {variable!r} holds no selector document (a JSON object)."}
    history = document.get("history")
    if not isinstance(history, list) or not history:
        return {**view, "status": "no_history",
                "message": f"The selector's Variable {variable!r} has no per-round history yet: it is written when a "
                           "selector run closes its round (by this version of the provider or later)."}
    contexts: dict[str, dict[str, Any]] = {}
    skipped = 0
    for order, entry in enumerate(history):
        weights = entry.get("weights") if isinstance(entry, Mapping) else None
        if (not isinstance(weights, Mapping) or not isinstance(entry.get("context"), str)
                or number(entry.get("round")) is None):
            skipped += 1
            continue
        kind = contexts.setdefault(entry["context"], {"context": entry["context"], "entries": [], "last": order})
        kind["entries"].append(entry)
        kind["last"] = order
    shown = []
    for kind in sorted(contexts.values(), key=lambda k: -k["last"]):  # the kind learnt last first
        entries = sorted(kind["entries"], key=lambda e: number(e["round"]) or 0.0)
        members = list(dict.fromkeys(str(label) for e in entries for label in e["weights"]))
        shown.append({
            "context": kind["context"],
            "rounds": [int(number(e["round"]) or 0) for e in entries],
            "members": members,
            "weights": {m: [number(e["weights"].get(m)) for e in entries] for m in members},
            "played": [None if e.get("member") is None else str(e["member"]) for e in entries],
        })
    return {**view, "contexts": shown, "skipped_entries": skipped,
            "message": "" if shown else f"The selector's Variable {variable!r} holds no readable history entry."}


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
    left.barh(pools, [by_pool[p] for p in pools], color=[colour[region_of(p)] for p in pools])
    left.set_title("per pool (zone)", fontsize="medium")
    names = regions[::-1]
    right.barh(names, [by_region[r] for r in names], color=[colour[r] for r in names])
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
        ax.plot(rounds, values, marker="." if len(rounds) <= MARKED_ROUNDS else None, color=colours(i % 10), label=member)
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


def report_link(dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
    """The run report's URL relative to the fleet page (``runs/...`` beside ``fleet``), ids percent-encoded."""
    path = "/".join(quote(part, safe="") for part in (dag_id, run_id, task_id))
    return f"runs/{path}" + (f"?map_index={map_index}" if map_index >= 0 else "")


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
        + (f"; as of {escape(_utc(generated).strftime('%Y-%m-%d %H:%M'))}" if generated else "") + ".</p>",
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
        link = report_link(row["dag_id"], row["run_id"], row["task_id"], row["map_index"])
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
