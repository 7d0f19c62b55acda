"""The safety net the online baselines share (Can't Be Late's Safety Net Rule).

A policy's own choice stands while it is deadline-safe; after the first choice that is not, the
job runs N_max on-demand instances until completion. Once on that fallback, switching back to
spot would cost a reconfiguration the remaining slack can no longer pay for. Only a job that not
even the fallback can finish by its soft deadline any more (a throughput that proved lower than
declared), and that is not on the fallback yet or would be late even at its declared throughput,
may run N_max instances with spot first instead, up to its hard deadline
(:func:`~airflow_provider_spotsched.scheduling.rules.late_allocation`).
"""

from __future__ import annotations

from abc import abstractmethod

from airflow_provider_spotsched.scheduling.model import Allocation, Job
from airflow_provider_spotsched.scheduling.policy import Observation, Policy
from airflow_provider_spotsched.scheduling.rules import is_deadline_safe, safety_net_allocation


class SafetyNetPolicy(Policy):
    """Runs :meth:`choose` while it is deadline-safe, then the safety net (N_max on-demand) for good."""

    def __init__(self) -> None:
        self._on_safety_net = False

    def reset(self, job: Job) -> None:
        self._on_safety_net = False

    def decide(self, observation: Observation) -> Allocation:
        job = observation.job
        if not self._on_safety_net:
            choice = self.choose(observation)
            if is_deadline_safe(job, observation, choice, margin_hours=self.reserve_hours(job)):
                return choice
            self._on_safety_net = True
        return safety_net_allocation(observation)

    @abstractmethod
    def choose(self, observation: Observation) -> Allocation:
        """The policy's own allocation for this slot, before the safety net."""

    def reserve_hours(self, job: Job) -> float:
        """Slack kept in reserve beyond what the fallback needs (none by default)."""
        return 0.0
