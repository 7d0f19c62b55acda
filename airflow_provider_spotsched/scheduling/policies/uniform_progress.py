"""Uniform Progress: Can't Be Late's (NSDI '24) policy, on this project's model.

The expected progress line is ep(t) = L * t / d: the job should have done that much work by hour
t. Rules, each slot, with cp the work done so far:

1. Taking risks: run on spot whenever it is available, cheapest pools first, up to N_max
   instances (keeping the instances already running while no more can be had), even when
   behind the line.
2. Uniform progress: when the spot instances alone would leave the job below the line at the
   slot's end, add just enough on-demand instances to reach it (N_max at most).
3. Hysteresis: when the job is on on-demand, keep the same allocation while cp < ep(t + 2*delta)
   and it still keeps pace with the line, so that the on-demand run banks enough progress to
   pay for the reconfigurations of the next switch instead of flapping every slot.
4. Safety net: as soon as the choice would leave too little slack for N_max on-demand instances
   to finish by the soft deadline, switch to N_max on-demand and stay there until completion
   (spot first once not even that can meet the soft deadline: :mod:`.safety_net`).

Pausing (the idle state) happens when there is no spot to use and the job is on or above the line.
"""

from __future__ import annotations

from airflow_provider_spotsched.scheduling.model import WORK_EPSILON, Allocation, Job
from airflow_provider_spotsched.scheduling.policies.safety_net import SafetyNetPolicy
from airflow_provider_spotsched.scheduling.policy import Observation
from airflow_provider_spotsched.scheduling.rules import (
    fits,
    slot_progress,
    spot_fill,
    spot_only,
)


def expected_progress(job: Job, hours: float) -> float:
    """The line ep(t) = L * t / d, which reaches the whole work at the soft deadline."""
    return job.work * min(hours / job.deadline_hours, 1.0)


def catch_up(observation: Observation, spot: Allocation, target: float) -> Allocation:
    """``spot`` plus the fewest on-demand instances that bring the work done up to ``target``."""
    job = observation.job
    needed = min(target, job.work) - observation.work_done
    if needed <= WORK_EPSILON:
        return spot_only(spot, job)
    for on_demand in range(max(job.min_instances - spot.total, 0), job.max_instances - spot.total + 1):
        choice = Allocation(spot.spot, on_demand)
        if slot_progress(job, choice, observation.previous) >= needed - WORK_EPSILON:
            return choice
    return Allocation(spot.spot, job.max_instances - spot.total)


class UniformProgressPolicy(SafetyNetPolicy):
    """Spot whenever available; just enough on-demand to stay on the line L*t/d."""

    name = "uniform-progress"

    def choose(self, observation: Observation) -> Allocation:
        job, previous = observation.job, observation.previous
        slot_end = expected_progress(job, observation.hours + job.slot_hours)
        hysteresis = expected_progress(job, observation.hours + 2 * job.reconfig_overhead_hours)
        if (
            previous.on_demand
            and observation.work_done < hysteresis
            and fits(previous, observation.available)
            and observation.work_done + slot_progress(job, previous, previous) >= slot_end - WORK_EPSILON
        ):
            return previous
        return catch_up(observation, spot_fill(observation), slot_end)
