"""The integer program: exact against enumeration on tiny windows, and against the planner on GCP."""

from __future__ import annotations

import itertools

import numpy as np
import pulp
import pytest

from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.scheduling.ip import build_model, reduce_pools, solve_milp
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Progress, Throughput, advance, evaluate
from airflow_provider_spotsched.scheduling.planner import PlanError, PlanRequest, solve_plan

ON_DEMAND = 3.0


def choices(job: Job, available) -> list[Allocation]:
    """Every allocation the spec allows in a slot with these spot counts."""
    out = []
    for spot in itertools.product(*(range(int(a) + 1) for a in available)):
        for od in range(job.max_instances + 1):
            n = sum(spot) + od
            if n == 0 or job.min_instances <= n <= job.max_instances:
                out.append(Allocation(spot, od))
    return out


def best_by_enumeration(job: Job, price: np.ndarray, available: np.ndarray) -> float:
    """The best utility over every allocation sequence, each accounted by model.evaluate.

    Sequences are cut at completion (evaluate ignores what follows), so each is counted once.
    """
    best = -np.inf

    def extend(sequence: list[Allocation], progress: Progress) -> None:
        nonlocal best
        if progress.done or len(sequence) == len(price):
            best = max(best, evaluate(job, sequence, price, ON_DEMAND, available).utility)
            return
        t = len(sequence)
        for allocation in choices(job, available[t]):
            after = Progress(progress.slot, progress.work_done, progress.cost, progress.previous)
            advance(job, after, allocation, price[t], ON_DEMAND)
            extend(sequence + [allocation], after)

    extend([], Progress())
    return best


def tiny_case(seed: int, overhead: float, gamma: float) -> tuple[Job, np.ndarray, np.ndarray]:
    """2 pools with 0..2 instances each, N_max 2, 4-5 slots; pool prices sometimes tied."""
    rng = np.random.default_rng([seed, int(10 * gamma), int(10 * overhead)])
    slots = int(rng.integers(4, 6))
    deadline = float(rng.integers(2, slots))
    price = rng.uniform(0.5, 4.0, (slots, 2)).round(2)
    if rng.random() < 0.3:
        price[:, 1] = price[:, 0]
    job = Job(
        work=float(rng.uniform(1.0, 2.8 * (deadline - overhead))),
        deadline_hours=deadline,
        max_instances=2,
        min_instances=int(rng.integers(1, 3)),
        throughput=Throughput(1.0, float(rng.choice([0.0, 0.5]))),
        value=float(rng.uniform(5.0, 40.0)),
        hard_deadline_factor=gamma,
        reconfig_overhead_hours=overhead,
    )
    return job, price, rng.integers(0, 3, (slots, 2))


@pytest.mark.parametrize("overhead", [0.0, 0.3])
@pytest.mark.parametrize("gamma", [1.0, 1.5])
@pytest.mark.parametrize("seed", [1, 2])
def test_optimum_equals_the_best_enumerated_schedule(seed, gamma, overhead):
    job, price, available = tiny_case(seed, overhead, gamma)
    request = PlanRequest(job, 0.0, 0.0, Allocation.idle(2), price, available, ON_DEMAND)
    model = build_model(request)
    plan = model.solve()
    best = best_by_enumeration(job, price, available)
    assert plan.proven_optimal
    assert -plan.objective == pytest.approx(best, abs=1e-6)
    outcome = evaluate(job, plan.allocations, price, ON_DEMAND, available)
    assert outcome.utility == pytest.approx(-plan.objective, abs=1e-6)
    # The program's own objective is the accounting too (up to the solver's feasibility tolerance).
    assert pulp.value(model.problem.objective) == pytest.approx(plan.objective, abs=1e-5)


def test_window_state_terminal_price_and_deadline_guards_agree_with_the_planner():
    """Mid-job windows (start, work done, a running previous vector) with every request option."""
    rng = np.random.default_rng(7)
    for _ in range(12):
        job, price, available = tiny_case(int(rng.integers(1 << 30)), float(rng.choice([0.0, 0.5])), 1.5)
        job_start = float(rng.integers(0, 2))
        previous = rng.choice(choices(job, [2, 2]))
        request = PlanRequest(
            job, job_start, float(rng.uniform(0, 0.5 * job.work)), previous, price[:4], available[:4], ON_DEMAND,
            terminal_cost_per_work=rng.choice([None, float(rng.uniform(0, 5))]),
            deadline_safe_end=bool(rng.random() < 0.5),
            deadline_safe=bool(rng.random() < 0.5),
        )
        try:
            expected = solve_plan(request).objective
        except PlanError:
            with pytest.raises(PlanError):
                solve_milp(request)
            continue
        assert solve_milp(request).objective == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "day, n_max, options",
    [(1, 4, {}), (2, 4, {"terminal_cost_per_work": 2.0, "deadline_safe": True}), (6, 8, {})],
)
def test_gcp_windows_agree_with_the_planner(gcp_trace, day, n_max, options):
    slots = resample(gcp_trace).window(day * 24, 24)
    job = Job(
        work=n_max * 10.0,
        deadline_hours=20.0,
        max_instances=n_max,
        min_instances=2,
        throughput=Throughput(1.0, 0.5),
        value=1.3 * n_max * 10.0 * slots.on_demand_price,
        hard_deadline_factor=1.5,
        reconfig_overhead_hours=0.25,
    )
    idle = Allocation.idle(slots.num_pools)
    request = PlanRequest(job, 0.0, 0.0, idle, slots.spot_price, slots.available, slots.on_demand_price, **options)
    reference = solve_plan(request)
    plan = solve_milp(request, time_limit=120)
    assert plan.proven_optimal
    assert plan.objective == pytest.approx(reference.objective, rel=1e-7, abs=1e-6)


def test_dominated_pools_are_ordered_or_dropped():
    price = np.array([[1.0, 1.0, 2.0, 5.0], [1.0, 1.0, 2.0, 4.0]])
    available = np.array([[2, 1, 2, 3], [2, 1, 1, 3]])
    job = Job(work=2.0, deadline_hours=2.0, max_instances=2, throughput=Throughput(1.0), value=10.0)
    idle = PlanRequest(job, 0.0, 0.0, Allocation.idle(4), price, available, on_demand_price=4.0)
    reduction = reduce_pools(idle)
    # Pool 3 is never cheaper than on-demand; pool 0 is as cheap and more available than 1 and 2.
    assert reduction.kept == (0, 1, 2)
    assert reduction.order == ((0, 1), (0, 2))
    # A running previous vector keeps what it uses and drops orders it breaks.
    running = PlanRequest(job, 0.0, 0.0, Allocation((0, 1, 0, 1), 0), price, available, on_demand_price=4.0)
    reduction = reduce_pools(running)
    assert reduction.kept == (0, 1, 2, 3)
    assert reduction.order == ((0, 2),)


def test_cbc_warm_starts_and_bad_input():
    job, price, available = tiny_case(3, 0.3, 1.5)
    request = PlanRequest(job, 0.0, 0.0, Allocation.idle(2), price, available, ON_DEMAND)
    highs = solve_milp(request, solver="highs")
    assert solve_milp(request, solver="cbc").objective == pytest.approx(highs.objective, abs=1e-6)
    for solver in ("highs", "cbc"):
        warm = solve_milp(request, solver=solver, warm_start=highs.allocations)
        assert warm.objective == pytest.approx(highs.objective, abs=1e-6)
    with pytest.raises(ValueError, match="solver must be one of"):
        solve_milp(request, solver="gurobi")
    idle = Allocation.idle(2)
    late = PlanRequest(job, job.deadline_hours, 0.0, idle, price, available, ON_DEMAND, deadline_safe=True)
    with pytest.raises(PlanError, match="already unsafe"):
        solve_milp(late)
