"""The hindsight optimum: the spec's reference point that no online policy can beat.

It is handed the job's realised market before slot 0 (``uses_future``), solves the whole
horizon up to the hard deadline once with the exact planner, and replays that plan (idle after
completion). It is a yardstick for reports, never a real scheduler.
"""

from __future__ import annotations

from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import Allocation, Job
from airflow_provider_spotsched.scheduling.planner import Plan, PlanRequest, solve_plan
from airflow_provider_spotsched.scheduling.policy import Observation, Policy


class OptimalPolicy(Policy):
    """Replays the exact plan of the whole horizon computed from the realised market."""

    name = "optimal"
    uses_future = True
    hindsight = True

    def __init__(self) -> None:
        self._market: SlotMarket | None = None
        self.plan: Plan | None = None

    def reset(self, job: Job) -> None:
        self._market = None
        self.plan = None

    def reveal(self, market: SlotMarket) -> None:
        """The realised market of the job's slots (slot 0 = submission)."""
        self._market = market
        self.plan = None

    def decide(self, observation: Observation) -> Allocation:
        if self.plan is None:
            self.plan = self._solve(observation.job)
        if observation.slot < len(self.plan.allocations):
            return self.plan.allocations[observation.slot]
        return Allocation.idle(observation.past.num_pools)

    def _solve(self, job: Job) -> Plan:
        market = self._market
        if market is None:
            raise ValueError("the optimal policy needs the realised market; call reveal(market) before the first slot")
        if market.num_slots < job.horizon_slots:
            raise ValueError(
                f"the revealed market has {market.num_slots} slots, the job's horizon needs {job.horizon_slots}; "
                "reveal the job's whole market up to its hard deadline"
            )
        return solve_plan(horizon_request(job, market))


def horizon_request(job: Job, market: SlotMarket) -> PlanRequest:
    """The whole job as one planning problem: from submission, idle, to the hard deadline, on
    ``market`` (slot 0 = submission)."""
    slots = market.window(0, job.horizon_slots)
    return PlanRequest(
        job=job,
        start_hours=0.0,
        work_done=0.0,
        previous=Allocation.idle(market.num_pools),
        spot_price=slots.spot_price,
        available=slots.available,
        on_demand_price=market.on_demand_price,
    )
