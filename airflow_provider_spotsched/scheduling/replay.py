"""Replay a policy on a market, slot by slot, with the spec's accounting.

The simulator is where the "no peeking" rule is enforced: at slot t a policy receives the market
up to and including slot t and nothing later. The only exception is a policy that declares
``uses_future = True`` (the hindsight optimum, a reference point and never a real scheduler); it
is handed the realised market of the whole job before the first slot.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow_provider_spotsched.market.slots import SlotMarket, resample
from airflow_provider_spotsched.market.trace import Trace, TraceError, format_timestamp
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Outcome, Progress, advance, outcome
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.throughput_estimate import ThroughputEstimate
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput

DEFAULT_LOOKBACK_HOURS = 7 * 24.0


class PolicyError(RuntimeError):
    """A policy returned an allocation that breaks the spec's constraints."""


@dataclass(frozen=True)
class JobMarket:
    """The market a job runs on: history before submission, then the job's own slots."""

    market: SlotMarket
    offset: int

    @property
    def job_slots(self) -> SlotMarket:
        return self.market.window(self.offset)


def job_market(
    trace: Trace,
    job: Job,
    pools: Sequence[str] | None = None,
    lookback_hours: float = DEFAULT_LOOKBACK_HOURS,
) -> JobMarket:
    """Resample ``trace`` for ``job``: up to ``lookback_hours`` of history, then its horizon."""
    start = job.start or datetime.fromtimestamp(trace.first_time, timezone.utc)
    earliest = datetime.fromtimestamp(trace.first_time, timezone.utc)
    offset = max(0, int((start - earliest).total_seconds() / 3600.0 // job.slot_hours))
    offset = min(offset, int(lookback_hours // job.slot_hours))
    first = start - timedelta(hours=offset * job.slot_hours)
    needed = offset + job.horizon_slots
    try:
        market = resample(trace, first, job.slot_hours, needed, pools)
    except TraceError as exc:
        raise TraceError(
            f"the job starting {format_timestamp(start)} needs {job.horizon_slots} slots up to its hard deadline: {exc}"
        ) from None
    # the job pays the on-demand price in force at its submission, not at its history's start
    at_submission = resample(trace, start, job.slot_hours, 1, pools).on_demand_price
    return JobMarket(replace(market, on_demand_price=at_submission), offset)


@dataclass
class SimulationResult:
    """A policy's run on one job: the allocations, the accounting and the decision times."""

    policy: str
    job: Job
    pools: tuple[str, ...]
    allocations: list[Allocation]
    outcome: Outcome
    decision_seconds: list[float] = field(default_factory=list)
    true_throughput: TrueThroughput | None = None

    def to_dict(self) -> dict[str, Any]:
        """The spec's simulation-result JSON object, plus the true throughput when it was not the
        declared one (the numbers follow from the slots, the trace, the job and it)."""
        slots = [
            {
                "slot": t,
                "spot": {pool: n for pool, n in zip(self.pools, a.spot) if n},
                "on_demand": a.on_demand,
            }
            for t, a in enumerate(self.allocations)
        ]
        truth = {} if self.true_throughput is None or self.true_throughput.is_declared else {
            "true_throughput": asdict(self.true_throughput)
        }
        return {"policy": self.policy, "job": self.job.to_dict(), **truth, "slots": slots, **self.outcome.to_dict()}


def simulate(
    policy: Policy,
    job: Job,
    job_market: JobMarket,
    true_throughput: TrueThroughput | None = None,
    estimate_throughput: bool = True,
) -> SimulationResult:
    """Run ``policy`` on ``job`` until completion or the hard deadline's slot.

    The work done follows ``true_throughput`` (default: the declared one). An online policy sees
    the job with its throughput estimated from the work measured so far
    (:class:`~airflow_provider_spotsched.scheduling.throughput_estimate.ThroughputEstimate`), or
    the declared one with ``estimate_throughput=False`` (the behaviour before the estimate). A
    ``hindsight`` policy (the optimum) plans on the true throughput (its slowest, under a slowdown).
    """
    market, offset = job_market.market, job_market.offset
    if market.num_slots < offset + job.horizon_slots:
        raise TraceError(f"the market has {market.num_slots - offset} slots after submission; the job needs {job.horizon_slots}")
    truth = true_throughput or TrueThroughput()
    hindsight = truth.slowest_job(job) if policy.hindsight else None
    estimate = ThroughputEstimate(job.throughput) if estimate_throughput and hindsight is None else None
    policy.reset(hindsight or job)
    if policy.uses_future:
        policy.reveal(job_market.job_slots)
    progress = Progress()
    allocations: list[Allocation] = []
    results = []
    timings: list[float] = []
    idle = Allocation.idle(market.num_pools)
    for t in range(job.horizon_slots):
        row = offset + t
        observation = Observation(
            job=hindsight or (estimate.job(job) if estimate is not None else job),
            slot=t,
            past=market.prefix(row + 1),
            past_offset=offset,
            work_done=progress.work_done,
            cost_so_far=progress.cost,
            previous=progress.previous or idle,
            declared_throughput=job.throughput if estimate is not None else None,
        )
        began = time.perf_counter()
        allocation = policy.decide(observation)
        timings.append(time.perf_counter() - began)
        try:
            allocation.check(job, market.available[row])
        except ValueError as exc:
            raise PolicyError(f"policy {policy.label} at slot {t}: {exc}") from None
        allocations.append(allocation)
        real = truth.job_at(job, t * job.slot_hours)
        result = advance(real, progress, allocation, market.spot_price[row], market.on_demand_price)
        results.append(result)
        if progress.done:
            break
        if estimate is not None and result.effective_hours >= job.slot_hours / 2:
            # a slot that (re)started workers is measured from when they resumed computing, as an
            # online run measures it by the runtime's resume stamp (online.py)
            estimate.observe(allocation.total, result.effective_hours, result.progress)
    return SimulationResult(policy.label, job, market.pools, allocations, outcome(job, progress, results), timings, truth)
