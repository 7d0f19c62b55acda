"""Greedy: Can't Be Late's (NSDI '24) greedy baseline, on this project's model.

Rule: run on spot whenever it is available, in the cheapest pools first, up to N_max instances
(keeping the instances already running while no more can be had: the Exploitation Rule), and
pause while fewer than N_min spot instances are on offer. As soon as running that for one more
slot would leave too little slack for N_max on-demand instances to finish by the soft deadline
(the Safety Net Rule, :func:`~airflow_provider_spotsched.scheduling.rules.is_deadline_safe`),
switch to N_max on-demand instances and stay there until the job completes (spot first once
not even that can meet the soft deadline: :mod:`.safety_net`).

Spot pools priced above on-demand are never used: they cost more for the same progress.
"""

from __future__ import annotations

from airflow_provider_spotsched.scheduling.model import Allocation
from airflow_provider_spotsched.scheduling.policies.safety_net import SafetyNetPolicy
from airflow_provider_spotsched.scheduling.policy import Observation
from airflow_provider_spotsched.scheduling.rules import spot_fill, spot_only


class GreedyPolicy(SafetyNetPolicy):
    """Spot while the slack lasts, then N_max on-demand for good."""

    name = "greedy"

    def choose(self, observation: Observation) -> Allocation:
        return spot_only(spot_fill(observation), observation.job)
