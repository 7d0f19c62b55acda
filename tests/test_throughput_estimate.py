"""The measured throughput: the estimator, the simulator's true throughput, and the online run."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.cli import main
from airflow_provider_spotsched.market.slots import SlotMarket, resample
from airflow_provider_spotsched.scheduling.model import Allocation, JobError, Progress, Throughput, advance
from airflow_provider_spotsched.scheduling.online import OnlineRun, RunConfig
from airflow_provider_spotsched.scheduling.policies import make_policy
from airflow_provider_spotsched.scheduling.replay import JobMarket, simulate
from airflow_provider_spotsched.scheduling.rules import on_demand_cost
from airflow_provider_spotsched.scheduling.selector import SelectorPolicy, shortfall_losses
from airflow_provider_spotsched.scheduling.selector_store import close_round
from airflow_provider_spotsched.scheduling.throughput_estimate import ThroughputEstimate
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput
from airflow_provider_spotsched.simulation.evaluation import GridConfig
from tests.markets import make_job

DECLARED = Throughput(2.0, 1.0)
SLOWER = 1 / 1.3  # the throughput declared 30% too high
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
HISTORY = 48


def measured(estimate: ThroughputEstimate, ratio: float, slots: int, n: int = 4, hours: float = 1.0) -> None:
    for _ in range(slots):
        estimate.observe(n, hours, ratio * hours * DECLARED(n))


def test_before_any_measurement_the_estimate_is_the_declaration():
    estimate = ThroughputEstimate(DECLARED)
    job = make_job()
    assert estimate.factor == 1.0 and estimate.job(job) is job
    estimate.observe(0, 1.0, 0.0)  # paused: nothing learnt
    estimate.observe(2, 0.0, 0.0)  # all time lost to reconfiguration
    assert estimate.weight == 0.0


def test_a_slower_job_is_believed_from_the_first_slot_and_converges():
    estimate = ThroughputEstimate(DECLARED)
    measured(estimate, 0.7, 1)
    assert estimate.factor == pytest.approx(0.7)  # bad news at once: the bound ignores the prior
    measured(estimate, 0.7, 20)
    assert estimate.factor == pytest.approx(0.7)
    assert estimate.throughput() == Throughput(pytest.approx(1.4), pytest.approx(0.7))


def test_a_faster_job_is_never_planned_above_its_declaration():
    estimate = ThroughputEstimate(DECLARED, prior_hours=2.0)
    measured(estimate, 1.2, 1)
    prior = 2.0 * 0.5 ** (1.0 / estimate.half_life_hours)  # the prior fades like a measurement
    assert estimate.shrunk_factor == pytest.approx((prior + 1.2) / (prior + 1.0))
    measured(estimate, 1.2, 30)
    assert estimate.shrunk_factor == pytest.approx(1.2, rel=0.01)
    assert estimate.factor == 1.0


def test_a_mid_job_slowdown_takes_over_within_a_few_slots():
    estimate = ThroughputEstimate(DECLARED)
    measured(estimate, 1.0, 20)
    factors = []
    for _ in range(8):
        measured(estimate, 0.7, 1)
        factors.append(estimate.factor)
    assert factors[0] < 0.95  # the spread of old and new widens the bound at once
    assert all(b <= a + 1e-12 for a, b in zip(factors, factors[1:]))
    assert factors[5] < 0.75
    assert factors[-1] == pytest.approx(0.7, abs=0.02)


def test_noisy_measurements_are_estimated_below_their_mean():
    rng = np.random.default_rng(0)
    estimate = ThroughputEstimate(DECLARED)
    ratios = rng.normal(0.9, 0.05, 40)
    for ratio in ratios:
        estimate.observe(4, 1.0, ratio * DECLARED(4))
    assert 0.8 < estimate.factor < 0.9  # conservative, yet close
    assert estimate.factor < estimate.shrunk_factor


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"half_life_hours": 0.0}, "half_life_hours"),
        ({"prior_hours": -1.0}, "prior_hours"),
        ({"confidence_z": float("nan")}, "confidence_z"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(JobError, match=field):
        ThroughputEstimate(DECLARED, **kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"factor": 0.0}, "factor"),
        ({"factor": -0.5}, "factor"),
        ({"factor": 1.0, "slowdown_at_hours": 3.0, "slowdown_factor": 0.0}, "slowdown_factor"),
        ({"factor": 1.0, "slowdown_at_hours": -1.0, "slowdown_factor": 0.7}, "slowdown_at_hours"),
        ({"factor": 1.0, "slowdown_factor": 0.7}, "slowdown_factor"),
    ],
)
def test_a_true_throughput_factor_of_zero_or_less_is_refused(kwargs, field):
    with pytest.raises(JobError, match=f"^{field}="):
        TrueThroughput(**kwargs)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--true-throughput", "0"], "--true-throughput=0"),
        (["--slowdown-factor", "0.7"], "--slowdown-factor=0.7 needs --slowdown-at-hours"),
    ],
)
def test_the_cli_names_the_flag_of_a_bad_factor(tmp_path, capsys, flags, message):
    job = tmp_path / "job.json"
    job.write_text(json.dumps(make_job().to_dict()))
    out = ["--out", str(tmp_path / "r.json")]
    code = main(["simulate", "--trace", str(GCP_TRACE), "--job", str(job), "--policy", "greedy", *out, *flags])
    assert code == 2
    assert message in capsys.readouterr().err


def test_true_throughput_slows_down_from_its_hour():
    truth = TrueThroughput(0.9, slowdown_at_hours=5.0, slowdown_factor=0.5)
    job = make_job()
    assert truth.job_at(job, 4.0).throughput.alpha == pytest.approx(0.9)
    assert truth.job_at(job, 5.0).throughput.alpha == pytest.approx(0.45)
    assert truth.slowest_job(job).throughput.alpha == pytest.approx(0.45)
    assert TrueThroughput().job_at(job, 3.0) is job
    late = TrueThroughput(0.9, slowdown_at_hours=job.horizon_slots * job.slot_hours, slowdown_factor=0.5)
    assert late.slowest_job(job).throughput.alpha == pytest.approx(0.9)  # after its last slot: hindsight plans at 0.9


# A market where spot is cheap for nine slots and then comes and goes: a policy that believes
# the declared throughput banks on it and runs out of time; found by a search over such markets.
AVAILABLE = [4] * 9 + [0, 0, 0, 4, 4, 0, 0, 0, 4, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 4, 0]


def intermittent_market() -> SlotMarket:
    slots = len(AVAILABLE)
    return SlotMarket(
        pools=("a",),
        start=NOW,
        slot_hours=1.0,
        spot_price=np.full((slots, 1), 0.3),
        available=np.asarray(AVAILABLE, int)[:, None],
        on_demand_price=1.0,
    )


def tight_job():
    """10 h of work on 4 instances as declared (13 h in truth), deadline 18 h, no hard slack."""
    return make_job(work=40.0, deadline_hours=18.0, max_instances=4, value=100.0, hard_deadline_factor=1.0, reconfig_overhead_hours=0.25)


@pytest.mark.parametrize("policy, params", [("uniform-progress", {}), ("chc", {"forecaster": "persistence"})])
def test_the_estimate_meets_a_deadline_the_declared_throughput_misses(policy, params):
    market, job, truth = JobMarket(intermittent_market(), 0), tight_job(), TrueThroughput(SLOWER)
    job.check_feasible()
    blind = simulate(make_policy(policy, params), job, market, truth, estimate_throughput=False)
    measuring = simulate(make_policy(policy, params), job, market, truth)
    assert blind.outcome.hard_miss
    assert not measuring.outcome.hard_miss and not measuring.outcome.soft_miss
    assert measuring.to_dict()["true_throughput"]["factor"] == pytest.approx(SLOWER)


def test_the_estimate_changes_nothing_when_the_declaration_is_right():
    market, job = JobMarket(intermittent_market(), 0), tight_job()
    for policy in ("greedy", "uniform-progress", "prediction-free"):
        with_estimate = simulate(make_policy(policy, {}), job, market)
        without = simulate(make_policy(policy, {}), job, market, estimate_throughput=False)
        assert with_estimate.allocations == without.allocations
        assert "true_throughput" not in with_estimate.to_dict()


def test_optimal_plans_on_the_true_throughput():
    market, job, truth = JobMarket(intermittent_market(), 0), tight_job(), TrueThroughput(SLOWER)
    result = simulate(make_policy("optimal", {}), job, market, truth)
    assert not result.outcome.soft_miss
    work = sum(s.progress for s in result.outcome.slots)
    assert work == pytest.approx(job.work)


def test_grid_config_carries_the_truth_into_its_record():
    config = GridConfig(scenarios=1, n_max=(2,), slack=(1.5,), overhead=(0.1,), true_throughput=TrueThroughput(0.8))
    assert config.to_dict()["true_throughput"] == {"factor": 0.8, "slowdown_at_hours": None, "slowdown_factor": 1.0}
    assert config.estimate_throughput


@pytest.fixture(scope="module")
def gcp_market(gcp_trace):
    first = datetime.fromtimestamp(gcp_trace.first_time, timezone.utc)
    return resample(gcp_trace, first, 1.0, HISTORY + 40, ["us-central1-a", "us-east5-a", "europe-west1-c"])


def stamp(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def drive_slower(run: OnlineRun, market: SlotMarket, truth: TrueThroughput, resume_stamps: bool = True) -> OnlineRun:
    """Run to completion on the true throughput, resuming from JSON state at every slot. Each
    decision reads a runtime's report, stamped when the work was reached and, with
    ``resume_stamps``, when the workers last (re)started resumed training: the reconfiguration
    overhead after the decision that started them."""
    progress = Progress()
    training: dict[str, object] | None = None
    while True:
        run = OnlineRun.from_state(json.loads(json.dumps(run.to_state())))
        decided = NOW + timedelta(hours=run.slot)
        record = run.decide(progress.work_done, decided, training=training)
        applied = Allocation(tuple(record.allocation["spot"].get(p, 0) for p in run.config.pools), record.allocation["on_demand"])
        run.applied(applied)
        row = HISTORY + run.slot
        real = truth.job_at(run.config.job, run.slot * run.config.job.slot_hours)
        before = progress.work_done
        step = advance(real, progress, applied, market.spot_price[row], market.on_demand_price)
        if step.completion_hours is not None:
            run.complete(step.completion_hours)
            return run
        training = {**(training or {}), "updated": stamp(decided + timedelta(hours=1)), "checkpointed": stamp(decided + timedelta(hours=1))}
        if step.reconfiguration and resume_stamps:
            overhead = timedelta(hours=run.config.job.reconfig_overhead_hours)
            training.update(resumed=stamp(decided + overhead), resumed_samples=before)
        run.observe(market.spot_price[row + 1], market.available[row + 1])


@pytest.mark.parametrize("policy, params", [("uniform-progress", {}), ("chc", {}), ("prediction-free", {"guard": 1.2})])
def test_an_online_run_estimates_as_the_simulator_does_across_restarts(gcp_market, policy, params):
    job = make_job(work=60.0, deadline_hours=20.0, max_instances=4, value=400.0, reconfig_overhead_hours=0.25)
    truth = TrueThroughput(SLOWER, slowdown_at_hours=6.0, slowdown_factor=0.9)
    config = RunConfig("run-slow", job, gcp_market.pools, policy=policy, policy_params=params, forecaster="persistence")
    run = drive_slower(OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW), gcp_market, truth)
    reference = simulate(make_policy(policy, params), job, JobMarket(gcp_market, HISTORY), truth)
    assert run.result()["cost"] == pytest.approx(reference.outcome.cost, rel=1e-9)
    assert run.result()["completion_hours"] == pytest.approx(reference.outcome.completion_hours)
    log = run.decision_log()
    assert log[0]["throughput"] == {"alpha": 1.0, "beta": 0.0}
    assert log[1]["throughput"]["alpha"] == pytest.approx(SLOWER)  # slot 0 measured from the resume on
    assert log[-1]["throughput"]["alpha"] < SLOWER  # the slowdown was measured too


def test_a_slot_that_starts_workers_is_measured_only_from_their_resume_stamp(gcp_market):
    """Without the runtime's resume stamp (a user's command may write none) the start slot says
    nothing; with it, the slot measures the training after the start, and a slow start (the
    workers resume late in the slot) is not read as a slow throughput."""
    job = make_job(work=60.0, deadline_hours=20.0, max_instances=4, value=400.0, reconfig_overhead_hours=0.25)

    def factor_after_the_start(training: dict[str, object] | None) -> float:
        config = RunConfig("run-start", job, gcp_market.pools, policy="on-demand")
        run = OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW)
        run.decide(0.0, NOW)
        run.applied(Allocation(tuple(0 for _ in run.config.pools), 4))
        run.observe(gcp_market.spot_price[HISTORY + 1], gcp_market.available[HISTORY + 1])
        return run.decide(0.4 * job.rate(4), NOW + timedelta(hours=1), training=training).throughput["alpha"]

    worked = {"updated": stamp(NOW + timedelta(hours=1)), "checkpointed": stamp(NOW + timedelta(hours=1))}
    assert factor_after_the_start(worked) == 1.0  # no resume stamp: not a measurement
    assert factor_after_the_start({**worked, "resumed": "soon", "resumed_samples": 0}) == 1.0
    resumed_late = {**worked, "resumed": stamp(NOW + timedelta(hours=0.6)), "resumed_samples": 0}
    assert factor_after_the_start(resumed_late) == pytest.approx(1.0)  # 0.4 h of work in the 0.4 h it trained
    resumed_early = {**worked, "resumed": stamp(NOW + timedelta(hours=0.2)), "resumed_samples": 0}
    assert factor_after_the_start(resumed_early) == pytest.approx(0.5)  # 0.4 h of work in 0.8 h: half the speed
    assert factor_after_the_start({**resumed_early, "resumed_samples": "none"}) == 1.0  # from what work? not a measurement
    resumed_before_the_decision = {**worked, "resumed": stamp(NOW - timedelta(hours=0.2)), "resumed_samples": 0}
    assert factor_after_the_start(resumed_before_the_decision) == 1.0  # another process's stamp: not this slot's


def test_without_resume_stamps_an_online_run_measures_only_the_slots_that_kept_their_workers(gcp_market):
    job = make_job(work=60.0, deadline_hours=20.0, max_instances=4, value=400.0, reconfig_overhead_hours=0.25)
    config = RunConfig("run-old-runtime", job, gcp_market.pools, policy="uniform-progress", forecaster="persistence")
    started = OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW)
    run = drive_slower(started, gcp_market, TrueThroughput(SLOWER), resume_stamps=False)
    log = run.decision_log()
    assert log[1]["throughput"] == {"alpha": 1.0, "beta": 0.0}  # slot 0 started the workers: not a measurement
    assert log[-1]["throughput"]["alpha"] == pytest.approx(SLOWER)


@pytest.mark.parametrize("factor", [SLOWER, 1.0])
def test_an_online_run_reports_the_throughput_it_ran_at(gcp_market, factor):
    job = make_job(work=60.0, deadline_hours=24.0, max_instances=4, value=400.0, reconfig_overhead_hours=0.25)
    started = OnlineRun.start(RunConfig("run-ran", job, gcp_market.pools, policy="uniform-progress"), gcp_market.prefix(HISTORY + 1), NOW)
    assert started.realised_throughput() == TrueThroughput()  # nothing measured yet: the declaration
    run = drive_slower(started, gcp_market, TrueThroughput(factor))
    assert run.realised_throughput().factor == pytest.approx(factor)  # the mean, not the planning estimate's bound


def test_a_selector_run_that_ran_slow_learns_from_replays_at_its_measured_throughput(gcp_market):
    job = make_job(work=60.0, deadline_hours=24.0, max_instances=4, value=400.0, reconfig_overhead_hours=0.25)
    config = RunConfig("sel-slow", job, gcp_market.pools, policy="selector", policy_params={"warm_up_rounds": 0})
    run = drive_slower(OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW), gcp_market, TrueThroughput(SLOWER))
    losses = close_round(None, run)["last_round"]["losses"]
    selector = SelectorPolicy.from_state(run.selector_start)
    played = run.member["label"]
    replayed = selector.counterfactual_utilities(job, run.realised_market(), run.realised_throughput())
    expected = shortfall_losses({**replayed, played: run.result()["utility"]}, on_demand_cost(job, gcp_market.on_demand_price))
    assert losses == pytest.approx(expected)
    at_declared = selector.counterfactual_utilities(job, run.realised_market())
    assert any(at_declared[label] != replayed[label] for label in replayed if label != played)


def late_up_run(gcp_market: SlotMarket, deadline_hours: float) -> OnlineRun:
    """UP on 60 units on 4 instances at 1/1.3 of the declared speed, resumed from JSON every
    slot: it misses the soft deadline ``deadline_hours``, not the hard one, and costs and ends
    as the simulator's run does."""
    job = make_job(work=60.0, deadline_hours=deadline_hours, max_instances=4, value=400.0, reconfig_overhead_hours=0.25)
    truth = TrueThroughput(SLOWER)
    config = RunConfig("run-late", job, gcp_market.pools, policy="uniform-progress")
    run = drive_slower(OnlineRun.start(config, gcp_market.prefix(HISTORY + 1), NOW), gcp_market, truth)
    reference = simulate(make_policy("uniform-progress", {}), job, JobMarket(gcp_market, HISTORY), truth)
    assert reference.outcome.soft_miss and not reference.outcome.hard_miss
    assert run.result()["cost"] == pytest.approx(reference.outcome.cost, rel=1e-9)
    assert run.result()["completion_hours"] == pytest.approx(reference.outcome.completion_hours)
    return run


def test_an_online_run_past_its_soft_deadline_finishes_on_spot_as_the_simulator_does(gcp_market):
    # the job takes 19.5 h against d = 16 h: lost from the first measured slot. The late safety
    # net keeps it on spot, where it ran N_max on-demand to the end before
    run = late_up_run(gcp_market, deadline_hours=16.0)
    assert all(entry["allocation"]["on_demand"] == 0 for entry in run.decision_log())


def test_an_online_run_on_demand_and_late_even_as_declared_moves_to_spot_as_the_simulator_does(gcp_market):
    # as declared the job takes 15.25 h (the start included), all of d = 15.25 h: UP runs
    # on-demand from slot 0. At the true speed even the declared one would end after d + delta
    # from slot 2 on: on-demand is then a running allocation like any other, and spot at a fifth
    # of its price saves more than the restart costs. It ran on-demand to the end before
    run = late_up_run(gcp_market, deadline_hours=15.25)
    on_demand = [entry["allocation"]["on_demand"] for entry in run.decision_log()]
    assert on_demand[:2] == [4, 4] and not any(on_demand[2:])
    assert run.result()["cost"] < on_demand_cost(run.config.job, gcp_market.on_demand_price) / 2


def test_an_online_state_from_before_the_estimate_still_loads(gcp_market):
    run = OnlineRun.start(RunConfig("run-old", make_job(), gcp_market.pools), gcp_market.prefix(HISTORY + 1), NOW)
    run.decide(0.0, NOW)
    state = json.loads(json.dumps(run.to_state()))
    del state["records"][0]["throughput"]
    restored = OnlineRun.from_state(state)
    assert restored.records[0].throughput is None
    restored.next_slot(gcp_market.spot_price[HISTORY + 1], gcp_market.available[HISTORY + 1])
    restored.decide(1.0, NOW + timedelta(hours=1))  # the old slot replays on the declared throughput
    assert restored.records[1].throughput is not None


def lagging_reports(gcp_market: SlotMarket, stamp: Callable[[datetime], object] | None) -> list[float]:
    """The estimate's factor at each decision of a job on one on-demand instance that runs at
    exactly its declared rate and checkpoints every 0.45 h: each decision reads the work of its
    last checkpoint, in a report stamped ``stamp(when it was written)`` (no stamp: ``None``)."""
    job = make_job(work=30.0, deadline_hours=60.0, max_instances=1, value=100.0, reconfig_overhead_hours=0.25)
    run = OnlineRun.start(RunConfig("run-lag", job, gcp_market.pools, policy="on-demand"), gcp_market.prefix(HISTORY + 1), NOW)
    factors = []
    for slot in range(10):
        trained = max(slot - job.reconfig_overhead_hours, 0.0)  # the first slot started the worker
        saved = int(trained / 0.45) * 0.45  # hours of training in the last checkpoint
        written = NOW + timedelta(hours=job.reconfig_overhead_hours + saved)
        training = None if stamp is None else {"updated": stamp(written)}
        record = run.decide(saved * job.rate(1), NOW + timedelta(hours=slot), training=training)
        factors.append(record.throughput["alpha"] / job.throughput.alpha)
        run.applied(Allocation(tuple(record.allocation["spot"].get(p, 0) for p in run.config.pools), record.allocation["on_demand"]))
        row = HISTORY + run.slot
        run.observe(gcp_market.spot_price[row + 1], gcp_market.available[row + 1])
    return factors


def test_progress_reports_are_timed_by_their_own_stamps(gcp_market):
    """A report is as old as its checkpoint, up to a checkpoint interval before the decision that
    reads it. Timed by the decisions, the slots of a job running at its declared rate read 0.9,
    1.35, 0.9, ... and the estimate's lower bound falls well below the truth; timed by the reports'
    own stamps every slot measures the declared rate."""
    assert min(lagging_reports(gcp_market, None)) < 0.85
    assert lagging_reports(gcp_market, lambda at: at.isoformat().replace("+00:00", "Z")) == pytest.approx([1.0] * 10)


@pytest.mark.parametrize("stamp", ["yesterday", "", 1767225600, None], ids=["words", "empty", "number", "null"])
def test_a_report_stamp_that_is_no_time_is_timed_by_the_decisions(gcp_market, stamp):
    """A user's runtime may write anything in ``updated``: the run goes on as if it wrote none."""
    assert lagging_reports(gcp_market, lambda at: stamp) == lagging_reports(gcp_market, None)


def test_a_report_stamped_after_the_decision_that_read_it_is_timed_by_the_decisions(gcp_market):
    """An instance whose clock runs an hour ahead of the scheduler's stamps reports from the future:
    its stamps are not trusted, and the slots are timed as without them."""
    ahead = lagging_reports(gcp_market, lambda at: (at + timedelta(hours=1)).isoformat())
    assert ahead == lagging_reports(gcp_market, None)


def test_slots_decided_back_to_back_after_a_gap_are_no_measurement(gcp_market):
    """A retry that re-attaches after the task was down for two slots decides them at once: the
    second slot then spans a millisecond and the few samples reported in it, read as a rate,
    sent the estimate's spread, and so its lower bound, to the floor and the job to on-demand
    on a calm market (the fault suite's worker-kill test, under load). Such a slot says nothing."""
    job = make_job(work=30.0, deadline_hours=60.0, max_instances=1, value=100.0, reconfig_overhead_hours=0.25)
    run = OnlineRun.start(RunConfig("run-gap", job, gcp_market.pools, policy="on-demand"), gcp_market.prefix(HISTORY + 1), NOW)
    rate = job.rate(1)
    decided = [NOW, NOW + timedelta(hours=1), NOW + timedelta(hours=3), NOW + timedelta(hours=3, milliseconds=1)]
    work = [0.0, 0.75 * rate, 2.75 * rate, 2.75 * rate + 0.05]
    factors = []
    for at, done in zip(decided, work):
        record = run.decide(done, at)
        factors.append(record.throughput["alpha"] / job.throughput.alpha)
        run.applied(Allocation(tuple(record.allocation["spot"].get(p, 0) for p in run.config.pools), record.allocation["on_demand"]))
        row = HISTORY + run.slot
        run.observe(gcp_market.spot_price[row + 1], gcp_market.available[row + 1])
    assert factors == pytest.approx([1.0] * 4)
