"""SkyNomad: multi-region spot scheduling by the value of progress, on this project's model.

SkyNomad (Li et al., "SkyNomad: On Using Multi-Region Spot Instances to Minimize AI Batch Job
Cost", arXiv 2601.06520) is the strongest published peer. This is our own implementation of its
policy as its artifact runs it (github.com/andylizf/skynomad-artifact, Apache-2.0: the strategy
``unified_cost_model_risk`` in ``sky_spot/strategies/unified_cost_model.py``), on one instance.
Each slot:

1. Value of progress V (USD per hour of work): 1.2 x a reference cost per hour of the remaining
   work, priced as a plan that puts a share of it on on-demand (the share follows from where
   the job's recent progress rate, over ``progress_window_hours``, would meet the deadline
   less 2*delta) and fills the rest with spot, cheapest per useful hour first, each pool
   contributing its availability over the last ``availability_window_hours`` x the time left
   x (E - delta) / E, and on-demand for any shortfall.
2. Each pool's expected lifetime E (:mod:`.spot_lifetime`: Nelson-Aalen with burst scaling),
   capped at ``max_prediction_hours`` and at the time left to the deadline.
3. Options, each with a net value per hour: spot in pool m, (V * (E - delta) - p_m * E) / E
   (no delta for the pool already running); on-demand, V - p_od; pausing, 0. Moving away from
   a running instance must beat it by ``voi_delta_base + voi_k_v * V`` (the artifact's
   value-of-information gate). The best option that beats the current one and can be had now
   is taken; a running instance is never stopped for pausing.
4. The project's safety net (:class:`SafetyNetPolicy`) goes on-demand for good once the slack
   runs out, as the artifact's environment does with its latched safety net.

Mapping onto this model: the artifact's checkpoint transfer (egress, migration downtime) is
not part of this model, which is the artifact with ``checkpoint_size_gb = 0``; on-demand has
one price, so it has no region to migrate to. Every pool's availability is seen each slot (see
:mod:`.spot_lifetime`); the artifact observes regions through its launches and probes. The
artifact schedules one instance; so does this port, refusing ``max_instances > 1``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np

from airflow_provider_spotsched.scheduling.model import Allocation, Job, as_number
from airflow_provider_spotsched.scheduling.policies.safety_net import SafetyNetPolicy
from airflow_provider_spotsched.scheduling.policies.spot_lifetime import PoolLifetime
from airflow_provider_spotsched.scheduling.policies.uniform_progress_multi import (
    require_single_instance,
    running_pool,
    single_spot,
)
from airflow_provider_spotsched.scheduling.policy import Observation

VALUE_MARKUP = 1.2
"""V is the reference cost of the remaining work times this (the artifact's constant)."""


class SkyNomadPolicy(SafetyNetPolicy):
    """Runs the option with the highest net value of progress, learning pools' lifetimes."""

    name = "skynomad"
    single_instance = True

    def __init__(
        self,
        max_prediction_hours: float = 2.0,
        progress_window_hours: float = 10.0,
        availability_window_hours: float = 12.0,
        voi_delta_base: float = 0.5,
        voi_k_v: float = 0.05,
    ) -> None:
        super().__init__()
        for field, value in (
            ("max_prediction_hours", max_prediction_hours),
            ("progress_window_hours", progress_window_hours),
            ("availability_window_hours", availability_window_hours),
        ):
            if as_number(field, value) <= 0:
                raise ValueError(f"{field}={value!r}: must be > 0 hours; the artifact's default is {self._default(field)}")
        for field, value in (("voi_delta_base", voi_delta_base), ("voi_k_v", voi_k_v)):
            if as_number(field, value) < 0:
                raise ValueError(f"{field}={value!r}: a switching margin must be >= 0 (0 switches on any gain)")
        self.max_prediction_hours = float(max_prediction_hours)
        self.progress_window_hours = float(progress_window_hours)
        self.availability_window_hours = float(availability_window_hours)
        self.voi_delta_base = float(voi_delta_base)
        self.voi_k_v = float(voi_k_v)
        self._pools: list[PoolLifetime] = []
        self._done: list[float] = []  # work done at the start of each slot seen

    @classmethod
    def _default(cls, field: str) -> Any:
        return inspect.signature(cls.__init__).parameters[field].default

    def params(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in ("max_prediction_hours", "progress_window_hours", "availability_window_hours", "voi_delta_base", "voi_k_v")
            if getattr(self, k) != self._default(k)
        }

    def reset(self, job: Job) -> None:
        super().reset(job)
        require_single_instance(job, self.name)
        self._pools = []
        self._done = []

    def choose(self, observation: Observation) -> Allocation:
        self._observe(observation)
        job, previous = observation.job, observation.previous
        num_pools = observation.past.num_pools
        on_demand = Allocation((0,) * num_pools, 1)
        left = job.deadline_hours - observation.hours
        if left <= 0:
            return on_demand
        value = self.progress_value(observation)
        available = observation.available
        current = running_pool(previous)
        if current is not None and available[current] < 1:
            current = None  # preempted
        running = current is not None or previous.on_demand
        if current is not None:
            current_value = self.spot_value(observation, current, value, restart=False)
        else:
            current_value = value - observation.on_demand_price if previous.on_demand else 0.0
        gate = current_value + self.voi_delta_base + self.voi_k_v * value
        options: list[tuple[float, Allocation | None]] = [(0.0, None)]
        for m in range(num_pools):
            net = self.spot_value(observation, m, value, restart=m != current)
            if net >= 0 and not (running and m != current and net <= gate):
                options.append((net, single_spot(m, num_pools)))
        od_net = value - observation.on_demand_price
        if od_net >= 0 and not previous.on_demand and not (running and od_net <= gate):
            options.append((od_net, on_demand))
        for net, choice in sorted(options, key=lambda o: -o[0]):
            if net <= current_value:
                break
            if choice is None:
                break  # pausing never stops what runs
            if choice == previous:
                continue
            pool = running_pool(choice)
            if pool is None or available[pool] >= 1:  # spot not on offer: the launch fails, try the next
                return choice
        return previous if running else Allocation.idle(num_pools)

    def _observe(self, observation: Observation) -> None:
        """Feed the pools' lifetimes every slot not seen yet, and note the work done now."""
        market, offset = observation.past, observation.past_offset
        if not self._pools:
            self._pools = [PoolLifetime(observation.job.slot_hours) for _ in range(market.num_pools)]
        for slot in range(len(self._done), observation.slot + 1):
            row = market.available[offset + slot]
            for pool, lifetime in zip(self._pools, row):
                pool.observe(bool(lifetime >= 1))
            self._done.append(observation.work_done)

    def expected_hours(self, observation: Observation, pool: int) -> float:
        """E: the pool's expected remaining lifetime, capped by the horizon and the deadline."""
        left = observation.job.deadline_hours - observation.hours
        return min(self._pools[pool].expected_hours(), self.max_prediction_hours, left)

    def spot_value(self, observation: Observation, pool: int, value: float, restart: bool) -> float:
        """Net value per hour of spot in ``pool``: useful hours at V, less the price of all hours."""
        expected = self.expected_hours(observation, pool)
        useful = expected - (observation.job.reconfig_overhead_hours if restart else 0.0)
        if useful <= 0:
            return -math.inf
        return (value * useful - observation.spot_price[pool] * expected) / expected

    def availability(self, observation: Observation, pool: int) -> float:
        """Share of the recent window (within the job) in which ``pool`` offered an instance."""
        slot_hours = observation.job.slot_hours
        if observation.hours <= 0:
            return 0.0
        first = max(0, observation.slot - math.floor(self.availability_window_hours / slot_hours + 1e-9))
        rows = observation.past.available[observation.past_offset + first : observation.past_offset + observation.slot, pool]
        offered = float(np.count_nonzero(np.asarray(rows) >= 1)) * slot_hours
        return min(1.0, offered / min(self.availability_window_hours, observation.hours))

    def recent_rate(self, observation: Observation) -> float:
        """Hours of work done per hour over the last ``progress_window_hours`` (0 to 1)."""
        job, t = observation.job, observation.hours
        rate = job.rate(1)
        if t < 1 / 6:
            return observation.work_done / rate / t if t > 0 else 0.0
        start = max(0.0, t - self.progress_window_hours)
        first = int(start / job.slot_hours)
        work = (observation.work_done - self._done[first]) / rate
        return max(0.0, min(1.0, work / (t - start)))

    def on_demand_share(self, observation: Observation) -> float:
        """Share of the remaining work the reference plan puts on on-demand (0 to 1).

        The recent progress line from now meets the line that finishes on time with 2*delta to
        spare at x; the later x falls, the less on-demand the plan needs.
        """
        job, t = observation.job, observation.hours
        total, deadline = job.work / job.rate(1), job.deadline_hours
        done = observation.work_done / job.rate(1)
        if t <= 0:
            return 0.0
        if abs(done - t) < 1e-9:
            return 0.5
        rate = self.recent_rate(observation)
        if abs(rate - 1.0) < 1e-6:
            return 0.0
        x = (rate * t - done + (total + 2 * job.reconfig_overhead_hours - deadline)) / (rate - 1.0)
        if x >= deadline:
            return 0.0
        if x <= 0:
            return 1.0
        return max(0.0, min(1.0, (deadline - x) / (deadline - t)))

    def progress_value(self, observation: Observation) -> float:
        """V: VALUE_MARKUP x the reference cost per hour of the remaining work."""
        job = observation.job
        remaining = observation.remaining_work / job.rate(1)
        if remaining <= 0:
            return 0.0
        left = job.deadline_hours - observation.hours
        delta, od_price = job.reconfig_overhead_hours, observation.on_demand_price
        offers = []
        for m in range(observation.past.num_pools):
            expected = self.expected_hours(observation, m)
            useful_share = (expected - delta) / expected if expected > delta else 0.0
            hours = self.availability(observation, m) * left * useful_share
            if hours > 0:
                offers.append((observation.spot_price[m] * expected / max(expected - delta, 1e-6), hours))
        on_demand = self.on_demand_share(observation) * remaining
        cost, spot_target, spot_hours = on_demand * od_price, remaining - on_demand, 0.0
        for unit_price, hours in sorted(offers, key=lambda o: o[0]):
            if spot_hours >= spot_target:
                break
            take = min(hours, spot_target - spot_hours)
            cost += take * unit_price
            spot_hours += take
        cost += max(spot_target - spot_hours, 0.0) * od_price
        return VALUE_MARKUP * cost / max(remaining, 1e-6)
