"""The job's throughput H(n) as measured so far, instead of as the user declared it.

Every plan and the on-demand safety net trust ``job.throughput``. A declaration that is too high
makes the safety net fire too late and the deadline is missed on any policy, so the policies
are shown a :class:`~airflow_provider_spotsched.scheduling.model.Job` whose throughput is this
estimate (:meth:`ThroughputEstimate.job`), and neither the policies nor the safety net need to
know that it is one.

The estimate keeps the declared shape and scales it: ``H_est(n) = k * H_declared(n)``. One slot
on ``n`` instances for ``e`` effective hours (after reconfiguration overhead) that did ``w``
work measures the ratio ``r = w / (e * H_declared(n))``; the ratio, not alpha and beta apart,
is what one slot can tell (a job mostly runs at one ``n``, which cannot separate the two).

- Weights: a slot's ratio weighs its effective hours, and older weights halve every
  ``half_life_hours`` of compute measured since, so a mid-job slowdown takes over within a
  few slots while noise of single slots averages out.
- Shrinkage: the declared value counts as ``prior_hours`` of measurement at ratio 1 made
  before the first slot (so it fades like one), so with little data the mean stays near the
  declaration and with more it follows the measurement:
  ``mean = (p + sum w_i r_i) / (p + sum w_i)``, ``p`` the prior's decayed weight.
- Conservatism: ``k`` is the lower of that shrunk mean and a one-sided lower confidence bound of
  the measured ratios alone, ``m - z * s / sqrt(n_eff)`` (weighted mean ``m``, weighted
  spread ``s``, effective sample count ``n_eff = (sum w)^2 / sum w^2``). Bad news is believed at
  once (a measurement below the declaration lowers ``k`` from the first slot, since the bound
  ignores the prior), good news never: ``k`` is capped at 1. A throughput that errs low costs
  money (the safety net fires early); one that errs high costs the deadline, and a job measured
  ahead of its declaration can lose that lead to load or a slower node after its plan spent
  the slack it seemed to give (the fault suite's loaded workers did exactly that).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from airflow_provider_spotsched.scheduling.model import Job, JobError, Throughput

DEFAULT_PRIOR_HOURS = 2.0
DEFAULT_HALF_LIFE_HOURS = 3.0
DEFAULT_CONFIDENCE_Z = 1.645  # one-sided 95%


@dataclass
class ThroughputEstimate:
    """Running, decayed sums of the measured ratios of one job (see the module docstring).

    :param declared: the throughput the user declared, the estimate's shape and prior.
    :param prior_hours: compute hours of measurement the declaration is worth, >= 0.
    :param half_life_hours: compute hours after which a measurement weighs half, > 0;
        ``math.inf`` for none (every measurement weighs its hours alone).
    :param confidence_z: standard errors the lower bound lies below the measured mean, >= 0.
    """

    declared: Throughput
    prior_hours: float = DEFAULT_PRIOR_HOURS
    half_life_hours: float = DEFAULT_HALF_LIFE_HOURS
    confidence_z: float = DEFAULT_CONFIDENCE_Z
    prior_weight: float = field(init=False)  # p: prior_hours, decayed with the measurements
    weight: float = field(init=False, default=0.0)  # sum w_i
    weighted_ratio: float = field(init=False, default=0.0)  # sum w_i r_i
    weighted_square: float = field(init=False, default=0.0)  # sum w_i r_i^2
    weight_square: float = field(init=False, default=0.0)  # sum w_i^2

    def __post_init__(self) -> None:
        for name, low, strict in (("prior_hours", 0.0, False), ("half_life_hours", 0.0, True), ("confidence_z", 0.0, False)):
            value = getattr(self, name)
            endless = name == "half_life_hours" and value == math.inf
            if not endless and (not math.isfinite(value) or value < low or (strict and value == low)):
                endless_too = " (or math.inf for no decay)" if name == "half_life_hours" else ""
                raise JobError(f"{name}={value!r}: must be a finite number {'>' if strict else '>='} {low:g}{endless_too}")
        self.prior_weight = self.prior_hours

    def observe(self, instances: int, effective_hours: float, work: float) -> None:
        """Learn from one applied slot: ``work`` done on ``instances`` in ``effective_hours``.

        A slot that ran nothing (paused, or all its time lost to reconfiguration) says nothing
        about the throughput and is skipped.
        """
        if work < 0 or not math.isfinite(work):
            raise ValueError(f"work={work!r}: a slot's measured work must be a finite number >= 0")
        expected = effective_hours * self.declared(instances)
        if instances <= 0 or effective_hours <= 0 or expected <= 0:
            return
        ratio = work / expected
        decay = 0.5 ** (effective_hours / self.half_life_hours)
        self.prior_weight *= decay
        self.weight = self.weight * decay + effective_hours
        self.weighted_ratio = self.weighted_ratio * decay + effective_hours * ratio
        self.weighted_square = self.weighted_square * decay + effective_hours * ratio**2
        self.weight_square = self.weight_square * decay**2 + effective_hours**2

    @property
    def shrunk_factor(self) -> float:
        """The measured ratio shrunk toward the declaration (ratio 1) by ``prior_hours``."""
        if self.prior_weight + self.weight <= 0:
            return 1.0
        return (self.prior_weight + self.weighted_ratio) / (self.prior_weight + self.weight)

    @property
    def lower_factor(self) -> float:
        """The measured ratios' lower confidence bound; 1 (the declaration) before any."""
        if self.weight <= 0:
            return 1.0
        mean = self.weighted_ratio / self.weight
        variance = max(self.weighted_square / self.weight - mean**2, 0.0)
        samples = self.weight**2 / self.weight_square
        return mean - self.confidence_z * math.sqrt(variance / samples)

    @property
    def factor(self) -> float:
        """``k``: the conservative scale of the declared throughput, the lower of both views, at most 1.

        Floored at a thousandth: a slot measured at no work at all (a hung runtime) makes the
        safety net fire, without a zero throughput that no :class:`Job` accepts. Rounded to nine
        decimals, far below what a measurement can tell: work summed slot by slot (the
        simulator) and work differenced from running totals (an online run) then give the same
        estimate, so their plans agree instead of parting at a safety net's knife edge.
        """
        return round(max(min(self.shrunk_factor, self.lower_factor, 1.0), 1e-3), 9)

    def throughput(self) -> Throughput:
        """The estimated ``H(n) = k * alpha * n + k * beta``."""
        k = self.factor
        return Throughput(self.declared.alpha * k, self.declared.beta * k)

    def job(self, job: Job) -> Job:
        """``job`` as the policies see it: its throughput replaced by the estimate."""
        if self.weight <= 0:
            return job
        return replace(job, throughput=self.throughput())


def throughput_to_dict(throughput: Throughput) -> dict[str, float]:
    """The decision log's form of a throughput: the job file's ``{"alpha", "beta"}``."""
    return {"alpha": throughput.alpha, "beta": throughput.beta}


def throughput_from_dict(data: Mapping[str, Any]) -> Throughput:
    """The inverse of :func:`throughput_to_dict`."""
    return Throughput(float(data["alpha"]), float(data.get("beta", 0.0)))
