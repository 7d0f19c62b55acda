"""A simulated job's real throughput, when it differs from the one its user declared.

Real fine-tuning runs slower than benchmarked (longer sequences, a slower interconnect, a
noisy neighbour), or slows down mid-job. The simulator runs such a job on :class:`TrueThroughput`
while its policy sees the declared value and the measured estimate only; that is how the
estimate's benefit is measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from airflow_provider_spotsched.scheduling.model import Job, JobError, Throughput


@dataclass(frozen=True)
class TrueThroughput:
    """The real H(n) as a multiple of the declared one: ``factor``, then also ``slowdown_factor``
    from the slot starting at or after ``slowdown_at_hours`` (hours after submission) on.

    ``TrueThroughput(0.7)`` is a job 30% slower than declared from the start;
    ``TrueThroughput(1.0, 6.0, 0.7)`` one that slows down by 30% six hours in.
    """

    factor: float = 1.0
    slowdown_at_hours: float | None = None
    slowdown_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("factor", "slowdown_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise JobError(
                    f"{name}={value!r}: must be a number > 0, the true throughput as a multiple of the declared "
                    "one (e.g. 0.7 for 30% slower)"
                )
        at = self.slowdown_at_hours
        if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0):
            raise JobError(f"slowdown_at_hours={at!r}: must be a number of hours >= 0 after submission, or None for none")
        if at is None and self.slowdown_factor != 1.0:
            raise JobError(f"slowdown_factor={self.slowdown_factor!r} needs slowdown_at_hours: give when the slowdown begins")

    def factor_at(self, hours: float) -> float:
        """The multiple of the declared throughput in force at ``hours`` after submission."""
        slowed = self.slowdown_at_hours is not None and hours >= self.slowdown_at_hours - 1e-9
        return self.factor * (self.slowdown_factor if slowed else 1.0)

    def job_at(self, job: Job, hours: float) -> Job:
        """``job`` with the throughput it really has at ``hours`` after submission."""
        return _scaled(job, self.factor_at(hours))

    def slowest_job(self, job: Job) -> Job:
        """``job`` at its lowest throughput over the horizon: what a hindsight plan can rely on
        (exact for a constant factor; with a slowdown, a plan that never finishes late). A slowdown
        that begins after the job's last slot has started never touches it."""
        return _scaled(job, min(self.factor_at(k * job.slot_hours) for k in range(job.horizon_slots)))

    @property
    def is_declared(self) -> bool:
        """Whether the job runs exactly as declared."""
        return self.factor == 1.0 and self.slowdown_factor == 1.0


def _scaled(job: Job, k: float) -> Job:
    """``job`` with its throughput multiplied by ``k``."""
    if k == 1.0:
        return job
    return replace(job, throughput=Throughput(job.throughput.alpha * k, job.throughput.beta * k))
