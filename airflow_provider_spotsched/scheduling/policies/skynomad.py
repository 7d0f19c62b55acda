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
one price (it runs "in" the region the job last ran in, where the artifact's migration penalty
is 0). ``observe`` says how pools' runs are learnt: ``every-pool`` (the default) reads every
pool's offer each slot, which this model gives for free; ``launches-and-probes`` learns, as the
artifact does by default, only from the job's own spot runs (a preemption ends one as a
failure, the job leaving it as censored) and from one probe of each other pool every
``probe_interval_slots`` until one finds an instance, whose virtual run then lasts until the
job launches there (the artifact bills these probes; this model does not). The artifact
schedules one instance; so does this port, refusing ``max_instances > 1``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from airflow_provider_spotsched.scheduling.model import Allocation, Job, as_number
from airflow_provider_spotsched.scheduling.policies.safety_net import SafetyNetPolicy
from airflow_provider_spotsched.scheduling.policies.spot_lifetime import PoolLifetime
from airflow_provider_spotsched.scheduling.policies.uniform_progress_multi import (
    require_single_instance,
    running_pool,
    single_spot,
)
from airflow_provider_spotsched.scheduling.policy import Observation

EVERY_POOL = "every-pool"
LAUNCHES_AND_PROBES = "launches-and-probes"
OBSERVATIONS = (EVERY_POOL, LAUNCHES_AND_PROBES)
"""How the policy learns pools' runs: from every pool's offer each slot (free in this model), or
only from its own launches and a probe of each pool until one succeeds (the artifact's default)."""

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
        observe: str = EVERY_POOL,
        probe_interval_slots: int = 6,
    ) -> None:
        super().__init__()
        if observe not in OBSERVATIONS:
            raise ValueError(f"observe={observe!r}: choose {' or '.join(map(repr, OBSERVATIONS))}")
        if isinstance(probe_interval_slots, bool) or not isinstance(probe_interval_slots, int) or probe_interval_slots < 1:
            raise ValueError(f"probe_interval_slots={probe_interval_slots!r}: give a whole number of slots >= 1 (the artifact's is 6)")
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
        self.observe = observe
        self.probe_interval_slots = probe_interval_slots
        self._pools: list[PoolLifetime] = []
        self._done: list[float] = []  # work done at the start of each slot seen
        self._clear_runs()

    def _clear_runs(self) -> None:
        """The regions the job ran in, and (observing by launches and probes) its probes."""
        self._last_region: int | None = None  # the artifact's origin of a migration
        self._od_region: int | None = None
        self._active: int | None = None  # the pool of the job's own open spot run
        self._left_by_us = False
        self._probing: set[int] = set()
        self._blocked: set[int] = set()  # pools whose launch failed this slot: not probed
        self._next_probe: list[int] = []

    @classmethod
    def _default(cls, field: str) -> Any:
        return inspect.signature(cls.__init__).parameters[field].default

    def params(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in (
                "max_prediction_hours",
                "progress_window_hours",
                "availability_window_hours",
                "voi_delta_base",
                "voi_k_v",
                "observe",
                "probe_interval_slots",
            )
            if getattr(self, k) != self._default(k)
        }

    def reset(self, job: Job) -> None:
        super().reset(job)
        require_single_instance(job, self.name)
        self._pools = []
        self._done = []
        self._clear_runs()

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
        region = current if current is not None else self._od_region if previous.on_demand else None
        if region is not None:
            self._last_region = region
        origin = region if region is not None else self._last_region
        choice, primary = (previous, region) if running else (Allocation.idle(num_pools), None)
        for net, option in sorted(options, key=lambda o: -o[0]):
            if net <= current_value:
                break
            if option is None:  # pausing never stops what runs
                self._last_region = primary = None
                break
            if option == previous:
                continue
            pool = running_pool(option)
            if pool is None:  # on-demand, in the region the job last ran in (no migration penalty there)
                self._od_region = self._last_region = primary = origin if origin is not None else 0
                self._left_by_us = current is not None
                choice = option
                break
            if self._launch(observation, pool):
                self._last_region = primary = pool
                choice = option
                break
        self._probe(observation, primary)
        return choice

    def _observe(self, observation: Observation) -> None:
        """Feed the pools' lifetimes what this slot shows, and note the work done now.

        Every pool: each pool's offer, every slot not seen yet. Launches and probes (the
        artifact's default): the end of the job's own spot run, if it was preempted or left.
        """
        market, offset, slot = observation.past, observation.past_offset, observation.slot
        if not self._pools:
            every = self.observe == EVERY_POOL
            self._pools = [PoolLifetime(observation.job.slot_hours, every) for _ in range(market.num_pools)]
            self._next_probe = [0] * market.num_pools
        if self.observe == EVERY_POOL:
            for seen in range(len(self._done), slot + 1):
                for lifetime, count in zip(self._pools, market.available[offset + seen]):
                    lifetime.observe(seen, bool(count >= 1))
        else:
            active, previous = self._active, observation.previous
            if active is not None and not (running_pool(previous) == active and observation.available[active] >= 1):
                self._pools[active].finish(slot, failed=not self._left_by_us)
                self._active, self._left_by_us = None, False
            for lifetime in self._pools:
                lifetime.update(slot)
        self._done += [observation.work_done] * (slot + 1 - len(self._done))

    def _launch(self, observation: Observation, pool: int) -> bool:
        """Try spot in ``pool``: whether it is on offer; the artifact's mode records the attempt."""
        offered = bool(observation.available[pool] >= 1)
        if self.observe == EVERY_POOL:
            return offered
        slot, lifetime = observation.slot, self._pools[pool]
        if pool in self._probing:  # the probe's virtual run gives way to the real one
            lifetime.finish(slot, failed=False)
            self._probing.discard(pool)
        if offered:
            lifetime.begin(slot)
            self._active, self._left_by_us = pool, False
            self._blocked.discard(pool)
        else:
            lifetime.attempt_failed()
            self._blocked.add(pool)
        return offered

    def _probe(self, observation: Observation, primary: int | None) -> None:
        """The artifact's probes: each pool once, every ``probe_interval_slots`` until one succeeds."""
        if self.observe == EVERY_POOL:
            return
        slot = observation.slot
        for pool, lifetime in enumerate(self._pools):
            if pool == primary or pool in self._probing or pool in self._blocked or slot < self._next_probe[pool]:
                continue
            if observation.available[pool] >= 1:
                lifetime.begin(slot)
                self._probing.add(pool)
            else:
                lifetime.attempt_failed()
            self._next_probe[pool] = slot + self.probe_interval_slots
        self._blocked.clear()

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
        """Share of the recent window (within the job) covered by ``pool``'s observed runs."""
        hours, slot = observation.hours, observation.slot
        if hours <= 0:
            return 0.0
        first = max(0, slot - math.floor(self.availability_window_hours / observation.job.slot_hours + 1e-9))
        return min(1.0, self._pools[pool].offered_hours(first, slot) / min(self.availability_window_hours, hours))

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
