"""The one small interface every scheduling policy implements.

A policy decides the allocation of the current slot from what is known now: the job, the market
up to and including the current slot, and the job's progress so far. The simulator and the
Airflow operator both drive policies through :class:`Policy` alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

from airflow_provider_spotsched.forecast.base import Forecaster
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Throughput


@dataclass(frozen=True)
class Observation:
    """What a policy may know when it decides slot ``slot`` of ``job``.

    ``past`` is the market on the job's slot grid, ending with the current slot (its last row);
    it may begin before the job's submission (``past_offset`` slots earlier) so that forecasters
    and learners can use history. It never holds a slot after the current one.

    ``job`` carries the throughput to plan on: the estimate measured so far, where the simulator
    or an online run measures one. ``declared_throughput`` is then the one the user declared
    (``None``: the job's own is the declared one).
    """

    job: Job
    slot: int
    past: SlotMarket
    past_offset: int
    work_done: float
    cost_so_far: float
    previous: Allocation
    declared_throughput: Throughput | None = None

    @property
    def declared_job(self) -> Job:
        """The job at its declared throughput: the fastest its estimate, which never exceeds the
        declaration, may still turn out to be."""
        if self.declared_throughput is None:
            return self.job
        return replace(self.job, throughput=self.declared_throughput)

    @property
    def spot_price(self):
        return self.past.spot_price[-1]

    @property
    def available(self):
        return self.past.available[-1]

    @property
    def on_demand_price(self) -> float:
        return self.past.on_demand_price

    @property
    def hours(self) -> float:
        """Hours since submission at the start of this slot."""
        return self.slot * self.job.slot_hours

    @property
    def remaining_work(self) -> float:
        return max(self.job.work - self.work_done, 0.0)


class Policy(ABC):
    """Decides one slot's :class:`Allocation` from an :class:`Observation`.

    Subclasses set ``name`` and keep whatever per-job state they need, cleared by :meth:`reset`.
    A policy that plans on forecasts keeps its model in ``forecaster``, which a caller holding
    forecasts of its own (the step-by-step solver operator) may replace; ``None``: the policy plans
    without forecasts. A reference policy that needs the job's realised market (the hindsight
    optimum) sets ``uses_future`` and implements :meth:`reveal`; no online run accepts it. A
    ``hindsight`` one also knows the job's true throughput: the simulator shows it that instead
    of the declared one or its estimate (a perfect market forecast alone does not set it). A
    policy ported from single-instance work sets ``single_instance`` and refuses N_max > 1 in
    :meth:`reset`, so that callers (the evaluation) can run it on N_max = 1 jobs only.
    """

    name: str = "policy"
    forecaster: Forecaster | None = None
    uses_future: bool = False
    hindsight: bool = False
    single_instance: bool = False

    def reset(self, job: Job) -> None:  # noqa: B027 - optional hook
        """Forget any state from a previous job; called before the first slot."""

    def reveal(self, market: SlotMarket) -> None:
        """Take the job's realised market (slot 0 = submission) before the first slot.

        Called only when ``uses_future`` is set; a policy that plans on the past alone has no use
        for the future, so it refuses it.
        """
        raise NotImplementedError(f"policy {self.name!r} does not use the future; it takes no realised market")

    @abstractmethod
    def decide(self, observation: Observation) -> Allocation:
        """The allocation for the current slot; it must respect the spec's constraints."""

    def planned(self) -> list[Allocation]:
        """Allocations already committed for the slots after the current one (shown in run logs)."""
        return []

    def params(self) -> dict[str, Any]:
        """The parameters that identify this policy (shown in reports)."""
        return {}

    @property
    def label(self) -> str:
        params = self.params()
        if not params:
            return self.name
        return f"{self.name}(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")"
