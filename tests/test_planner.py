"""The exact window planner: hand-computed cases and a brute-force cross-check on tiny windows."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from airflow_provider_spotsched.scheduling import planner
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Progress, Throughput, advance, evaluate
from airflow_provider_spotsched.scheduling.planner import CostLimit, Plan, PlanError, PlanRequest, solve_plan
from airflow_provider_spotsched.scheduling.policy import Observation
from airflow_provider_spotsched.scheduling.rules import is_deadline_safe
from tests.markets import make_job


def request(job: Job, price, available, on_demand: float = 3.0, **fields) -> PlanRequest:
    pools = len(price[0])
    fields.setdefault("start_hours", 0.0)
    fields.setdefault("work_done", 0.0)
    fields.setdefault("previous", Allocation.idle(pools))
    return PlanRequest(
        job=job,
        spot_price=np.asarray(price, dtype=float),
        available=np.asarray(available, dtype=float),
        on_demand_price=on_demand,
        **fields,
    )


def allocations(plan: Plan) -> list[tuple[tuple[int, ...], int]]:
    return [(a.spot, a.on_demand) for a in plan.allocations]


def window_objective(req: PlanRequest, plan_allocations) -> float:
    """The spec's accounting of a window's allocations from the request's state (model.advance)."""
    job = req.job
    progress = Progress(slot=round(req.start_hours / job.slot_hours), work_done=req.work_done, previous=req.previous)
    for t, allocation in enumerate(plan_allocations):
        advance(job, progress, allocation, req.spot_price[t], req.on_demand_price)
        if progress.done:
            return progress.cost - job.value_at(progress.completion_hours)
    return progress.cost + (req.terminal_cost_per_work or 0.0) * (job.work - progress.work_done)


# --- hand-computed cases -------------------------------------------------------------------


def test_overhead_and_partial_billing_of_the_completion_slot():
    # 2 spot at $1: slot 0 loses 0.5 h to the restart (1 unit), slots 1-3 do 2 each (7), slot 4
    # needs 1 more unit: 0.5 h, so T = 4.5 and the bill is 2 x $1 x 4.5 h = $9; V = 30.
    job = make_job(reconfig_overhead_hours=0.5)
    plan = solve_plan(request(job, [[1.0]] * 6, [[2]] * 6))
    assert allocations(plan) == [((2,), 0)] * 5
    assert plan.completion_hours == pytest.approx(4.5)
    assert plan.objective == pytest.approx(9.0 - 30.0)
    assert plan.proven_optimal


def test_continuing_previous_pays_no_overhead():
    # From hour 2 with 4 units done: keeping the 2 running spot instances finishes in 2 full
    # slots ($4, T = 4); the same start from idle pays the restart (T = 4.5, $5).
    job = make_job(reconfig_overhead_hours=0.5)
    running = Allocation((2,), 0)
    kept = solve_plan(request(job, [[1.0]] * 4, [[2]] * 4, start_hours=2.0, work_done=4.0, previous=running))
    assert allocations(kept) == [((2,), 0)] * 2
    assert (kept.objective, kept.completion_hours) == (pytest.approx(4.0 - 30.0), pytest.approx(4.0))
    fresh = solve_plan(request(job, [[1.0]] * 4, [[2]] * 4, start_hours=2.0, work_done=4.0))
    assert (fresh.objective, fresh.completion_hours) == (pytest.approx(5.0 - 30.0), pytest.approx(4.5))


def test_a_restart_the_window_puts_later_waits_for_it():
    # One instance runs in pool 0, which the window says is gone from slot 1; pool 1, at the same
    # price, stays. Moving now and moving at slot 1 cost the same (one restart, the same bill),
    # and the plan moved now. With the tie-break it keeps pool 0 in slot 0: if the forecast of
    # the drop is wrong, the restart is never made.
    job = make_job(work=3.0, deadline_hours=6.0, max_instances=1, reconfig_overhead_hours=0.5)
    running = Allocation((1, 0), 0)
    base = request(job, [[1.0, 1.0]] * 5, [[1, 1]] + [[0, 1]] * 4, start_hours=1.0, work_done=1.0, previous=running)
    plain = solve_plan(base)
    assert allocations(plain)[0] == ((0, 1), 0)
    kept = solve_plan(replace(base, keep_preference=0.01))
    assert allocations(kept)[:2] == [((1, 0), 0), ((0, 1), 0)]
    assert kept.objective == pytest.approx(plain.objective)
    assert window_objective(base, kept.allocations) == pytest.approx(window_objective(base, plain.allocations))


def test_the_keep_preference_never_outweighs_a_real_saving():
    # Pool 1 is 10% cheaper from slot 0: moving now saves 0.05 USD, more than the tie-break.
    job = make_job(work=3.0, deadline_hours=6.0, max_instances=1, reconfig_overhead_hours=0.5)
    running = Allocation((1, 0), 0)
    base = request(job, [[1.0, 0.9]] * 5, [[1, 1]] + [[0, 1]] * 4, start_hours=1.0, work_done=1.0, previous=running)
    plan = solve_plan(replace(base, keep_preference=0.01))
    assert allocations(plan)[0] == ((0, 1), 0)
    assert plan.objective == pytest.approx(solve_plan(base).objective + 0.01)


def test_the_keep_preference_applies_only_where_the_running_allocation_fits_now():
    # Pool 0 is gone already: every plan restarts now, and none pays the tie-break.
    job = make_job(work=3.0, deadline_hours=6.0, max_instances=1, reconfig_overhead_hours=0.5)
    base = request(job, [[1.0, 1.0]] * 5, [[0, 1]] * 5, start_hours=1.0, work_done=1.0, previous=Allocation((1, 0), 0))
    assert solve_plan(replace(base, keep_preference=0.01)).objective == pytest.approx(solve_plan(base).objective)


def test_waiting_for_cheap_spot_past_the_deadline_when_the_value_decays_slowly():
    # d = 4, hard deadline 8. On-demand now ($10): T = 4, utility 30 - 80. Spot from slot 2
    # ($1): T = 6, V = 30 x (8 - 6) / 4 = 15, utility 15 - 8 = 7, the best of all mixes.
    job = make_job(deadline_hours=4.0, hard_deadline_factor=2.0)
    plan = solve_plan(request(job, [[1.0]] * 8, [[0]] * 2 + [[2]] * 6, on_demand=10.0))
    assert allocations(plan) == [((0,), 0)] * 2 + [((2,), 0)] * 4
    assert plan.completion_hours == pytest.approx(6.0)
    assert plan.objective == pytest.approx(-7.0)


def test_pausing_beats_on_demand_while_spot_is_out():
    job = make_job(work=6.0, deadline_hours=5.0)
    plan = solve_plan(request(job, [[1.0]] * 5, [[2], [0], [2], [2], [2]]))
    assert allocations(plan) == [((2,), 0), ((0,), 0), ((2,), 0), ((2,), 0)]
    assert plan.objective == pytest.approx(6.0 - 30.0)


def test_terminal_cost_defers_work_dearer_than_it():
    # Window of 2 slots, work left costs $2/unit after it: slot 0 on $1 spot (2 units), skip the
    # $5 slot: 2 + 6 x 2 = 14 (running both: 12 + 8 = 20; nothing: 16).
    job = make_job()
    plan = solve_plan(request(job, [[1.0], [5.0]], [[2], [2]], on_demand=10.0, terminal_cost_per_work=2.0))
    assert allocations(plan) == [((2,), 0), ((0,), 0)]
    assert plan.completion_hours is None
    assert plan.objective == pytest.approx(14.0)


def test_deadline_safe_end_keeps_the_rest_finishable_on_on_demand():
    # d = 4.5: after the window (hour 2) N_max on-demand finishes at most 2 x 2.5 = 5 units.
    # Unconstrained, the $1 slot alone is best (2 + 6 x 1 = 8, leaving 6 units); safe, the
    # cheapest plan adds one $5 instance in slot 1 (2 + 5 + 5 x 1 = 12, leaving exactly 5).
    job = make_job(deadline_hours=4.5, hard_deadline_factor=2.0)
    base = request(job, [[1.0], [5.0]], [[2], [2]], on_demand=10.0, terminal_cost_per_work=1.0)
    assert solve_plan(base).objective == pytest.approx(8.0)
    safe = solve_plan(replace(base, deadline_safe_end=True))
    assert allocations(safe) == [((2,), 0), ((1,), 0)]
    assert safe.objective == pytest.approx(12.0)


def test_unsafe_state_is_refused_with_a_clear_error():
    job = make_job(deadline_hours=4.5)
    late = request(job, [[1.0]] * 2, [[2]] * 2, start_hours=3.0, terminal_cost_per_work=1.0, deadline_safe_end=True)
    with pytest.raises(PlanError, match="soft deadline"):
        solve_plan(late)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"start_hours": 0.5}, "start_hours"),
        ({"work_done": 8.0}, "work_done"),
        ({"terminal_cost_per_work": -1.0}, "terminal_cost_per_work"),
        ({"keep_preference": -0.1}, "keep_preference"),
        ({"keep_preference": float("nan")}, "keep_preference"),
        ({"previous": Allocation((0, 0), 0)}, "previous has 2 pools"),
    ],
)
def test_invalid_requests_name_the_field(fields, message):
    with pytest.raises(PlanError, match=message):
        request(make_job(), [[1.0]] * 3, [[2]] * 3, **fields)


def test_whole_job_objective_is_minus_the_utility_on_a_random_market():
    rng = np.random.default_rng(3)
    job = make_job(work=20.0, deadline_hours=14.0, max_instances=3, reconfig_overhead_hours=0.25, value=60.0)
    price = rng.uniform(0.5, 3.5, (job.horizon_slots, 3))
    available = rng.integers(0, 4, (job.horizon_slots, 3))
    plan = solve_plan(request(job, price, available))
    outcome = evaluate(job, plan.allocations, price, 3.0, available)
    assert plan.objective == pytest.approx(-outcome.utility, abs=1e-6)
    assert plan.completion_hours == pytest.approx(outcome.completion_hours)


def test_work_that_fills_the_slots_left_exactly_is_not_pruned_by_round_off():
    # 5.381... units at 0.3587.../instance-hour: 5 slots at 3 instances, up to a last bit of
    # round-off, which the bound priced at inf (no slot left) and pruned the optimum (utility 4.80, not 21.70)
    job = Job(work=5.381127255620694, deadline_hours=5.0, max_instances=3, min_instances=2,
              throughput=Throughput(0.3587418170413796, 0.0), value=43.65189316845691, hard_deadline_factor=1.0)
    price = np.array([[0.95, 3.17], [0.8, 1.53], [2.71, 1.43], [0.46, 0.81], [1.77, 1.05]])
    available = np.array([[3, 2], [0, 0], [1, 2], [3, 2], [0, 3]])
    plan = solve_plan(request(job, price, available))
    assert plan.proven_optimal and plan.objective == pytest.approx(-21.7019, abs=1e-3)  # the MILP's optimum
    outcome = evaluate(job, plan.allocations, price, 3.0, available)
    assert plan.objective == pytest.approx(-outcome.utility, abs=1e-6)


def test_a_truncated_search_returns_a_valid_plan_not_proven_optimal(monkeypatch):
    rng = np.random.default_rng(3)
    job = make_job(work=20.0, deadline_hours=14.0, max_instances=3, reconfig_overhead_hours=0.25, value=60.0)
    price = rng.uniform(0.5, 3.5, (job.horizon_slots, 3))
    available = rng.integers(0, 4, (job.horizon_slots, 3))
    exact = solve_plan(request(job, price, available))
    monkeypatch.setattr(planner, "LABEL_LIMIT", 2)
    monkeypatch.setattr(planner, "BEAM_WIDTH", 1)
    truncated = solve_plan(request(job, price, available))
    assert not truncated.proven_optimal
    assert truncated.objective >= exact.objective - 1e-9
    outcome = evaluate(job, truncated.allocations, price, 3.0, available)
    assert truncated.objective == pytest.approx(-outcome.utility, abs=1e-6)


# --- brute force -----------------------------------------------------------------------------


def choices(job: Job, available) -> list[Allocation]:
    """Every allocation the spec allows in a slot with these available counts."""
    found = [Allocation.idle(len(available))]
    for spot in itertools.product(*(range(int(a) + 1) for a in available)):
        for od in range(job.max_instances + 1):
            if job.min_instances <= sum(spot) + od <= job.max_instances:
                found.append(Allocation(spot, od))
    return found


def random_job(rng: np.random.Generator, **overrides) -> Job:
    rate = Throughput(float(rng.choice([1.0, 0.7])), float(rng.choice([0.0, 0.3])))
    work = float(rng.uniform(1.5, 6.0))
    delta = float(rng.choice([0.0, 0.25, 0.5]))
    fields = dict(
        work=work,
        deadline_hours=float(max(work / rate(2) + delta + 0.2, rng.uniform(2.0, 5.0))),
        max_instances=2,
        min_instances=int(rng.integers(1, 3)),
        throughput=rate,
        value=float(rng.uniform(5.0, 40.0)),
        hard_deadline_factor=float(rng.choice([1.0, 1.5])),
        reconfig_overhead_hours=delta,
    )
    fields.update(overrides)
    return Job(**fields)


@pytest.mark.parametrize("seed", range(12))
def test_whole_job_matches_every_enumerated_schedule(seed):
    """Every allocation sequence of a 4-slot job, each accounted by model.evaluate."""
    rng = np.random.default_rng(seed)
    job = random_job(rng, hard_deadline_factor=1.0, deadline_hours=4.0, work=float(rng.uniform(1.0, 6.0)))
    price = rng.uniform(0.3, 3.5, (4, 2))
    available = rng.integers(0, 3, (4, 2))
    best = max(
        evaluate(job, schedule, price, 3.0, available).utility
        for schedule in itertools.product(*(choices(job, row) for row in available))
    )
    plan = solve_plan(request(job, price, available))
    assert -plan.objective == pytest.approx(best, abs=1e-6)
    assert -evaluate(job, plan.allocations, price, 3.0, available).utility == pytest.approx(plan.objective, abs=1e-6)


def exhaustive(req: PlanRequest) -> float:
    """Best objective over every allocation sequence of the window, by model.advance.

    Sequences that reach the same (allocation, work done) after a slot have the same futures,
    so only the cheapest of them is extended: every sequence is still considered.
    """
    job, s = req.job, req.job.slot_hours
    first = round(req.start_hours / s)
    fallback = Allocation((0,) * len(req.previous.spot), job.max_instances)
    states = {(req.previous, round(req.work_done, 9)): Progress(first, req.work_done, 0.0, req.previous)}
    best = np.inf
    for t in range(len(req.spot_price)):
        following: dict = {}
        for state in states.values():
            for allocation in choices(job, np.floor(req.available[t])):
                observation = Observation(job, first + t, None, 0, state.work_done, state.cost, state.previous)
                if req.deadline_safe and not is_deadline_safe(job, observation, allocation):
                    continue
                progress = Progress(state.slot, state.work_done, state.cost, state.previous)
                advance(job, progress, allocation, req.spot_price[t], req.on_demand_price)
                if req.cost_limit is not None and not keeps_limit(req, t, progress, allocation == fallback):
                    continue
                if progress.done:
                    best = min(best, progress.cost - job.value_at(progress.completion_hours))
                    continue
                key = (allocation, round(progress.work_done, 9))
                if key not in following or progress.cost < following[key].cost:
                    following[key] = progress
        states = following
    end_hours = req.start_hours + len(req.spot_price) * s
    for (last, _), progress in states.items():
        left = job.work - progress.work_done
        if req.deadline_safe_end or req.deadline_safe:
            overhead = 0.0 if last == fallback else job.reconfig_overhead_hours
            if (job.deadline_hours - end_hours - overhead) * job.rate(job.max_instances) < left - 1e-9:
                continue
        best = min(best, progress.cost + (req.terminal_cost_per_work or 0.0) * left)
    return best


def matches_exhaustive(req: PlanRequest) -> Plan | None:
    """The planner's plan, with the exhaustive search's best objective and re-accounted by
    model.advance; None where no schedule is feasible, after checking the planner refuses it."""
    best = exhaustive(req)
    if best == np.inf:
        with pytest.raises(PlanError):
            solve_plan(req)
        return None
    plan = solve_plan(req)
    assert plan.objective == pytest.approx(best, abs=1e-6)
    assert window_objective(req, plan.allocations) == pytest.approx(plan.objective, abs=1e-6)
    return plan


def keeps_limit(req: PlanRequest, t: int, progress: Progress, on_fallback: bool) -> bool:
    """The cost limit after window slot t, as the guard states it: cost so far plus the catch-up
    price of the work by which the job trails the shadow within the cap, and a job trailing a
    shadow at work with the handover margin of slack (the fallback itself pays no overhead)."""
    limit, job = req.cost_limit, req.job
    assert limit is not None
    if progress.done:
        return progress.cost <= limit.cost_cap[t] + 1e-9
    gap = max(limit.shadow_work[t] - progress.work_done, 0.0)
    if progress.cost + limit.catch_up_price * gap > limit.cost_cap[t] + 1e-9:
        return False
    if gap <= 1e-9 or not limit.shadow_at_work[t]:
        return True
    overhead = 0.0 if on_fallback else job.reconfig_overhead_hours
    hours_left = job.deadline_hours - (req.start_hours + (t + 1) * job.slot_hours) - overhead - limit.handover_margin
    return hours_left * job.rate(job.max_instances) >= job.work - progress.work_done - 1e-9


def random_limit(rng: np.random.Generator, job: Job, width: int, work_done: float) -> CostLimit:
    """A cost cap that grows by a random bill each slot, and a shadow that does random work."""
    shadow = np.minimum(work_done + np.cumsum(rng.uniform(0.0, job.rate(2) * job.slot_hours, width)), job.work)
    return CostLimit(
        cost_cap=np.cumsum(rng.uniform(1.5, 9.0, width)),
        shadow_work=shadow,
        shadow_at_work=shadow < job.work,
        catch_up_price=float(rng.uniform(0.3, 2.0)),
        handover_margin=float(rng.choice([0.0, 0.5, 1.0])),
    )


def random_window(rng: np.random.Generator) -> tuple[Job, int, np.ndarray, np.ndarray, float]:
    """A random job and a window of 3-5 slots over two pools: the job, the width, prices,
    available counts, and the start (0 or 1 h)."""
    job = random_job(rng)
    width = int(rng.integers(3, 6))
    price = rng.uniform(0.3, 3.5, (width, 2))
    available = rng.integers(0, 3, (width, 2)).astype(float)
    return job, width, price, available, float(rng.integers(0, 2))


@pytest.mark.parametrize("seed", range(36))
def test_windows_match_an_exhaustive_search(seed):
    """Random windows: offsets, previous allocations, terminal prices, safe ends and safe slots."""
    rng = np.random.default_rng(100 + seed)
    job, width, price, available, start = random_window(rng)
    previous = Allocation.idle(2)
    if start and rng.random() < 0.7:
        previous = choices(job, [2, 2])[int(rng.integers(1, len(choices(job, [2, 2]))))]
    terminal = None if rng.random() < 0.4 else float(rng.uniform(0.5, 4.0))
    req = request(
        job,
        price,
        available,
        start_hours=start,
        work_done=0.0 if not start else float(rng.uniform(0.0, job.work / 2)),
        previous=previous,
        terminal_cost_per_work=terminal,
        deadline_safe_end=bool(terminal is not None and rng.random() < 0.4),
        deadline_safe=bool(rng.random() < 0.4),
    )
    plan = matches_exhaustive(req)
    if plan is None:
        return
    progress = Progress(round(start), req.work_done, 0.0, previous)
    for t, allocation in enumerate(plan.allocations):
        allocation.check(job, np.floor(available[t]))
        if req.deadline_safe:
            now = Observation(job, progress.slot, None, 0, progress.work_done, 0.0, progress.previous)
            assert is_deadline_safe(job, now, allocation)
        advance(job, progress, allocation, price[t], 3.0)


@pytest.mark.parametrize("seed", range(36))
def test_cost_limited_windows_match_an_exhaustive_search(seed):
    """Random windows planned within a random cost limit: the best schedule that keeps the limit
    after every slot, or a PlanError where none does."""
    rng = np.random.default_rng(500 + seed)
    job, width, price, available, start = random_window(rng)
    work_done = 0.0 if not start else float(rng.uniform(0.0, job.work / 2))
    previous = choices(job, [2, 2])[int(rng.integers(0, len(choices(job, [2, 2]))))] if start else Allocation.idle(2)
    terminal = None if rng.random() < 0.4 else float(rng.uniform(0.5, 4.0))
    req = request(
        job,
        price,
        available,
        start_hours=start,
        work_done=work_done,
        previous=previous,
        terminal_cost_per_work=terminal,
        deadline_safe_end=terminal is not None,
        deadline_safe=bool(rng.random() < 0.5),
        cost_limit=random_limit(rng, job, width, work_done),
    )
    plan = matches_exhaustive(req)
    if plan is None:
        return
    fallback = Allocation((0, 0), job.max_instances)
    progress = Progress(round(start), req.work_done, 0.0, previous)
    for t, allocation in enumerate(plan.allocations):
        advance(job, progress, allocation, price[t], 3.0)
        assert keeps_limit(req, t, progress, allocation == fallback)


def test_a_cost_limit_that_every_plan_breaks_is_refused():
    job = make_job(work=4.0, deadline_hours=4.0, max_instances=2)
    limit = CostLimit(np.zeros(3), np.full(3, 1.0), np.ones(3, dtype=bool), catch_up_price=3.0)
    with pytest.raises(PlanError):
        solve_plan(request(job, [[1.0]] * 3, [[2]] * 3, cost_limit=limit))


@pytest.mark.parametrize(
    "limit, message",
    [
        (CostLimit(np.zeros(2), np.zeros(2), np.ones(2, dtype=bool), 1.0), "cost_limit covers 2 slots"),
        (dict(cost_cap=np.zeros(3), shadow_work=np.zeros(2), shadow_at_work=np.ones(3, dtype=bool), catch_up_price=1.0), "must all be"),
        (dict(cost_cap=np.full(3, np.nan), shadow_work=np.zeros(3), shadow_at_work=np.ones(3, dtype=bool), catch_up_price=1.0), "finite"),
        (dict(cost_cap=np.zeros(3), shadow_work=np.zeros(3), shadow_at_work=np.ones(3, dtype=bool), catch_up_price=-1.0), "catch_up_price"),
    ],
)
def test_a_bad_cost_limit_names_the_field(limit, message):
    job = make_job(work=4.0, deadline_hours=4.0, max_instances=2)
    with pytest.raises(PlanError, match=message):
        cost_limit = limit if isinstance(limit, CostLimit) else CostLimit(**limit)
        request(job, [[1.0]] * 3, [[2]] * 3, cost_limit=cost_limit)
