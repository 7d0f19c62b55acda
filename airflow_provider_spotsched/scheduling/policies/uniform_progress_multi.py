"""UP(S) and UP(AP): SkyNomad's multi-region Uniform Progress baselines, on this project's model.

SkyNomad (arXiv 2601.06520; artifact github.com/andylizf/skynomad-artifact, Apache-2.0) compares
against Uniform Progress extended to several regions. Both variants here follow the artifact's
``sky_spot/strategies/multi_region_rc_cr_threshold.py`` decision (this is our own code, written
from reading it), on one instance, as the artifact runs them:

1. The line: the job is *behind* when its work done is below L*t/d now, and *2-delta ahead*
   when it is above L*(t + 2*delta)/d.
2. On on-demand, stay there until the job is 2-delta ahead (hysteresis); then leave it for
   spot, or pause if no spot can be had.
3. Otherwise run spot when a pool offers it (the running spot instance is kept while still
   offered); with no spot, run on-demand when behind, else pause.
4. The project's safety net (:class:`SafetyNetPolicy`) switches to on-demand for good once the
   slack runs out, as the artifact's environment does with its own latched safety net.

They differ in which pool a fresh spot launch takes:

- ``up-s`` (the artifact's ``multi_region_rc_cr_threshold_eager_failover``): cheapest pool
  first, but the pools in the cloud region of the last pool the job ran spot on go last
  (SkyPilot's EAGER_NEXT_REGION: a region that just preempted us tends to do it again). As in
  the artifact, a pool is that last pool once its instance was still running at the start of a
  slot; one preempted after a single slot leaves the one before it in place.
- ``up-ap`` (``multi_region_probe_cost_ratio``): the pool with the highest probe success rate
  per dollar, rate / spot price, the rate over every sample since submission (0.5 before
  any). The samples are the artifact's: each launch attempt, in rank order; every 60 minutes
  (its default interval), a probe of each pool but the one running, which in this model is
  reading the pool's available count, and a heartbeat success for the running pool; a failure
  when that pool preempts. A running spot instance
  moves only when its pool scores under 0.9 of the best pool's score.

Mapping onto this model: the artifact's on-demand instance lives in a region; here on-demand
is one pool-less price, so the region the job last ran in is that of its last spot pool; and
spot priced above on-demand is never taken (the artifact would). Both are the project's rules.
Observing availability costs nothing here, whereas the artifact bills UP(AP)'s probes.
The artifact schedules a single instance; so do these, refusing ``max_instances > 1``.
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from airflow_provider_spotsched.market.slots import cloud_region
from airflow_provider_spotsched.scheduling.model import WORK_EPSILON, Allocation, Job, JobError
from airflow_provider_spotsched.scheduling.policies.safety_net import SafetyNetPolicy
from airflow_provider_spotsched.scheduling.policy import Observation

PROBE_INTERVAL_HOURS = 1.0
"""UP(AP) samples each pool once this often (the artifact's default 60 minutes)."""

SWITCH_RATIO = 0.9
"""UP(AP) moves a running spot instance only when its pool scores under this share of the best."""


def require_single_instance(job: Job, policy: str) -> None:
    """Refuse a job of more than one instance: the SkyNomad artifact's policies run one."""
    if job.max_instances != 1:
        raise JobError(
            f"max_instances={job.max_instances}: policy {policy!r} runs a single instance, as in the SkyNomad "
            "artifact it is ported from; set max_instances=1, or use a multi-instance policy such as "
            "uniform-progress or chc"
        )


def single_spot(pool: int, num_pools: int) -> Allocation:
    spot = [0] * num_pools
    spot[pool] = 1
    return Allocation(tuple(spot), 0)


def running_pool(allocation: Allocation) -> int | None:
    """The pool of a one-instance spot allocation, None for on-demand or idle."""
    pools = [m for m, s in enumerate(allocation.spot) if s]
    return pools[0] if pools else None


class MultiRegionUniformProgress(SafetyNetPolicy):
    """The artifact's multi-region Uniform Progress on one instance; subclasses pick the pool."""

    single_instance = True

    def reset(self, job: Job) -> None:
        super().reset(job)
        require_single_instance(job, self.name)

    def choose(self, observation: Observation) -> Allocation:
        job, previous = observation.job, observation.previous
        num_pools = observation.past.num_pools
        t, done, rate = observation.hours, observation.work_done, job.work / job.deadline_hours
        behind = done < rate * t - WORK_EPSILON
        ahead_2d = done > rate * (t + 2 * job.reconfig_overhead_hours) + WORK_EPSILON
        on_demand = Allocation((0,) * num_pools, 1)
        if previous.on_demand and not ahead_2d:
            return previous
        pool = self.spot_pool(observation)
        if pool is not None:
            return single_spot(pool, num_pools)
        if behind:
            return on_demand
        return Allocation.idle(num_pools)

    def offered(self, observation: Observation) -> list[int]:
        """Pools offering an instance now at no more than the on-demand price."""
        price, available = observation.spot_price, observation.available
        return [m for m in range(len(available)) if available[m] >= 1 and price[m] <= observation.on_demand_price]

    @abstractmethod
    def spot_pool(self, observation: Observation) -> int | None:
        """The pool to run spot in this slot (None: no spot to be had)."""


class UPSPolicy(MultiRegionUniformProgress):
    """UP(S): cheapest spot first, the last region the job ran in last (eager failover)."""

    name = "up-s"

    def __init__(self) -> None:
        super().__init__()
        self._last_pool: int | None = None

    def reset(self, job: Job) -> None:
        super().reset(job)
        self._last_pool = None

    def spot_pool(self, observation: Observation) -> int | None:
        offered = self.offered(observation)
        current = running_pool(observation.previous)
        if current is not None and observation.available[current] >= 1:
            self._last_pool = current  # as the artifact: a pool counts once it was still running at a slot's start
        if current in offered:
            return current
        if not offered:
            return None
        pools, price = observation.past.pools, observation.spot_price
        avoided = cloud_region(pools[self._last_pool]) if self._last_pool is not None else None
        return min(offered, key=lambda m: (cloud_region(pools[m]) == avoided, price[m], m))


class UPAPPolicy(MultiRegionUniformProgress):
    """UP(AP): spot in the pool with the best probe success rate per dollar seen so far."""

    name = "up-ap"

    def __init__(self) -> None:
        super().__init__()
        self._successes: list[int] = []
        self._probes: list[int] = []
        self._next: list[int] = []  # the slot from which a pool is due a sample again
        self._main: int | None = None
        self._interval = 1

    def reset(self, job: Job) -> None:
        super().reset(job)
        self._successes, self._probes, self._next, self._main = [], [], [], None
        self._interval = max(1, round(PROBE_INTERVAL_HOURS / job.slot_hours))

    def _record(self, pool: int, success: bool) -> None:
        self._probes[pool] += 1
        self._successes[pool] += int(success)

    def choose(self, observation: Observation) -> Allocation:
        if not self._probes:
            self._successes = [0] * observation.past.num_pools
            self._probes = [0] * observation.past.num_pools
            self._next = [0] * observation.past.num_pools
        if self._main is not None:
            if running_pool(observation.previous) == self._main and observation.available[self._main] >= 1:
                if observation.slot >= self._next[self._main]:
                    self._record(self._main, True)  # the running instance's heartbeat
                    self._next[self._main] = observation.slot + self._interval
            else:
                self._record(self._main, False)  # preempted (or left): a failed sample
                self._main = None
        return super().choose(observation)

    def scores(self, observation: Observation) -> np.ndarray:
        """Each pool's probe success rate (0.5 before any probe) per USD of spot now."""
        probes = np.asarray(self._probes, dtype=float)
        rate = np.where(probes > 0, np.asarray(self._successes) / np.where(probes > 0, probes, 1.0), 0.5)
        price = np.asarray(observation.spot_price, dtype=float)
        return np.where(price > 0, rate / np.where(price > 0, price, 1.0), np.where(rate > 0, np.inf, 0.0))

    def spot_pool(self, observation: Observation) -> int | None:
        offered = set(self.offered(observation))
        score = self.scores(observation)
        ranked = sorted(range(len(score)), key=lambda m: (-score[m], m))
        current = running_pool(observation.previous)
        choice = None
        if current in offered and (current == ranked[0] or score[current] >= SWITCH_RATIO * score[ranked[0]]):
            choice = current
        else:
            for pool in ranked:  # launch attempts, each a probe sample
                self._record(pool, pool in offered)
                if pool in offered:
                    choice = pool
                    self._next[pool] = observation.slot + self._interval
                    break
        self._main = choice
        for pool in range(len(score)):  # the background probes of every other pool that is due one
            if pool != choice and observation.slot >= self._next[pool]:
                self._record(pool, observation.available[pool] >= 1)
                self._next[pool] = observation.slot + self._interval
        return choice
