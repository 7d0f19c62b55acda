"""The online run: slot-by-slot driving, resuming from JSON state, billing, budget, selector rounds."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from airflow_provider_spotsched.backends.base import InstanceState, InstanceStatus, JobStatus
from airflow_provider_spotsched.backends.local_settings import LocalReplaySettings
from airflow_provider_spotsched.execution.driver import RunDriver
from airflow_provider_spotsched.execution.environment import local_environment
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.scheduling.model import Allocation, JobError, Progress, Throughput, advance
from airflow_provider_spotsched.scheduling.online import BudgetError, OnlineRun, RunConfig
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.replay import JobMarket, job_market, simulate
from airflow_provider_spotsched.scheduling.rules import on_demand_cost
from airflow_provider_spotsched.scheduling.selector import SelectorPolicy, job_context
from airflow_provider_spotsched.scheduling.selector_store import (
    SelectorStoreError,
    close_round,
    read_document,
    selector_state,
    starting_state,
    store_round,
)
from tests.markets import make_job

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
HISTORY = 48
STORE = "Variable 'selector'"
CHEAP_POOL = [{"policy": "greedy"}, {"policy": "uniform-progress"}, {"policy": "prediction-free"}]


@pytest.fixture(scope="module")
def gcp_market(gcp_trace):
    first = datetime.fromtimestamp(gcp_trace.first_time, timezone.utc)
    return resample(gcp_trace, first, 1.0, HISTORY + 40, ["us-central1-a", "us-east5-a", "europe-west1-c"])


def gcp_job(**overrides):
    fields = dict(
        work=60.0,
        deadline_hours=16.0,
        max_instances=4,
        throughput=Throughput(1.0, 0.0),
        value=400.0,
        hard_deadline_factor=1.5,
        reconfig_overhead_hours=0.25,
    )
    fields.update(overrides)
    return make_job(**fields)


def drive(run: OnlineRun, market, round_trip: bool) -> OnlineRun:
    """Run to completion with modelled progress: the simulator's world, one slot at a time."""
    job = run.config.job
    progress = Progress()
    while True:
        if round_trip:
            run = OnlineRun.from_state(json.loads(json.dumps(run.to_state())))
        record = run.decide(progress.work_done, NOW + timedelta(hours=run.slot))
        applied = Allocation(tuple(record.allocation["spot"].get(p, 0) for p in run.config.pools), record.allocation["on_demand"])
        run.applied(applied)
        row = HISTORY + run.slot
        step = advance(job, progress, applied, market.spot_price[row], market.on_demand_price)
        if step.completion_hours is not None:
            run.complete(step.completion_hours)
            return run
        run.observe(market.spot_price[row + 1], market.available[row + 1])


@pytest.mark.parametrize("policy", ["uniform-progress", "prediction-free", "chc"])
@pytest.mark.parametrize("round_trip", [False, True])
def test_driving_slot_by_slot_reproduces_the_simulator(gcp_market, policy, round_trip):
    job = gcp_job()
    config = RunConfig("run-1", job, gcp_market.pools, policy=policy, forecaster="persistence")
    run = OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW)
    run = drive(run, gcp_market, round_trip)
    reference = simulate(make_policy(policy, {}), job, JobMarket(gcp_market, HISTORY))
    result = run.result()
    assert result["cost"] == pytest.approx(reference.outcome.cost, rel=1e-9)
    assert result["completion_hours"] == pytest.approx(reference.outcome.completion_hours)
    assert result["utility"] == pytest.approx(reference.outcome.utility, rel=1e-9)
    decided = [r["allocation"] for r in run.decision_log()]
    assert decided == [json.loads(json.dumps(s, default=int)) | {} for s in _slots(reference)]


def _slots(reference):
    return [{"spot": s["spot"], "on_demand": s["on_demand"]} for s in reference.to_dict()["slots"]]


@pytest.mark.parametrize("policy", ["on-demand", "uniform-progress"])
@pytest.mark.parametrize("market", ["pools", "rise"])
def test_a_local_run_pays_on_demand_as_the_simulator_its_pools_price_at_submission(tmp_path, market, policy):
    """The run bills, and compares with, the cheapest on-demand price of ITS pools in force at
    submission, as the simulator's job market: not the cheapest of every pool of the trace (the
    shipped GCP trace's europe-west1-c costs 11.3586 USD/h, other zones 10.3157), nor the price at
    the start of the history (here 3.00 USD/h for its first 10 h, then 4.00)."""
    extra = {"workdir": str(tmp_path / "local"), "history_slots": HISTORY}
    pools: tuple[str, ...] = ("europe-west1-c",)
    if market == "rise":
        t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
        rows = ["timestamp,market,spot_price,available,on_demand_price"]
        rows += [f"{t0 + timedelta(hours=h):%Y-%m-%dT%H:%M:%SZ},A,3.5,{h % 3},{3.0 if h < 10 else 4.0}" for h in range(80)]
        (tmp_path / "rise.csv").write_text("\n".join(rows) + "\n")
        extra["trace"], pools = str(tmp_path / "rise.csv"), ("A",)
    settings = LocalReplaySettings.from_extra(extra, "test")
    env, trace = local_environment(settings, 1.0), cached_trace(settings.trace)
    origin = datetime.fromtimestamp(trace.first_time, timezone.utc)
    job = gcp_job(work=20.0, deadline_hours=4.0, max_instances=2, throughput=Throughput(5.0, 0.0), value=500.0,
                  start=origin + timedelta(hours=HISTORY))
    config = RunConfig("od-price", job, pools, policy=policy, forecaster="persistence")
    run = RunDriver.start(env, config, lambda uri: ["true"], str(tmp_path / "checkpoint"), lambda state: None).run
    run = drive(run, resample(trace, origin, 1.0, pools=pools), round_trip=False)
    submitted = job_market(trace, job, pools)
    reference = simulate(make_policy(policy, {}), job, submitted)
    result = run.result()
    assert run.market.on_demand_price == submitted.market.on_demand_price == (11.3586 if market == "pools" else 4.0)
    assert [r["allocation"] for r in run.decision_log()] == _slots(reference)
    assert result["cost"] == pytest.approx(reference.outcome.cost, rel=1e-9)
    assert result["utility"] == pytest.approx(reference.outcome.utility, rel=1e-9)
    assert result["on_demand_cost"] == pytest.approx(on_demand_cost(job, submitted.market.on_demand_price))


def test_decision_log_holds_market_forecast_and_costs(gcp_market):
    config = RunConfig("run-2", gcp_job(), gcp_market.pools, policy="chc", forecaster="seasonal-naive")
    run = drive(OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW), gcp_market, round_trip=False)
    log = run.decision_log()
    first = log[0]
    assert set(first["market"]) == set(gcp_market.pools)
    assert first["market"]["us-central1-a"]["spot_price"] == gcp_market.spot_price[HISTORY, 0]
    assert len(first["forecast"]["us-east5-a"]["spot_price"]) == 23  # slots left before the hard deadline
    assert first["plan"][0] == first["allocation"] and len(first["plan"]) >= 1
    assert first["cost_so_far"] == 0.0 and log[-1]["cost_so_far"] <= run.cost
    assert all(b["on_demand_cost_so_far"] >= a["on_demand_cost_so_far"] for a, b in zip(log, log[1:]))
    assert json.loads(json.dumps(log)) == log
    assert run.result()["savings"] == pytest.approx(run.result()["on_demand_cost"] - run.cost)


def test_preempted_slot_is_billed_for_what_was_applied(gcp_market):
    job = gcp_job()
    run = OnlineRun.start(RunConfig("run-3", job, gcp_market.pools, policy="on-demand"), gcp_market.prefix(HISTORY + 1), NOW)
    record = run.decide(0.0, NOW)
    assert record.allocation == {"spot": {}, "on_demand": 4}
    run.applied(Allocation((0, 0, 0), 3))  # one instance failed to start
    run.observe(gcp_market.spot_price[HISTORY + 1], gcp_market.available[HISTORY + 1])
    assert run.cost == pytest.approx(3 * gcp_market.on_demand_price)
    run.decide(2.5, NOW + timedelta(hours=1), preemptions=0)
    run.applied(Allocation((0, 0, 0), 4))
    run.complete(1.5)
    assert run.cost == pytest.approx(3 * gcp_market.on_demand_price + 0.5 * 4 * gcp_market.on_demand_price)


def test_preemptions_are_counted_per_pool_and_only_grow(gcp_market):
    """What the UI shows: the backend's per-pool counts, noted after the decision, kept by the result."""
    pools = gcp_market.pools
    status = JobStatus("run-p", (
        InstanceStatus("i-1", pools[0], InstanceState.PREEMPTED), InstanceStatus("i-2", pools[0], InstanceState.PREEMPTED),
        InstanceStatus("i-3", pools[1], InstanceState.PREEMPTED), InstanceStatus("i-4", pools[1], InstanceState.RUNNING),
    ))
    assert status.preemptions_by_pool == {pools[0]: 2, pools[1]: 1} and status.preemptions == 3
    run = OnlineRun.start(RunConfig("run-p", gcp_job(), pools), gcp_market.prefix(HISTORY + 1), NOW)
    run.decide(0.0, NOW, 1, {pools[0]: 1}, {"loss": 2.5, "samples_per_second": 3.0})
    run.note_preemptions(status.preemptions, status.preemptions_by_pool)
    run.note_preemptions(1, {pools[0]: 1})  # a status that forgot instances lowers nothing
    record = run.records[-1]
    assert record.preempted_by_pool == {pools[0]: 2, pools[1]: 1} and record.preemptions == 3
    assert record.training == {"loss": 2.5, "samples_per_second": 3.0}
    assert (record.deadline_hours, record.hard_deadline_hours) == (gcp_job().deadline_hours, gcp_job().hard_deadline_hours)
    assert run.result()["preemptions_by_pool"] == {pools[0]: 2, pools[1]: 1}
    restored = OnlineRun.from_state(json.loads(json.dumps(run.to_state())))
    assert restored.records[-1] == record


def test_a_state_stored_before_the_ui_fields_still_loads(gcp_market):
    run = OnlineRun.start(RunConfig("run-old", gcp_job(), gcp_market.pools), gcp_market.prefix(HISTORY + 1), NOW)
    run.decide(0.0, NOW)
    state = json.loads(json.dumps(run.to_state()))
    for name in ("preempted_by_pool", "training", "next_decision", "deadline_hours", "hard_deadline_hours"):
        del state["records"][0][name]
    restored = OnlineRun.from_state(state)
    assert restored.records[0].preempted_by_pool == {} and restored.records[0].training is None


def test_refusals_before_anything_is_launched(gcp_market):
    history = gcp_market.prefix(HISTORY + 1)
    with pytest.raises(JobError, match="infeasible"):
        OnlineRun.start(RunConfig("r", gcp_job(work=1000.0), gcp_market.pools), history, NOW)
    with pytest.raises(JobError, match=r"unknown pool\(s\) \['mars-1a'\]"):
        OnlineRun.start(RunConfig("r", gcp_job(), ("mars-1a",)), history, NOW)
    with pytest.raises(JobError, match="needs the future market"):
        OnlineRun.start(RunConfig("r", gcp_job(), gcp_market.pools, policy="optimal"), history, NOW)
    with pytest.raises(JobError, match=r"max_instances=4: policy=skynomad runs a single instance; set max_instances=1"):
        OnlineRun.start(RunConfig("r", gcp_job(), gcp_market.pools, policy="skynomad"), history, NOW)
    with pytest.raises(BudgetError, match="raise the budget to >="):
        OnlineRun.start(RunConfig("r", gcp_job(), gcp_market.pools, budget=1.0), history, NOW)
    with pytest.raises(BudgetError, match=r"budget=-5: not a number of USD > 0"):
        RunConfig("r", gcp_job(), gcp_market.pools, budget=-5)


def test_budget_cap_stops_the_slot_that_would_exceed_it(gcp_market):
    least = 60.0 * float(gcp_market.spot_price[HISTORY].min())
    budget = least * 1.01  # covers the cheapest run, not four on-demand instances for long
    config = RunConfig("r", gcp_job(), gcp_market.pools, policy="on-demand", budget=budget)
    run = OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW)
    hourly = 4 * gcp_market.on_demand_price
    with pytest.raises(BudgetError, match="over budget"):
        for row in range(HISTORY + 1, HISTORY + 40):
            run.decide(0.0, NOW)
            run.applied(Allocation((0, 0, 0), 4))
            run.observe(gcp_market.spot_price[row], gcp_market.available[row])
    assert run.cost <= budget and run.cost + hourly > budget


def test_slot_cannot_be_decided_twice_or_after_completion(gcp_market):
    run = OnlineRun.start(RunConfig("r", gcp_job(), gcp_market.pools, policy="greedy"), gcp_market.prefix(HISTORY + 1), NOW)
    run.decide(0.0, NOW)
    with pytest.raises(ValueError, match="already decided"):
        run.decide(0.0, NOW)
    run.applied(Allocation((1, 0, 0), 0))
    run.complete(0.5)
    with pytest.raises(ValueError, match="completed"):
        run.decide(0.0, NOW)


def test_next_slot_bills_an_unreported_decision_as_decided(gcp_market):
    run = OnlineRun.start(RunConfig("r", gcp_job(), gcp_market.pools, policy="greedy"), gcp_market.prefix(HISTORY + 1), NOW)
    with pytest.raises(ValueError, match="not decided yet"):
        run.next_slot(gcp_market.spot_price[HISTORY + 1], gcp_market.available[HISTORY + 1])
    record = run.decide(0.0, NOW)
    start = run.market_now
    run.next_slot(gcp_market.spot_price[HISTORY + 1], gcp_market.available[HISTORY + 1])
    decided = Allocation(tuple(record.allocation["spot"].get(p, 0) for p in run.config.pools), record.allocation["on_demand"])
    hourly = float(decided.spot @ gcp_market.spot_price[HISTORY]) + decided.on_demand * gcp_market.on_demand_price
    assert run.records[0].applied == record.allocation
    assert run.cost == pytest.approx(hourly) and run.cost > 0
    assert run.slot == 1 and not run.decided and run.market_now == start + timedelta(hours=1)


def test_a_slot_nobody_stepped_runs_on_the_allocation_in_force_capped_by_capacity(gcp_market):
    run = OnlineRun.start(RunConfig("r", gcp_job(), gcp_market.pools, policy="greedy"), gcp_market.prefix(HISTORY + 1), NOW)
    with pytest.raises(ValueError, match="no slot has been decided"):
        run.pass_unwatched(gcp_market.spot_price[HISTORY + 1], gcp_market.available[HISTORY + 1], NOW, 0.0)
    run.decide(0.0, NOW)
    run.applied(Allocation((2, 1, 0), 1))
    short = np.array([1, 5, 0])  # the first pool's capacity fell to 1
    record = run.pass_unwatched(gcp_market.spot_price[HISTORY + 1], short, NOW + timedelta(hours=1), 7.0)
    assert run.slot == 1 and record.slot == 1 and run.records[-1] is record
    assert record.allocation == record.applied == {"spot": {run.config.pools[0]: 1, run.config.pools[1]: 1}, "on_demand": 1}
    assert record.work_done == 7.0 and record.forecast is None and record.plan is None
    assert record.market[run.config.pools[0]]["available"] == 1
    slot0 = 2 * gcp_market.spot_price[HISTORY, 0] + gcp_market.spot_price[HISTORY, 1] + gcp_market.on_demand_price
    assert record.cost_so_far == pytest.approx(slot0), "slot 0 billed whole when the next slot begins"
    assert record.on_demand_cost_so_far == pytest.approx(4 * gcp_market.on_demand_price)


def test_a_decision_that_never_reached_the_backend_bills_what_ran_on(gcp_market):
    """The caller stored slot 1's decision and died before the backend acted: slot 0's instances
    ran on through slot 1 (capped by its capacity), and that is what slot 1 costs."""
    run = OnlineRun.start(RunConfig("r", gcp_job(), gcp_market.pools, policy="greedy"), gcp_market.prefix(HISTORY + 1), NOW)
    run.decide(0.0, NOW)
    run.applied(Allocation((2, 1, 0), 1))
    run.observe(gcp_market.spot_price[HISTORY + 1], np.array([1, 5, 0]))
    run.decide(10.0, NOW + timedelta(hours=1))
    assert run.records[-1].applied is None
    before = run.cost
    run.ran_on_undelivered()
    assert run.records[-1].applied == {"spot": {run.config.pools[0]: 1, run.config.pools[1]: 1}, "on_demand": 1}
    run.complete(1.5)
    slot1 = 0.5 * (gcp_market.spot_price[HISTORY + 1, 0] + gcp_market.spot_price[HISTORY + 1, 1] + gcp_market.on_demand_price)
    assert run.cost == pytest.approx(before + slot1)
    run.ran_on_undelivered()  # nothing left undelivered: a no-op
    assert run.cost == pytest.approx(before + slot1)


def test_hours_follow_the_accelerated_clock(gcp_market):
    config = RunConfig("r", gcp_job(), gcp_market.pools, seconds_per_slot=5.0)
    run = OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW)
    assert run.hours_at(NOW + timedelta(seconds=12.5)) == pytest.approx(2.5)


def test_selector_run_records_its_member_and_closes_one_round(gcp_market):
    config = RunConfig("sel-1", gcp_job(), gcp_market.pools, policy="selector", policy_params={"warm_up_rounds": 2})
    run = OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW)
    assert run.member["label"] in SelectorPolicy(warm_up_rounds=2).labels
    assert learnt_rounds(run.selector_start) == 2 and run.selector_start["draws"] == 1
    run = drive(run, gcp_market, round_trip=True)
    assert run.result()["policy"] == run.member["label"]
    document = close_round(None, run)
    assert document["runs"] == ["sel-1"] and learnt_rounds(document["selector"]) == 3
    assert document["selector"]["draws"] == 1  # the next run draws after this one
    assert close_round(document, run) == document  # idempotent: a retried close learns once
    selector = SelectorPolicy.from_state(selector_state(document))
    assert selector.rounds_learnt(config.job) == 3
    # the round's weights are kept for the fleet dashboard, by kind of job
    assert document["history"] == [{"job_id": "sel-1", "context": job_context(config.job), "round": 3,
                                    "member": run.member["label"], "weights": selector.weights(config.job)}]
    assert close_round({**document, "runs": [], "history": "damaged"}, run)["history"][0]["job_id"] == "sel-1"


def learnt_rounds(state: dict) -> int:
    """Rounds learnt over every kind of job in a selector state."""
    return sum(context["rounds"] for context in state["contexts"].values())


def test_concurrent_rounds_both_survive(gcp_market):
    runs = []
    for job_id in ("a", "b"):
        config = RunConfig(job_id, gcp_job(), gcp_market.pools, policy="selector", policy_params={"warm_up_rounds": 1})
        runs.append(drive(OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW), gcp_market, round_trip=False))
    stored: dict = {}
    stale = close_round(None, runs[1])  # run b read the empty store before a wrote

    writes = iter([stale])

    def write(document):
        stored["doc"] = document
        stale_write = next(writes, None)  # b's stale write lands right after a's first write
        if stale_write is not None:
            stored["doc"] = stale_write

    def read() -> str | None:
        return json.dumps(stored["doc"]) if "doc" in stored else None

    store_round(read, write, runs[0], STORE, pause_seconds=0)
    store_round(read, lambda d: stored.update(doc=d), runs[1], STORE, pause_seconds=0)
    assert sorted(stored["doc"]["runs"]) == ["a", "b"]
    assert learnt_rounds(stored["doc"]["selector"]) == 3  # one warm-up round, then a and b


def test_store_gives_up_with_a_clear_error_when_every_write_is_lost(gcp_market):
    config = RunConfig("c", gcp_job(), gcp_market.pools, policy="selector", policy_params={"warm_up_rounds": 1})
    run = drive(OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW), gcp_market, round_trip=False)
    with pytest.raises(SelectorStoreError, match="in 3 attempts"):
        store_round(lambda: None, lambda d: None, run, STORE, attempts=3, pause_seconds=0)


def test_round_for_a_non_selector_run_is_refused(gcp_market):
    run = OnlineRun.start(RunConfig("d", gcp_job(), gcp_market.pools, policy="greedy"), gcp_market.prefix(HISTORY + 1), NOW)
    with pytest.raises(SelectorStoreError, match="not played by the selector"):
        close_round(None, run)


def selector_run(gcp_market, job_id: str, job=None, state=None, **params) -> OnlineRun:
    """A finished run of a cheap selector (no warm-up unless asked), started from the stored
    ``state`` if any, ready to close its round."""
    params = {"pool": CHEAP_POOL, "warm_up_rounds": 0, **params}
    config = RunConfig(job_id, job or gcp_job(), gcp_market.pools, policy="selector", policy_params=params)
    return drive(OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW, state), gcp_market, round_trip=False)


def memory_store() -> tuple[dict, Callable[[], str | None], Callable[[dict], None]]:
    """A store as the operator's Variable: JSON text, ``None`` until first written."""
    stored: dict = {}
    return stored, lambda: stored.get("doc"), lambda document: stored.update(doc=json.dumps(document))


def test_a_kind_new_to_an_existing_store_keeps_the_warm_up_its_run_did(gcp_market):
    """The run warms a new kind up when it starts; the round closes on the stored selector, which
    has no learner for it: learnt on a blank one, the warm-up would be lost and never run again."""
    stored, read, write = memory_store()
    store_round(read, write, selector_run(gcp_market, "a", warm_up_rounds=2), STORE, pause_seconds=0)
    new_kind = gcp_job(deadline_hours=24.0)
    # b and c start before either closes: both warm the new kind up
    runs = [selector_run(gcp_market, job_id, new_kind, starting_state(read(), STORE), warm_up_rounds=2) for job_id in "bc"]
    assert [run.selector_start["contexts"][job_context(new_kind)]["rounds"] for run in runs] == [2, 2]
    store_round(read, write, runs[0], STORE, pause_seconds=0)
    contexts = json.loads(read())["selector"]["contexts"]
    assert contexts[job_context(new_kind)]["rounds"] == 3  # 2 warm-up rounds and b's
    assert list(contexts) == [job_context(gcp_job()), job_context(new_kind)]  # the most recently played last
    store_round(read, write, runs[1], STORE, pause_seconds=0)
    document = json.loads(read())
    assert document["selector"]["contexts"][job_context(new_kind)]["rounds"] == 4  # c learns on b's learner
    assert [entry["round"] for entry in document["history"]] == [3, 3, 4]


def test_a_version_1_store_keeps_the_warm_up_of_the_run_that_upgrades_it(gcp_market, caplog):
    """Upgrading a version-1 document drops its weights: each kind warms up on its next run, and
    that warm-up must survive the round's close on the (still version-1) stored document."""
    stored, read, write = memory_store()
    version_1 = {key: value for key, value in stored_selector(warm_up_rounds=2).items() if key not in ("contexts", "current")}
    labels = SelectorPolicy(pool=CHEAP_POOL).labels
    version_1 |= {"version": 1, "choice": "sample", "horizon": None, "loss_scale": 1.0,
                  "cumulative_loss": dict.fromkeys(labels, 1.0), "rounds": 7, "draws": 7, "current": None}
    write({"selector": version_1, "runs": ["old"]})
    run = selector_run(gcp_market, "new", state=starting_state(read(), STORE), warm_up_rounds=2)
    assert run.selector_start["contexts"][job_context(gcp_job())]["rounds"] == 2
    store_round(read, write, run, STORE, pause_seconds=0)
    document = json.loads(read())
    assert document["selector"]["version"] == 2 and document["runs"] == ["old", "new"]
    assert document["selector"]["contexts"][job_context(gcp_job())]["rounds"] == 3
    assert "selector state version 1 upgraded to version 2" in caplog.text


# Each is text an existing store can hold that is no selector document: a fresh selector over it
# would discard what was learnt.
DAMAGED = {
    "not-json": ("selector: {oops", "its text is not JSON"),
    "null": ("null", "it holds null, not a JSON object"),
    "empty-string": ('""', 'it holds "", not a JSON object'),
    "empty-text": ("", "its text is not JSON"),
    "list": ("[]", "it holds \\[\\], not a JSON object"),
    "zero": ("0", "it holds 0, not a JSON object"),
    "false": ("false", "it holds false, not a JSON object"),
    "empty-object": ("{}", 'holds neither "selector" nor a selector state'),
    "selector-not-an-object": ('{"selector": 5}', '"selector" must be a selector state object'),
    "malformed-state": ('{"selector": {"version": 2, "pool": []}}', "missing field"),
    "runs-not-a-list": (None, '"runs" must be a list of job ids'),
}


def damaged_text(name: str, valid: dict) -> str:
    """Damaged text ``name``; a malformed "runs" is spliced into the ``valid`` document."""
    text = DAMAGED[name][0]
    return json.dumps({**valid, "runs": "job-1"}) if text is None else text


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_store_that_holds_no_selector_document_is_refused_naming_it_and_the_fix(gcp_market, name):
    valid = close_round(None, selector_run(gcp_market, "v"))
    with pytest.raises(SelectorStoreError, match=DAMAGED[name][1]) as refused:
        starting_state(damaged_text(name, valid), STORE)
    message = str(refused.value)
    assert message.startswith(f"{STORE} holds no valid selector state")
    assert f"restore it from a backup, or delete {STORE} to start learning afresh" in message


def test_only_a_missing_store_starts_a_fresh_selector(gcp_market, caplog):
    valid = close_round(None, selector_run(gcp_market, "v"))
    with caplog.at_level("INFO", logger="airflow_provider_spotsched.scheduling.selector_store"):
        assert starting_state(None, STORE) is None
    assert f"{STORE} does not exist yet; the selector starts fresh" in caplog.text
    assert read_document(json.dumps(valid), STORE) == valid
    assert starting_state(json.dumps(valid), STORE) == valid["selector"]
    bare = valid["selector"]  # a bare to_state() document is a selector document too
    assert starting_state(json.dumps(bare), STORE) == bare


@pytest.mark.parametrize("name", ["not-json", "null", "list", "empty-object"])
def test_closing_on_a_store_damaged_meanwhile_leaves_it_as_it_is(gcp_market, name):
    run = selector_run(gcp_market, "late")
    damaged = damaged_text(name, close_round(None, run))
    written = []
    with pytest.raises(SelectorStoreError, match=DAMAGED[name][1]) as refused:
        store_round(lambda: damaged, written.append, run, STORE, pause_seconds=0)
    assert written == [], "the damaged store is not replaced"
    message = str(refused.value)
    assert "The round of run late was not stored" in message and "retry the task" in message


def stored_selector(**settings) -> dict:
    return SelectorPolicy(**{"pool": CHEAP_POOL, "warm_up_rounds": 0, **settings}).to_state()


@pytest.mark.parametrize(
    ("settings", "differ", "wrapped"),
    [
        ({"pool": CHEAP_POOL[:2]}, r"pool: members only stored \[\], only the run's \['prediction-free\(.*\)'\]", True),
        ({"algorithm": "exp3"}, "algorithm: stored 'exp3', the run's 'hedge'", True),
        ({"seed": 7}, "seed: stored 7, the run's 0", True),
        ({"seed": 7}, "seed: stored 7, the run's 0", False),
    ],
    ids=["pool", "algorithm", "seed", "seed-bare-state"],
)
def test_a_round_closing_into_another_selector_is_dropped_with_a_warning(gcp_market, caplog, settings, differ, wrapped):
    """The store was deleted and recreated by a run with other policy_params while this one
    trained: its member was drawn from other weights, so the round is dropped (not learnt, not
    raised: the finished task keeps its result), and its job id recorded so a retry does not retry."""
    other = stored_selector(**settings)
    before = {"selector": other, "runs": ["b"], "last_round": {"job_id": "b"}, "history": [{"job_id": "b"}]} if wrapped else other
    stored = {"doc": json.dumps(before)}
    run = selector_run(gcp_market, "a")
    with caplog.at_level("WARNING", logger="airflow_provider_spotsched.scheduling.selector_store"):
        store_round(lambda: stored["doc"], lambda d: stored.update(doc=json.dumps(d)), run, STORE, pause_seconds=0)
    document = json.loads(stored["doc"])
    kept = before if wrapped else {"selector": other, "runs": []}
    assert document == {**kept, "runs": kept["runs"] + ["a"]}, "nothing learnt: the stored selector is as it was"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"selector state: {STORE} holds another selector than run a started from (")
    assert re.search(differ, warning) and f"the round of its member {run.member['label']!r} is dropped" in warning
    caplog.clear()
    store_round(lambda: stored["doc"], lambda d: stored.update(doc=json.dumps(d)), run, STORE, pause_seconds=0)  # a retry
    assert json.loads(stored["doc"]) == document and not caplog.records


@pytest.mark.parametrize(
    ("asked", "message"),
    [
        ({"algorithm": "exp3", "seed": 7}, "algorithm: stored 'hedge', asked 'exp3'; seed: stored 0, asked 7"),
        ({"warm_up_rounds": 12}, "warm_up_rounds: stored 0, asked 12"),
        ({"pool": CHEAP_POOL[:2]}, r"pool: members only stored \['prediction-free\(.*\)'\], only asked \[\]"),
        ({"pool": CHEAP_POOL[::-1]}, "pool: members reordered"),
    ],
    ids=["algorithm-and-seed", "warm-up", "pool", "pool-order"],
)
def test_policy_params_that_differ_from_the_stored_selector_are_refused(gcp_market, asked, message):
    params = {"pool": CHEAP_POOL, "warm_up_rounds": 0, **asked}
    config = RunConfig("r", gcp_job(), gcp_market.pools, policy="selector", policy_params=params)
    with pytest.raises(JobError, match=message) as refused:
        OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW, stored_selector())
    assert str(refused.value).startswith("policy_params ask for another selector than the stored one")
    assert "drop policy_params to keep learning with it, or give another selector state" in str(refused.value)


def test_unnamed_policy_params_mean_their_defaults(gcp_market):
    config = RunConfig("r", gcp_job(), gcp_market.pools, policy="selector", policy_params={"seed": 0})
    with pytest.raises(JobError, match=r"pool: members only stored .*; warm_up_rounds: stored 0, asked 12"):
        OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW, stored_selector())


def test_policy_params_that_match_the_stored_selector_or_none_keep_learning_with_it(gcp_market):
    stored = stored_selector(algorithm="exp3", seed=7)
    stored["draws"] = 5
    history = gcp_market.prefix(HISTORY + 1)
    same = {"pool": CHEAP_POOL, "warm_up_rounds": 0, "algorithm": "exp3", "seed": 7}
    for params in (same, {}):
        config = RunConfig("r", gcp_job(), gcp_market.pools, policy="selector", policy_params=params)
        run = OnlineRun.start(config, history, NOW, stored)
        assert run.selector_start["draws"] == 6  # drawn after the stored draws: the stored selector played
        assert (run.selector_start["algorithm"], run.selector_start["seed"]) == ("exp3", 7)


@pytest.mark.parametrize("policy", ["chc", "uniform-progress"])
def test_a_slot_with_all_work_done_runs_min_instances_on_demand_without_planning(gcp_market, policy):
    """The runtime was stopped on its way out after its last checkpoint: the job only needs an instance to
    see that and exit 0; a planner asked to plan zero remaining work would refuse."""
    job = gcp_job(min_instances=2)
    run = OnlineRun.start(RunConfig("r", job, gcp_market.pools, policy=policy), gcp_market.prefix(HISTORY + 1), NOW)
    run.decide(30.0, NOW)
    run.applied(Allocation((2, 0, 0), 0))
    run.next_slot(gcp_market.spot_price[HISTORY + 1], gcp_market.available[HISTORY + 1])
    record = run.decide(job.work, NOW + timedelta(hours=1))
    assert record.allocation == {"spot": {}, "on_demand": 2} and record.plan is None
    resumed = OnlineRun.from_state(json.loads(json.dumps(run.to_state())))
    resumed.applied(Allocation((0, 0, 0), 2))
    resumed.next_slot(gcp_market.spot_price[HISTORY + 2], gcp_market.available[HISTORY + 2])
    assert resumed.decide(job.work, NOW + timedelta(hours=2)).plan is None  # the replay skips the finished slot
