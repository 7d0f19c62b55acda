"""The per-run report page, rendered from the two XCom values without Airflow."""

from __future__ import annotations

import copy
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from airflow_provider_spotsched.simulation.run_charts import RunSeries
from airflow_provider_spotsched.simulation.run_report import LiveView, render_run_body, render_run_report, report_version
from tests.run_log_samples import CHARTS, POOLS, PREEMPTED_SLOT, sample_decision_log, sample_in_progress_log, sample_result

SVG = re.compile(r"<svg\b.*?</svg>", re.DOTALL)
CHART_CAPTIONS = (
    "Progress against the deadline",
    "Plan versus actual: instances per slot",
    "Spot and on-demand instances over time",
    "Cost accumulated against the on-demand line",
    "Training: loss and measured throughput",
)


@pytest.fixture(scope="module")
def finished_html() -> str:
    log = sample_decision_log()
    return render_run_report(log, sample_result(log), "spot_demo / run 1 / finetune", data_url="finetune/data.json")


def _svgs(html: str) -> list[str]:
    return SVG.findall(html)


def _renamed(log: list[dict], old: str, new: str) -> list[dict]:
    """The log with pool ``old`` called ``new`` wherever a pool name appears."""
    log = copy.deepcopy(log)
    for entry in log:
        for mapping in (entry["market"], entry["forecast"] or {}, entry["allocation"]["spot"],
                        *(step["spot"] for step in entry["plan"] or []), (entry["applied"] or {}).get("spot", {})):
            if old in mapping:
                mapping[new] = mapping.pop(old)
    return log


def test_a_finished_run_shows_its_summary_and_every_chart(finished_html):
    result = sample_result()
    html = finished_html
    assert "finished, deadline met" in html
    for figure in (f"{result['cost']:,.2f} USD", f"{result['on_demand_cost']:,.2f} USD",
                   f"{result['savings']:,.2f} USD ({100 * result['savings_fraction']:.1f} %)",
                   "23.50 h (deadline 24.00 h)", "<th>Preemptions</th><td>1</td>", "<td>chc</td>", "spot-demo-0001"):
        assert figure in html
    for caption in CHART_CAPTIONS:
        assert f"<figcaption>{caption}</figcaption>" in html
    # five charts, then one forecast chart per pool, each a well-formed inline SVG
    svgs = _svgs(html)
    assert len(svgs) == CHARTS + len(POOLS)
    for svg in svgs:
        ET.fromstring(svg)
    for pool in POOLS:
        assert f"<figcaption>Pool {pool}</figcaption>" in html
    assert 'href="finetune/data.json"' in html


def test_the_page_is_self_contained(finished_html):
    html = finished_html
    assert "<script" not in html, "a page that is not live polls nothing"
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
    assert "<?xml" not in html and "<!DOCTYPE svg" not in html  # the SVG prologs are stripped for inlining


def test_charts_mark_the_preemption_and_the_plan(finished_html):
    progress, plan, instances, cost, training = _svgs(finished_html)[:CHARTS]
    for legend in ("required pace", "deadline", "hard deadline", "work done (checkpointed)", "preemption"):
        assert legend in progress
    assert "training loss" in training and "samples per second (measured)" in training
    for legend in ("first plan (slot 0)", "planned one slot ahead", "decided", "applied (ran)", "preemption"):
        assert legend in plan
    assert "on-demand" in instances and all(pool in instances for pool in POOLS)
    assert "N_max on-demand" in cost and "deadline" in cost and "preemption" in cost


def test_series_align_each_forecast_with_the_slot_it_predicts():
    log = sample_decision_log()
    series = RunSeries(log)
    np.testing.assert_array_equal(series.hours, np.arange(len(log)))
    assert series.slot_hours == 1.0 and series.pools == list(POOLS)
    np.testing.assert_array_equal(series.preemption_hours(), [float(PREEMPTED_SLOT)])
    assert series.totals("allocation")[PREEMPTED_SLOT] - series.totals("applied")[PREEMPTED_SLOT] == 1
    ahead = series.one_slot_ahead(POOLS[0], "spot_price")
    assert np.isnan(ahead[0])
    assert ahead[5] == log[4]["forecast"][POOLS[0]]["spot_price"][0]


def test_pool_names_and_the_title_are_escaped():
    log = _renamed(sample_decision_log(), POOLS[1], "<b>zone</b>")
    html = render_run_report(log, sample_result(), "<script>alert(1)</script>")
    assert "<b>zone" not in html and "<script>" not in html
    assert "<summary>&lt;b&gt;zone&lt;/b&gt;</summary>" in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    svgs = _svgs(html)
    assert any("&lt;b&gt;zone&lt;/b&gt;" in svg for svg in svgs)
    for svg in svgs:
        ET.fromstring(svg)


def test_a_run_in_progress_shows_what_exists_so_far():
    log = sample_in_progress_log(10)
    html = render_run_report(log, None, "run")
    assert 'class="status running">in progress' in html
    assert 'class="status finished"' not in html and "Deadline met" not in html
    assert f"<th>Cost so far</th><td>{log[-1]['cost_so_far']:,.2f} USD</td>" in html
    assert "<th>Slots decided</th><td>10</td>" in html
    assert f"{log[-1]['work_done']:.4g} of {log[-1]['work_total']:.4g}" in html
    svgs = _svgs(html)
    assert len(svgs) == CHARTS + len(POOLS)
    assert "decided, not yet applied" in svgs[2]
    assert "hard deadline" in svgs[0], "a live run draws its deadlines from the log"
    assert "deadline" in svgs[3], "on the cost chart too"
    last = log[-1]
    assert f"<th>Next decision</th><td>{last['next_decision']}</td>" in html
    assert f"<th>Training loss</th><td>{last['training']['loss']:.4g}</td>" in html
    assert "(decided, being applied)" in html
    assert "Planning on" not in html, "a log from before the throughput estimate shows none"


def test_a_live_run_shows_the_throughput_it_plans_on():
    log = sample_in_progress_log(10)
    log[-1]["throughput"] = {"alpha": 0.7692, "beta": 0.0}
    html = render_run_report(log, None, "run")
    assert "<th>Planning on</th><td>H(n) = 0.7692 n + 0 work units/h (measured so far)</td>" in html


def test_the_slot_table_has_a_row_per_slot_and_marks_the_preemption(finished_html):
    table = finished_html[finished_html.index('<table class="slots">'):]
    rows = re.findall(r"<tr( class=\"preempted\")?><td>(\d+)</td>", table)
    assert [int(slot) for _, slot in rows] == list(range(len(sample_decision_log())))
    assert [int(slot) for marked, slot in rows if marked] == [PREEMPTED_SLOT]


def test_a_live_page_polls_its_view_and_a_finished_one_does_not():
    log = sample_in_progress_log(10)
    live = render_run_report(log, None, "run", live=LiveView("finetune/live.json", 2))
    assert 'data-live="finetune/live.json" data-poll-seconds="2"' in live and "<script>" in live
    assert f'data-version="{report_version(log, None)}"' in live
    assert report_version(log, None) != report_version(sample_in_progress_log(11), None)
    assert render_run_body(log, None, "run") in live, "the live view swaps in the same body the page was served with"


@pytest.mark.parametrize("log", [[], None])
def test_an_empty_log_says_so_instead_of_drawing(log):
    html = render_run_report(log, None, "run")
    assert "No decision has been recorded for this run yet" in html
    assert "<svg" not in html and "in progress" in html


def test_a_finished_run_without_a_log_still_shows_its_result():
    html = render_run_report([], sample_result(), "run")
    assert "No decision has been recorded" in html and "finished, deadline met" in html


def test_a_missed_deadline_is_shown_as_missed():
    result = dict(sample_result(), deadline_met=False, completion_hours=30.0)
    html = render_run_report(sample_decision_log(), result, "run")
    assert "finished, deadline missed" in html and "<th>Deadline met</th><td>no</td>" in html


def test_malformed_input_is_refused_naming_the_field():
    log = sample_decision_log()
    broken = copy.deepcopy(log)
    del broken[3]["cost_so_far"]
    with pytest.raises(ValueError, match=r"decision_log\[3\] lacks cost_so_far"):
        render_run_report(broken, None, "run")
    broken = copy.deepcopy(log)
    broken[2]["market_time"] = "yesterday"
    with pytest.raises(ValueError, match=r"decision_log\[2\]\.market_time must be a UTC ISO-8601"):
        render_run_report(broken, None, "run")
    broken = copy.deepcopy(log)
    broken[1]["applied"] = {"on_demand": 1}
    with pytest.raises(ValueError, match=r"decision_log\[1\]\.applied must be"):
        render_run_report(broken, None, "run")
    with pytest.raises(ValueError, match="decision_log must be a list"):
        render_run_report({"slot": 0}, None, "run")
    with pytest.raises(ValueError, match="result lacks cost"):
        render_run_report(log, {k: v for k, v in sample_result(log).items() if k != "cost"}, "run")


def _damaged_log(damage) -> list[dict]:
    log = sample_decision_log()
    damage(log)
    return log


POOL = POOLS[0]


@pytest.mark.parametrize("log, result, message", [
    (None, dict(sample_result(), savings_fraction=None), r"result\.savings_fraction must be a number, got None"),
    (None, dict(sample_result(), preemptions=None), r"result\.preemptions must be a number, got None"),
    (None, dict(sample_result(), cost="abc"), r"result\.cost must be a number, got 'abc'"),
    (None, dict(sample_result(), completion_hours="23.5"), r"result\.completion_hours must be a number or null"),
    (None, dict(sample_result(), slots=[24]), r"result\.slots must be a number or null"),
    (None, dict(sample_result(), deadline_met="no"), r"result\.deadline_met must be true or false, got 'no'"),
    (_damaged_log(lambda log: log[3]["market"].__setitem__(POOL, {})), None,
     rf"decision_log\[3\]\.market\['{POOL}'\]\.spot_price must be a number, got None"),
    (_damaged_log(lambda log: log[3].__setitem__("market", [])), None, r"decision_log\[3\]\.market must be an object"),
    (_damaged_log(lambda log: log[2].__setitem__("slot", None)), None, r"decision_log\[2\]\.slot must be a number"),
    (_damaged_log(lambda log: log[0]["forecast"][POOL].pop("available")), None,
     rf"decision_log\[0\]\.forecast\['{POOL}'\]\.available must be a list of numbers, got None"),
    (_damaged_log(lambda log: log[1].__setitem__("training", "x")), None,
     r"decision_log\[1\]\.training must be an object, got 'x'"),
    (_damaged_log(lambda log: log[1]["training"].__setitem__("loss", "low")), None,
     r"decision_log\[1\]\.training\.loss must be a number or null, got 'low'"),
    (_damaged_log(lambda log: log[1]["allocation"].__setitem__("spot", {POOL: "2"})), None,
     r"decision_log\[1\]\.allocation must be \{\"spot\""),
    (_damaged_log(lambda log: log[1]["plan"].append(None)), None, r"decision_log\[1\]\.plan must be a list of"),
    (_damaged_log(lambda log: log[1].__setitem__("throughput", {"beta": 0.0})), None,
     r"decision_log\[1\]\.throughput\.alpha must be a number, got None"),
    (_damaged_log(lambda log: log[4].__setitem__("deadline_hours", "24")), None,
     r"decision_log\[4\]\.deadline_hours must be a number or null, got '24'"),
])
def test_a_field_of_a_wrong_type_is_refused_naming_it(log, result, message):
    """Each damage used to fail inside the drawing (TypeError, KeyError...) with no field named."""
    log = sample_decision_log() if log is None else log
    with pytest.raises(ValueError, match=message):
        render_run_report(log, result, "run")

