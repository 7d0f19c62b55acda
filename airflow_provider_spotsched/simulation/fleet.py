"""The fleet dashboard: every spot run a user may read, summed up, and the selector's learning.

Airflow-free, like :mod:`.run_report`: the plugin (:mod:`airflow_provider_spotsched.plugins.fleet_pages`)
reads the runs from the metadata database as :class:`FleetRun` records (one per task instance of
the fine-tuning operator, with its result, the operator's XCom ``return_value``) and the
selector's Variable as text; this module sums them up (:func:`summarise`, JSON-ready) and
:mod:`.fleet_page` draws the page (one self-contained HTML document, charts as inline SVG).

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

import heapq
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from typing import Any

from airflow_provider_spotsched.market.slots import cloud_region

# a task instance in one of these states will not change its XComs again
ENDED_STATES = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})
OUTCOMES = ("met", "soft_miss", "hard_miss", "missed")
KEYS_ADDED_LATER = ("hard_deadline_met", "preemptions_by_pool", "budget")
RECENT_RUNS = 50  # rows of the page's table of the most recent runs
PER_RUN_POINTS = 500  # up to this many finished runs the savings chart has a point per run
HOURLY_SPAN = timedelta(days=14)  # above PER_RUN_POINTS runs: hourly points over this span, else daily


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
    """``value`` as a finite float, or ``None`` (unknown) for a bool, a string, NaN, infinity, an
    integer too large for a float (JSON allows one) or nothing."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


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
        by_region[cloud_region(pool)] += count
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
    ended = sorted(((utc(f.run.when), f) for f in facts if f.status == "finished" and f.run.when is not None
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
    return (utc(run.when) if run.when else floor, run.dag_id, run.run_id, run.task_id, run.map_index)


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
    ``since <= run date < until``. A bound that UTC puts outside datetime's years 1..9999
    (``until=9999-12-31``, an offset on the first or last day) is the calendar's first or last
    instant, which filters the same runs.

    :raises ValueError: not an ISO-8601 date or date-time.
    """
    text = text.strip()
    after = timedelta(0)
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
            moment = datetime.combine(date.fromisoformat(text), time(0), tzinfo=timezone.utc)
            after = timedelta(days=1) if upper else after
        else:
            moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace(" ", "T", 1))
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO-8601 date (2025-10-07) or date-time (2025-10-07T12:00Z)") from None
    try:
        return utc(moment) + after
    except OverflowError:
        return (datetime.min if moment.year == 1 else datetime.max).replace(tzinfo=timezone.utc)


def utc(value: datetime) -> datetime:
    if value.tzinfo is timezone.utc:
        return value
    return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def _iso(value: datetime | None) -> str | None:
    return None if value is None else utc(value).isoformat().replace("+00:00", "Z")


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
