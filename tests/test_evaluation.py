"""The evaluation grid: scenario layout, job sizing, relatives, the selector's feedback order, the files."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from airflow_provider_spotsched.cli import main
from airflow_provider_spotsched.market.trace import load_trace
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.replay import simulate
from airflow_provider_spotsched.scheduling.selector import SelectorPolicy
from airflow_provider_spotsched.simulation import evaluation as ev
from airflow_provider_spotsched.simulation.evaluation import (
    COLUMNS,
    EvaluationError,
    GridConfig,
    Row,
    merge_selector_parts,
    plan_scenarios,
    run_scenario,
    run_selector,
    scenario_job,
    selector_tasks,
    template_job,
    with_relatives,
)
from tests.test_cli import write_slice

TINY = dict(n_max=(2,), slack=(1.5,), overhead=(0.1,), base_hours=4.0)


@pytest.fixture(scope="module")
def slice_path(tmp_path_factory, gcp_trace) -> Path:
    return write_slice(gcp_trace, tmp_path_factory.mktemp("trace") / "gcp_4d.csv.gz", days=4)


@pytest.fixture(scope="module")
def slice_trace(slice_path):
    return load_trace(slice_path)


def test_scenarios_leave_history_before_and_the_horizon_after(slice_trace, slice_path):
    config = GridConfig(traces=(str(slice_path),), scenarios=3, n_max=(1, 4), slack=(1.25, 2.0), base_hours=4.0)
    plan = plan_scenarios(config, slice_trace)
    assert len(plan) == 3 * 2 * 2 * 2
    assert [s.index for s in plan] == list(range(len(plan)))
    assert [s.start for s in plan] == sorted(s.start for s in plan)
    assert len({s.start for s in plan}) == 3
    for scenario in plan:
        assert config.min_lookback_hours <= scenario.lookback_hours <= config.lookback_hours
        job, market = scenario_job(config, slice_trace, scenario)
        assert market.offset * job.slot_hours == scenario.lookback_hours
        assert market.market.num_slots == market.offset + job.horizon_slots


def test_a_trace_too_short_for_the_grid_is_refused(slice_trace, slice_path):
    with pytest.raises(EvaluationError, match="history"):
        plan_scenarios(GridConfig(traces=(str(slice_path),), base_hours=40.0), slice_trace)


def test_the_job_is_sized_so_that_on_demand_is_feasible_and_earns(slice_trace, slice_path):
    config = GridConfig(traces=(str(slice_path),), scenarios=1, n_max=(4,), slack=(1.25,), overhead=(0.25,))
    (scenario,) = plan_scenarios(config, slice_trace)
    job, market = scenario_job(config, slice_trace, scenario)
    assert job.work == 4 * 12.0 and job.deadline_hours == pytest.approx(1.25 * 12.25)
    assert (job.hard_deadline_factor, job.min_instances, job.start) == (1.5, 1, scenario.start)
    on_demand = simulate(make_policy("on-demand"), job, market).outcome
    assert on_demand.completion_hours == pytest.approx(12.25)
    assert job.value == pytest.approx(1.3 * on_demand.cost)
    assert not on_demand.soft_miss


def row(policy: str, cost: float, utility: float, start: str = "s") -> Row:
    return Row("t", start, 1, 1.5, 0.1, policy, "{}", cost, 10.0, utility, 1.0, False, False, 0.1, 0.1)


def test_relatives_compare_with_the_same_scenarios_references():
    rows = with_relatives([row("optimal", 2.0, 8.0), row("on-demand", 8.0, 2.0), row("greedy", 3.0, 6.0),
                           row("greedy", 1.0, 1.0, start="other")])
    greedy = rows[2]
    assert greedy.excess_cost == pytest.approx(0.5)
    assert greedy.utility_vs_optimal == pytest.approx(0.75)
    assert greedy.cost_vs_on_demand == pytest.approx(0.375)
    assert rows[3].excess_cost is rows[3].utility_vs_optimal is rows[3].cost_vs_on_demand is None


def test_every_chc_of_the_grid_plans_with_the_same_commitment():
    """The forecasters and the oracle's errors are compared on one planner (docs/evaluation.md)."""
    commits = {key: dict(spec.params)["commit"] for key, spec in ev.POLICY_SPECS.items() if spec.name == "chc"}
    assert set(commits) >= {"chc-auto", "chc-auto-unguarded", "chc-persistence", "chc-oracle-0"}
    assert set(commits.values()) == {ev.CHC_COMMIT}
    assert ev.plain_chc_forecaster("chc-persistence") == "persistence"
    assert ev.plain_chc_forecaster("chc-auto-unguarded") == "auto"
    assert ev.plain_chc_forecaster("chc-auto") is None  # guarded: not plain CHC


def test_unknown_policy_in_the_grid_is_refused():
    with pytest.raises(EvaluationError, match="magic"):
        GridConfig(policies=("greedy", "magic"))


def test_selector_learns_a_round_only_after_its_horizon(monkeypatch, slice_trace, slice_path):
    pool = [{"policy": "greedy"}, {"policy": "prediction-free", "params": {"price_threshold": 0.5}}]
    monkeypatch.setitem(ev.POLICY_SPECS, "selector", ev.PolicySpec("selector", "selector", (("pool", pool),)))
    config = GridConfig(traces=(str(slice_path),), policies=("greedy", "selector"), **TINY)
    (first,) = plan_scenarios(replace(config, scenarios=1), slice_trace)
    horizon = template_job(config, 2, 1.5, 0.1).horizon_slots
    offsets = (0, 2, horizon + 1)
    plan = [replace(first, start=first.start + timedelta(hours=h), index=i) for i, h in enumerate(offsets)]
    runs = [run_scenario(config, scenario, [], selector=True) for scenario in plan]
    rows, learning = run_selector(config, runs)
    assert [r.policy for r in rows] == ["selector"] * 3
    rounds, (context,) = learning["rounds"], learning["warm_up_rounds"]  # one kind of job, warmed up once
    assert learning["warm_up_rounds"][context] > 0
    assert [r["learnt_before"] for r in rounds] == [plan[2].start_text, None, None]
    learnt = learning["final_state"]["contexts"][context]["rounds"]
    assert learnt == learning["warm_up_rounds"][context] + 3
    plays = learning["plays"]
    assert [p["start"] for p in plays] == [s.start_text for s in plan]
    assert all(set(p["probabilities"]) == set(learning["members"]) for p in plays)
    assert all(sum(p["probabilities"].values()) == pytest.approx(1.0) for p in plays)


def test_a_member_that_is_an_evaluated_policy_takes_that_runs_utility_instead_of_a_replay(
    monkeypatch, slice_trace, slice_path
):
    # the default grid evaluates chc-blend and uniform-progress, both selector members: replaying
    # them for the selector's feedback would run the same deterministic job twice
    pool = [{"policy": "greedy"}, {"policy": "prediction-free", "params": {"price_threshold": 0.5}}]
    monkeypatch.setitem(ev.POLICY_SPECS, "selector", ev.PolicySpec("selector", "selector", (("pool", pool),)))
    config = GridConfig(traces=(str(slice_path),), policies=("greedy", "selector"), **TINY)
    (scenario,) = plan_scenarios(replace(config, scenarios=1), slice_trace)
    replayed: list[str] = []
    replay = SelectorPolicy._replay
    monkeypatch.setattr(
        SelectorPolicy, "_replay", lambda self, i, *args: replayed.append(self.labels[i]) or replay(self, i, *args)
    )
    run = run_scenario(config, scenario, ["greedy"], selector=True)
    (greedy,) = run.rows
    assert replayed == ["prediction-free(price_threshold=0.5,safety_slots=1.0)"]
    assert run.member_utilities is not None and run.member_utilities["greedy"] == greedy.utility
    job, market = scenario_job(config, slice_trace, scenario)
    assert ev._build_selector(config.seed).counterfactual_utilities(job, market) == run.member_utilities  # a replay agrees


def test_a_trace_split_by_kind_of_job_learns_as_one_sequence(monkeypatch, slice_trace, slice_path):
    pool = [{"policy": "greedy"}, {"policy": "prediction-free", "params": {"price_threshold": 0.5}}]
    monkeypatch.setitem(ev.POLICY_SPECS, "selector", ev.PolicySpec("selector", "selector", (("pool", pool),)))
    config = GridConfig(traces=(str(slice_path),), policies=("selector",), scenarios=2, **{**TINY, "n_max": (1, 2)})
    runs = [run_scenario(config, scenario, [], selector=True) for scenario in plan_scenarios(config, slice_trace)]
    whole_rows, whole = run_selector(config, runs)
    tasks = selector_tasks(config, runs)
    assert len(tasks) == 2  # one per N_max
    rows, merged = merge_selector_parts([run_selector(config, part, draws) for part, draws in tasks])
    untimed = lambda rows: sorted((replace(r, decision_ms_mean=0, decision_ms_p50=0) for r in rows), key=str)  # noqa: E731
    assert untimed(rows) == untimed(whole_rows)
    assert merged["plays"] == whole["plays"] and merged["rounds"] == whole["rounds"]
    assert merged["final_state"]["contexts"] == whole["final_state"]["contexts"]
    assert merged["final_state"]["draws"] == whole["final_state"]["draws"] == len(runs)
    assert merged["warm_up_rounds"] == whole["warm_up_rounds"]


def test_the_pool_runs_each_kinds_selector_part_as_one_sequence_would(monkeypatch, slice_trace, slice_path):
    # evaluate() runs the selector one task per kind in its process pool, beside other scenarios:
    # the selector's rows and learning are still those of one sequential run
    pool = [{"policy": "greedy"}, {"policy": "prediction-free", "params": {"price_threshold": 0.5}}]
    monkeypatch.setitem(ev.POLICY_SPECS, "selector", ev.PolicySpec("selector", "selector", (("pool", pool),)))
    config = GridConfig(traces=(str(slice_path),), policies=("greedy", "selector"), scenarios=2, **{**TINY, "n_max": (1, 2)})
    evaluation = ev.evaluate(config, workers=2)
    runs = [run_scenario(config, scenario, [], selector=True) for scenario in plan_scenarios(config, slice_trace)]
    whole_rows, whole = run_selector(config, runs)
    outcome = lambda rows: sorted((r.start, r.n_max, r.cost, r.utility) for r in rows if r.policy == "selector")  # noqa: E731
    assert outcome(evaluation.rows) == outcome(whole_rows) and len(outcome(whole_rows)) == 4
    learnt = evaluation.selector[ev.trace_name(str(slice_path))]
    assert learnt["plays"] == whole["plays"] and learnt["rounds"] == whole["rounds"]
    assert learnt["final_state"]["contexts"] == whole["final_state"]["contexts"]


def test_evaluate_writes_every_file_with_the_right_columns(tmp_path, slice_path, capsys):
    out = tmp_path / "eval"
    policies = ["on-demand", "greedy", "optimal", "chc-oracle-0", "chc-oracle-0.5", "selector"]
    args = ["evaluate", "--out", str(out), "--traces", str(slice_path), "--scenarios", "2", "--nmax", "2",
            "--slack", "1.5", "--overhead", "0.1", "--base-hours", "4", "--workers", "2", "--policies", *policies]
    assert main(args) == 0
    assert "2/2 scenarios" in capsys.readouterr().err
    with (out / "results.csv").open() as handle:
        reader = csv.DictReader(handle)
        table = list(reader)
    assert tuple(reader.fieldnames) == COLUMNS
    assert len(table) == 2 * len(policies)
    assert [r["policy"] for r in table[: len(policies)]] == policies
    for r in table:
        assert float(r["utility_vs_optimal"]) <= 1.0 + 1e-6
        assert r["trace"] == "gcp_4d"
    summary = (out / "summary.md").read_text()
    assert "spotsched evaluate --out" in summary and "## gcp_4d" in summary and "## All traces" in summary
    assert f"Numerics: numpy {np.__version__}, statsmodels " in summary and ", BLAS " in summary
    results = json.loads((out / "results.json").read_text())
    assert results["numerics"].startswith(f"numpy {np.__version__}")
    assert results["selector"]["gcp_4d"]["final_state"]["version"] == 2
    assert "## Selector, expected over its draws" in (out / "summary.md").read_text()
    for name in ("cost_per_policy", "utility_vs_slack", "chc_forecast_error", "selector_weights"):
        assert (out / f"{name}.png").stat().st_size > 0


def test_chc_on_two_forecasters_is_judged_in_dollars_beside_its_forecast_error(tmp_path, slice_path):
    out = tmp_path / "eval"
    policies = ["optimal", "chc-persistence", "chc-seasonal-naive"]
    args = ["evaluate", "--out", str(out), "--traces", str(slice_path), "--scenarios", "2", "--nmax", "2",
            "--slack", "1.5", "--overhead", "0.1", "--base-hours", "4", "--workers", "1", "--policies", *policies]
    assert main(args) == 0
    errors = json.loads((out / "results.json").read_text())["forecast_errors"]["gcp_4d"]
    assert set(errors) == {"persistence", "seasonal-naive"}
    for quantity in ("available", "spot_price"):
        assert len(errors["seasonal-naive"][quantity]) == 6
        assert all(mae >= 0 for mae in errors["seasonal-naive"][quantity])
    cost: dict[str, list[float]] = {policy: [] for policy in policies}
    with (out / "results.csv").open() as handle:
        for r in csv.DictReader(handle):
            cost[r["policy"]].append(float(r["cost"]))
    saved = (sum(cost["chc-seasonal-naive"]) - sum(cost["chc-persistence"])) / 2
    lines = (out / "summary.md").read_text().split("## What each forecaster buys (CHC)")[1].splitlines()
    naive = next(line for line in lines if line.startswith("| gcp_4d | seasonal-naive |"))
    assert naive.split(" | ")[4] == f"{saved:+.2f}"
    persistence = next(line for line in lines if line.startswith("| gcp_4d | persistence |"))
    assert persistence.split(" | ")[4] == "+0.00"


def test_one_forecaster_has_nothing_to_be_judged_against(slice_path):
    config = GridConfig(traces=(str(slice_path),), scenarios=1, policies=("optimal", "chc-auto"), **TINY)
    plans = {str(slice_path): plan_scenarios(config, load_trace(slice_path))}
    assert ev.forecaster_errors(config, plans, workers=1) == {}
