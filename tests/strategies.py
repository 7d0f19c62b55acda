"""Hypothesis strategies: random spot markets and the feasible jobs that run on them.

Kept small (1-4 pools, at most 4 instances available per pool, a handful of slots) so that a
property runs dozens of whole simulations in seconds, yet wide enough to hit the corners: pools
priced above on-demand, outages, N_min > 1, negative throughput offsets, gamma = 1, jobs that
only just fit their deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import Job, Throughput
from airflow_provider_spotsched.scheduling.replay import JobMarket
from tests.markets import make_market

MAX_AVAILABLE = 4


@dataclass(frozen=True)
class Scenario:
    """A feasible job and the market it runs on (``history`` slots of it before submission)."""

    job: Job
    market: SlotMarket
    history: int

    @property
    def job_market(self) -> JobMarket:
        return JobMarket(self.market, self.history)


@st.composite
def feasible_jobs(draw: st.DrawFn) -> Job:
    """A job that N_max on-demand instances finish by its soft deadline (the spec's feasibility)."""
    slot_hours = draw(st.sampled_from([0.5, 1.0]))
    n_min = draw(st.integers(1, 3))
    n_max = draw(st.integers(n_min, 5))
    alpha = draw(st.floats(0.5, 2.0))
    beta = alpha * draw(st.floats(-0.5, 1.0))  # H(N_min) >= alpha / 2 > 0
    overhead = slot_hours * draw(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9]))
    deadline = slot_hours * draw(st.floats(1.0, 10.0))  # > overhead, which is below one slot
    share = draw(st.floats(0.05, 1.0))  # of what N_max on-demand can do by the deadline
    throughput = Throughput(alpha, beta)
    return Job(
        work=share * (deadline - overhead) * throughput(n_max),
        deadline_hours=deadline,
        max_instances=n_max,
        min_instances=n_min,
        throughput=throughput,
        value=draw(st.floats(0.0, 200.0)),
        hard_deadline_factor=draw(st.sampled_from([1.0, 1.25, 1.5, 2.0])),
        reconfig_overhead_hours=overhead,
        slot_hours=slot_hours,
    )


@st.composite
def markets(draw: st.DrawFn, num_slots: int, num_pools: int, slot_hours: float = 1.0) -> SlotMarket:
    """Prices from 10% to 130% of on-demand, counts 0..4, and an outage (all zero) per pool."""
    on_demand = draw(st.floats(1.0, 4.0))
    shares = draw(hnp.arrays(float, (num_slots, num_pools), elements=st.floats(0.1, 1.3)))
    available = draw(hnp.arrays(np.int64, (num_slots, num_pools), elements=st.integers(0, MAX_AVAILABLE)))
    for m in range(num_pools):
        start = draw(st.integers(0, num_slots))
        available[start : start + draw(st.integers(0, num_slots)), m] = 0
    return make_market(shares * on_demand, available, on_demand, slot_hours)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """A feasible job on a random market long enough for its hard deadline, with some history."""
    job = draw(feasible_jobs())
    history = draw(st.integers(0, 3))
    market = draw(markets(history + job.horizon_slots, draw(st.integers(1, 4)), job.slot_hours))
    return Scenario(job, market, history)


@st.composite
def shared_prefix(draw: st.DrawFn) -> tuple[Scenario, Scenario, int]:
    """Two scenarios of one job whose markets agree on their first rows and may differ after.

    Returns both and the number of job slots (after the history) that the markets share.
    """
    first = draw(scenarios())
    market = first.market
    shared = draw(st.integers(1, first.job.horizon_slots))
    rows = first.history + shared
    other = draw(markets(market.num_slots, market.num_pools, market.slot_hours))
    spot_price = np.concatenate([market.spot_price[:rows], other.spot_price[rows:]])
    available = np.concatenate([market.available[:rows], other.available[rows:]])
    second = make_market(spot_price, available, market.on_demand_price, market.slot_hours)
    return first, Scenario(first.job, second, first.history), shared
