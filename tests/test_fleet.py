"""The fleet dashboard's sums and page, from hand-built runs, without Airflow."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta, timezone
from urllib.parse import unquote, urljoin

import pytest

from airflow_provider_spotsched.market.slots import cloud_region
from airflow_provider_spotsched.simulation.fleet import (
    PER_RUN_POINTS,
    FleetRun,
    outcome,
    parse_bound,
    selector_view,
    summarise,
)
from airflow_provider_spotsched.simulation.fleet_page import (
    MAX_SELECTOR_CHARTS,
    FleetFilters,
    chart_svg,
    preemptions_chart,
    render_fleet_page,
    selector_chart,
)
from airflow_provider_spotsched.simulation.run_report import run_path
from tests.fleet_samples import CONTEXTS, MEMBERS, NEWER_KEYS, result_variant, selector_document
from tests.run_log_samples import sample_in_progress_log, sample_result

SVG = re.compile(r"<svg\b.*?</svg>", re.DOTALL)
T0 = datetime(2025, 10, 1, tzinfo=timezone.utc)


def finished(i: int, result: dict | None = None, dag_id: str = "dag_a", **fields) -> FleetRun:
    when = T0 + timedelta(hours=6 * i)
    dates = {"start_date": when, "end_date": when + timedelta(hours=5), "run_after": when, **fields}
    return FleetRun(dag_id=dag_id, run_id=f"manual__{when.isoformat()}", task_id="fine_tune", state="success",
                    result=result_variant(i) if result is None else result, **dates)


def in_flight(i: int, dag_id: str = "dag_a", with_log: bool = True) -> FleetRun:
    when = T0 + timedelta(hours=6 * i)
    return FleetRun(dag_id=dag_id, run_id=f"live_{i}", task_id="fine_tune", state="running", start_date=when,
                    run_after=when, last_entry=sample_in_progress_log(8)[-1] if with_log else None)


def test_the_totals_are_the_sums_of_the_finished_results():
    runs = [finished(i) for i in range(8)] + [in_flight(8), in_flight(9, with_log=False)]
    results = [run.result for run in runs[:8]]
    totals = summarise(runs)["totals"]
    assert (totals["runs"], totals["finished"], totals["in_flight"], totals["ended_without_result"]) == (10, 8, 2, 0)
    for key in ("cost", "on_demand_cost", "savings", "preemptions"):
        assert totals[key] == pytest.approx(sum(r[key] for r in results))
    assert totals["savings_fraction"] == pytest.approx(
        sum(r["savings"] for r in results) / sum(r["on_demand_cost"] for r in results))
    assert isinstance(totals["preemptions"], int)


def test_misses_are_classified_soft_and_hard():
    base = sample_result()
    cases = {
        "met": {},
        "soft_miss": {"deadline_met": False, "hard_deadline_met": True, "completion_hours": 26.0},
        "hard_miss": {"deadline_met": False, "hard_deadline_met": False, "completion_hours": 31.0},
    }
    for kind, change in cases.items():
        assert outcome({**base, **change}) == kind
    old = {k: v for k, v in base.items() if k not in NEWER_KEYS}
    assert outcome({**old, "deadline_met": False, "completion_hours": 26.0}) == "missed"  # no hard deadline known
    assert outcome({**old, "deadline_met": False, "completion_hours": None}) == "hard_miss"  # never finished
    assert outcome({**old, "deadline_met": False, "completion_hours": 26.0, "hard_deadline_hours": 30.0}) == "soft_miss"
    assert outcome({**old, "deadline_met": False, "completion_hours": 31.0, "hard_deadline_hours": 30.0}) == "hard_miss"
    assert outcome({"cost": 1.0}) is None and outcome({**base, "deadline_met": "yes"}) is None

    runs = [finished(i, {**base, **cases[kind]}) for i, kind in enumerate(["met", "met", "soft_miss", "hard_miss"])]
    deadline = summarise(runs)["totals"]["deadline"]
    assert deadline == {"known": 4, "met": 2, "soft_miss": 1, "hard_miss": 1, "missed": 0, "hit_rate": 0.5}


def test_preemptions_per_pool_and_per_region():
    results = [{**sample_result(), "preemptions": 3, "preemptions_by_pool": {"us-east4-a": 2, "us-east-1a": 1}},
               {**sample_result(), "preemptions": 4, "preemptions_by_pool": {"us-east4-b": 1, "europe-west1-c": 2}},
               {k: v for k, v in {**sample_result(), "preemptions": 5}.items() if k != "preemptions_by_pool"}]
    preemptions = summarise([finished(i, r) for i, r in enumerate(results)])["preemptions"]
    assert preemptions["by_pool"] == {"us-east4-a": 2, "europe-west1-c": 2, "us-east-1a": 1, "us-east4-b": 1}
    assert preemptions["by_region"] == {"us-east4": 3, "europe-west1": 2, "us-east-1": 1}
    # one preemption of the second run and all five of the old one name no pool
    assert preemptions["unattributed"] == 6 and preemptions["total"] == 12


@pytest.mark.parametrize("pool, region", [("us-east4-a", "us-east4"), ("europe-west1-c", "europe-west1"),
                                          ("us-east-1a", "us-east-1"), ("ap-southeast-2c", "ap-southeast-2"),
                                          ("local", "local"), ("pool-7", "pool-7")])
def test_regions_are_read_from_zone_names(pool, region):
    assert cloud_region(pool) == region


def test_spend_against_budget_counts_runs_that_had_one():
    base = sample_result()
    runs = [finished(0, {**base, "cost": 50.0, "budget": 100.0}), finished(1, {**base, "cost": 90.0, "budget": 100.0}),
            finished(2, {**base, "cost": 70.0, "budget": None}), finished(3, {**base, "cost": 130.0, "budget": 120.0})]
    budget = summarise(runs)["budget"]
    assert (budget["runs"], budget["spend"], budget["budget"]) == (3, 270.0, 320.0)
    assert budget["fraction"] == pytest.approx(270 / 320) and budget["over_budget"] == 1
    assert budget["highest"]["run_id"] == runs[3].run_id and budget["highest"]["fraction"] == pytest.approx(130 / 120)


def test_old_results_missing_keys_are_unknown_not_errors():
    base = sample_result()
    old = {k: v for k, v in base.items() if k not in NEWER_KEYS}
    broken = {"policy": "chc", "cost": "12 USD", "deadline_met": None, "preemptions_by_pool": ["us-east4-a"]}
    runs = [finished(0, base), finished(1, old), finished(2, broken), finished(3, ["not", "a", "result"]),
            FleetRun("dag_a", "failed", "fine_tune", state="failed", end_date=T0)]
    summary = summarise(runs)
    totals = summary["totals"]
    assert (totals["finished"], totals["unreadable_results"], totals["ended_without_result"]) == (3, 1, 1)
    assert totals["cost"] == pytest.approx(2 * base["cost"])
    assert totals["missing"] == {"budget": 2, "cost": 1, "deadline_met": 1, "hard_deadline_met": 2,
                                 "on_demand_cost": 1, "preemptions": 1, "preemptions_by_pool": 1, "savings": 1}
    assert summary["budget"]["runs"] == 0
    assert summary["preemptions"]["unattributed"] == base["preemptions"]  # the old result's
    rows = {row["run_id"]: row for row in summary["recent_runs"]}
    assert rows[runs[2].run_id]["cost"] is None and rows[runs[2].run_id]["outcome"] is None
    html = render_fleet_page(summary, selector_view("v", None), FleetFilters(["dag_a"]))
    assert "lack a field" in html and "unreadable result" in html and "ended, no result" in html


def test_an_integer_too_large_for_a_float_is_unknown():
    """JSON integers have no size limit: one past a float's range is unknown, like any non-number."""
    base = sample_result()
    totals = summarise([finished(0, base), finished(1, {**base, "cost": 10**400})])["totals"]
    assert totals["cost"] == pytest.approx(base["cost"]) and totals["missing"]["cost"] == 1
    view = selector_view("v", json.dumps({"history": [{"context": "k", "round": 10**400, "weights": {"a": 1.0}},
                                                      {"context": "k", "round": 2, "weights": {"a": 10**400}}]}))
    assert view["skipped_entries"] == 1 and view["contexts"][0]["weights"] == {"a": [None]}


def test_in_flight_runs_show_their_figures_so_far():
    runs = [finished(0), in_flight(1), in_flight(2, with_log=False)]
    summary = summarise(runs)
    last = sample_in_progress_log(8)[-1]
    assert summary["in_flight"] == {"runs": 2, "with_progress": 1, "cost_so_far": pytest.approx(last["cost_so_far"]),
                                    "on_demand_cost_so_far": pytest.approx(last["on_demand_cost_so_far"]),
                                    "preemptions_so_far": last["preemptions"]}
    rows = {row["run_id"]: row for row in summary["recent_runs"]}
    assert rows["live_1"]["progress"]["slot"] == last["slot"]
    assert rows["live_1"]["progress"]["work_fraction"] == pytest.approx(last["work_done"] / last["work_total"])
    assert "progress" not in rows["live_2"]
    assert summary["totals"]["cost"] == pytest.approx(runs[0].result["cost"])  # in-flight costs are not totals


def test_a_result_of_a_task_still_running_is_not_a_finished_run():
    run = FleetRun("dag_a", "r", "t", state="up_for_retry", result=sample_result())
    assert run.in_flight and summarise([run])["totals"]["finished"] == 0


def test_savings_over_time_accumulate_by_end_date():
    runs = [finished(i) for i in range(5)][::-1] + [finished(5, end_date=None, start_date=None)]
    series = summarise(runs)["savings_over_time"]
    assert series["bucket"] == "run" and len(series["points"]) == 6
    assert [p["time"] for p in series["points"]] == sorted(p["time"] for p in series["points"])
    assert series["points"][-1]["cumulative_savings"] == pytest.approx(sum(r.result["savings"] for r in runs))
    assert series["points"][0]["time"] == "2025-10-01T05:00:00Z"


def test_many_runs_are_summed_per_hour_or_day():
    base = sample_result()
    runs = [FleetRun("dag_a", f"r{i}", "t", state="success", end_date=T0 + timedelta(minutes=10 * i), result=base)
            for i in range(PER_RUN_POINTS + 1)]
    hourly = summarise(runs)["savings_over_time"]
    assert hourly["bucket"] == "hour" and len(hourly["points"]) == len({r.end_date.hour + 24 * r.end_date.day for r in runs})
    assert sum(p["runs"] for p in hourly["points"]) == len(runs)
    spread = [FleetRun("dag_a", f"r{i}", "t", state="success", end_date=T0 + timedelta(hours=i), result=base)
              for i in range(PER_RUN_POINTS + 1)]
    daily = summarise(spread)["savings_over_time"]
    assert daily["bucket"] == "day" and daily["points"][1]["time"] == "2025-10-02T00:00:00Z"
    assert daily["points"][-1]["cumulative_savings"] == pytest.approx(len(spread) * base["savings"])


def test_same_end_dates_do_not_break_the_ordering():
    when = T0 + timedelta(hours=1)
    runs = [FleetRun("dag_a", f"r{i}", "t", state="success", end_date=when, result=result_variant(i)) for i in range(3)]
    (point,) = summarise(runs)["savings_over_time"]["points"]  # one instant, one point (no comparison of results)
    assert point["runs"] == 3


def test_per_dag_rows_and_recent_runs():
    runs = [finished(i, dag_id="dag_a" if i % 3 else "dag_b") for i in range(70)]
    summary = summarise(runs, recent=50)
    assert [row["dag_id"] for row in summary["dags"]] == ["dag_a", "dag_b"]
    assert sum(row["runs"] for row in summary["dags"]) == 70
    assert sum(row["cost"] for row in summary["dags"]) == pytest.approx(summary["totals"]["cost"])
    recent = summary["recent_runs"]
    assert len(recent) == 50 and recent[0]["run_id"] == runs[-1].run_id
    assert [row["end_date"] for row in recent] == sorted((row["end_date"] for row in recent), reverse=True)


@pytest.mark.parametrize("text, upper, expected", [
    ("2025-10-07", False, datetime(2025, 10, 7, tzinfo=timezone.utc)),
    ("2025-10-07", True, datetime(2025, 10, 8, tzinfo=timezone.utc)),  # the whole day is included
    ("2025-10-07T12:30", True, datetime(2025, 10, 7, 12, 30, tzinfo=timezone.utc)),  # naive is UTC
    ("2025-10-07T12:30:00Z", False, datetime(2025, 10, 7, 12, 30, tzinfo=timezone.utc)),
    ("2025-10-07T14:30:00+02:00", False, datetime(2025, 10, 7, 12, 30, tzinfo=timezone.utc)),
    (" 2025-10-07 12:30 ", False, datetime(2025, 10, 7, 12, 30, tzinfo=timezone.utc)),
    # in UTC past datetime's last or first instant: the calendar's edge, which filters the same runs
    ("9999-12-31", True, datetime.max.replace(tzinfo=timezone.utc)),
    ("9999-12-31T23:59-05:00", False, datetime.max.replace(tzinfo=timezone.utc)),
    ("0001-01-01T00:00+01:00", False, datetime.min.replace(tzinfo=timezone.utc)),
    ("0001-01-01T00:00+01:00", True, datetime.min.replace(tzinfo=timezone.utc)),
])
def test_time_bounds(text, upper, expected):
    assert parse_bound(text, upper=upper) == expected


@pytest.mark.parametrize("text", ["yesterday", "2025-13-01", "2025-10-07T25:00", "10/07/2025", ""])
def test_bad_time_bounds_are_refused(text):
    with pytest.raises(ValueError, match="ISO-8601"):
        parse_bound(text, upper=False)


def test_the_selector_view_keeps_weights_but_no_job_ids():
    document = selector_document(["dag-b-secret-job-1", "dag-b-secret-job-2"], rounds=4)
    view = selector_view("spotsched_selector_state", json.dumps(document))
    assert view["status"] == "ok" and [k["context"] for k in view["contexts"]] == list(CONTEXTS[::-1])
    kind = next(k for k in view["contexts"] if k["context"] == CONTEXTS[0])
    assert kind["rounds"] == [1, 2, 3, 4] and kind["members"] == list(MEMBERS)
    for member in MEMBERS:
        assert kind["weights"][member] == pytest.approx(
            [e["weights"][member] for e in document["history"] if e["context"] == CONTEXTS[0]])
    assert "secret" not in json.dumps(view)


def test_charts_draw_a_dollar_in_a_member_or_pool_name_as_typed():
    """matplotlib reads $...$ as maths, and fails on what it cannot parse: names are drawn literally."""
    view = selector_view("spotsched_selector", json.dumps({"history": [
        {"context": "k", "round": 1, "weights": {"chc": 0.5, "price $\\x$": 0.5}, "member": "chc"}]}))
    assert "price $\\x$" in chart_svg(selector_chart, view["contexts"][0])
    pool = "zone-$\\q$"
    svg = chart_svg(preemptions_chart, {"by_pool": {pool: 2}, "by_region": {cloud_region(pool): 2}})
    assert pool in svg


@pytest.mark.parametrize("text, status, words", [
    (None, "missing", "does not exist"),
    ("{not json", "not_json", "does not hold JSON"),
    ("[1, 2]", "not_a_document", "holds no selector document"),
    (json.dumps({"selector": {}, "runs": []}), "no_history", "has no per-round history"),
    (json.dumps({"history": [{"context": 3}, "x", {"context": "c", "round": "one", "weights": {}}]}), "ok",
     "holds no readable history entry"),
])
def test_a_missing_or_damaged_selector_variable_is_said(text, status, words):
    view = selector_view("spotsched_selector_state", text)
    assert view["status"] == status and words in view["message"] and view["contexts"] == []
    html = render_fleet_page(summarise([]), view, FleetFilters([]))
    assert words in html.replace("&#x27;", "'")


def test_malformed_history_entries_are_skipped():
    document = selector_document(["j"], rounds=3)
    document["history"] += [None, {"context": CONTEXTS[0], "round": 9, "weights": "uniform"}]
    view = selector_view("v", json.dumps(document))
    assert view["skipped_entries"] == 2 and sum(len(k["rounds"]) for k in view["contexts"]) == 6


@pytest.fixture(scope="module")
def page() -> tuple[str, dict]:
    evil_dag, evil_pool = 'dag<script>alert("x")</script>&', '<img src=x onerror=alert(1)>-a'
    results = [{**sample_result(), "preemptions": 2, "preemptions_by_pool": {evil_pool: 1, "us-east4-a": 1}},
               result_variant(1), result_variant(2)]
    runs = [finished(i, r, dag_id=evil_dag if i == 0 else "dag_a") for i, r in enumerate(results)]
    runs.append(FleetRun("dag_a", "manual__2025-10-05T00:00:00+00:00", "sweep", map_index=3, state="running",
                         run_after=T0, last_entry=sample_in_progress_log(5)[-1]))
    summary = summarise(runs)
    selector = selector_view("spotsched_selector_state", json.dumps(selector_document(["j"])))
    filters = FleetFilters(readable_dags=["dag_a", evil_dag], dag_ids=[], since="2025-10-01", until=None)
    html = render_fleet_page(summary, selector, filters, data_url="fleet/data.json?since=2025-10-01",
                             generated=datetime(2025, 10, 9, 8, 0, tzinfo=timezone.utc))
    return html, summary


def test_the_page_escapes_dag_ids_and_pool_names(page):
    html, _ = page
    assert "<script" not in html and "<img" not in html and "onerror=alert(1)>" not in html
    assert "dag&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html  # in the region table (its region is its own name)


def test_the_page_draws_well_formed_svg_charts(page):
    html, summary = page
    svgs = SVG.findall(html)
    # savings over time, preemptions per pool and region, the selector's two kinds of job
    assert len(svgs) == 2 + len(CONTEXTS)
    for svg in svgs:
        ET.fromstring(svg)
    assert "saved:" in svgs[0] and "N_max on-demand" in svgs[0]
    assert "per pool (zone)" in svgs[1] and "rolled up per region" in svgs[1] and "us-east4-a" in svgs[1]
    assert all(member in svgs[2] for member in MEMBERS) and "member played that round" in svgs[2]


def test_the_page_links_each_run_to_its_report(page):
    html, summary = page
    links = re.findall(r'<a href="(runs/[^"]+)">', html)
    assert len(links) == len(summary["recent_runs"]) == 4
    mapped = "runs/dag_a/manual__2025-10-05T00%3A00%3A00%2B00%3A00/sweep?map_index=3"
    assert mapped in links
    evil = next(link for link in links if "script" in link)
    target = urljoin("https://airflow.example.com/team/spotsched/fleet", evil.replace("&amp;", "&"))
    assert target.startswith("https://airflow.example.com/team/spotsched/runs/")
    assert unquote(target.split("/runs/")[1].split("/")[0]) == 'dag<script>alert("x")</script>&'
    assert run_path("a/b", "r 1", "t") == "runs/a%2Fb/r%201/t"


def test_the_filter_form(page):
    html, _ = page
    assert '<form class="filters" method="get" action="fleet">' in html
    assert '<option value="">all DAGs you may read</option>' in html
    assert '<input type="date" name="since" value="2025-10-01">' in html
    assert '<input type="date" name="until" value="">' in html
    assert 'href="fleet/data.json?since=2025-10-01"' in html
    assert 'href="fleet?dag_id=dag_a&amp;since=2025-10-01"' in html  # a DAG's row filters on it, keeping the dates
    chosen = render_fleet_page(summarise([]), selector_view("v", None),
                               FleetFilters(["a", "b", "c"], dag_ids=["a", "c"], until="2025-10-07T12:30"))
    assert '<select name="dag_id" multiple>' in chosen and '<option value="c" selected>' in chosen
    assert '<input type="datetime-local" name="until" value="2025-10-07T12:30">' in chosen


def test_the_page_is_self_contained(page):
    html, _ = page
    assert "<script" not in html and not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "<?xml" not in html


def test_an_empty_fleet_says_so():
    html = render_fleet_page(summarise([]), selector_view("v", None), FleetFilters([]))
    assert "No finished run with a cost to draw yet" in html and "No spot run matches these filters" in html
    assert "<svg" not in html


def test_more_kinds_of_job_than_charts_are_listed():
    document = {"history": [{"context": f"kind-{k}", "round": 1, "member": "m", "weights": {"m": 1.0}}
                            for k in range(MAX_SELECTOR_CHARTS + 3)]}
    html = render_fleet_page(summarise([]), selector_view("v", json.dumps(document)), FleetFilters([]))
    assert len(SVG.findall(html)) == MAX_SELECTOR_CHARTS and "3 more kind(s) of job" in html


def test_every_kind_of_job_is_tabled_with_its_leading_member():
    document = selector_document(["j"], rounds=3)
    view = selector_view("v", json.dumps(document))
    html = render_fleet_page(summarise([]), view, FleetFilters(["a"]))
    for kind in view["contexts"]:
        last = {m: w[-1] for m, w in kind["weights"].items()}
        leader = max(last, key=last.get)
        assert (f'<tr><td class="text">{kind["context"]}</td><td>3</td><td class="text">{leader}</td>'
                f"<td>{last[leader]:.2f}</td></tr>") in html


def test_drawn_charts_are_reused_while_their_data_is_unchanged(monkeypatch):
    from airflow_provider_spotsched.simulation import fleet_page as fleet

    drawn = []
    original = fleet.figure_svg

    def counting(figure):
        drawn.append(figure)
        return original(figure)

    monkeypatch.setattr(fleet, "figure_svg", counting)
    fleet.clear_chart_cache()
    runs = [finished(i) for i in range(3)]
    selector = selector_view("v", json.dumps(selector_document(["j"])))
    first = render_fleet_page(summarise(runs), selector, FleetFilters(["dag_a"]))
    assert len(drawn) == 2 + len(CONTEXTS)
    assert render_fleet_page(summarise(runs), selector, FleetFilters(["dag_a"])) == first
    assert len(drawn) == 2 + len(CONTEXTS)  # nothing drawn again
    render_fleet_page(summarise(runs + [finished(3)]), selector, FleetFilters(["dag_a"]))
    assert len(drawn) == 2 + len(CONTEXTS) + 2  # the savings and preemption charts changed, the selector's did not
    fleet.clear_chart_cache()
    assert render_fleet_page(summarise(runs), selector, FleetFilters(["dag_a"])) == first  # drawn alike afresh
