"""The adaptive checkpoint interval: Young/Daly, following the predicted preemption rate.

Checkpointing every ``tau`` seconds costs ``C/tau`` of the run time in saves, and a preemption
without notice loses on average ``tau/2`` of work; with preemptions every ``M`` seconds on
average the expected waste ``C/tau + tau/(2M)`` is smallest at Young's interval

    tau = sqrt(2 * C * M)

(Daly's higher-order refinement differs by less than ``C``, irrelevant when ``C << M``). ``M``,
the mean time between preemptions, comes from the job's config (``checkpoint.mtbp_hours``, the
scheduler's forecast of the pool's preemption rate); ``C`` is ``checkpoint.cost_s`` when given,
else an exponential moving average of the runtime's own measured saves. The interval is clamped
to ``[min_interval_s, max_interval_s]``: the lower bound stops a cheap save from turning into a
save per step, the upper bound caps the work a preemption without notice can lose. Without a
forecast (no ``mtbp_hours``) the interval is ``max_interval_s``.
"""

from __future__ import annotations

import math

from airflow_provider_spotsched.runtime.config import CheckpointSettings

COST_SMOOTHING = 0.3  # weight of the newest measured save in the moving average


def young_daly_interval(cost_s: float, mtbp_s: float) -> float:
    """sqrt(2 x checkpoint cost x mean time between preemptions), in seconds."""
    if cost_s < 0 or mtbp_s <= 0:
        raise ValueError(f"need cost_s >= 0 and mtbp_s > 0, got cost_s={cost_s}, mtbp_s={mtbp_s}")
    return math.sqrt(2.0 * cost_s * mtbp_s)


class CheckpointInterval:
    """Tracks the checkpoint cost and says when the next checkpoint is due."""

    def __init__(self, settings: CheckpointSettings) -> None:
        self.settings = settings
        self.measured_cost_s: float | None = None

    def record_cost(self, seconds: float) -> None:
        """Feed the duration of one save (moving average; ignored when the config fixes the cost)."""
        if self.measured_cost_s is None:
            self.measured_cost_s = seconds
        else:
            self.measured_cost_s += COST_SMOOTHING * (seconds - self.measured_cost_s)

    @property
    def cost_s(self) -> float:
        if self.settings.cost_s is not None:
            return self.settings.cost_s
        return self.measured_cost_s or 0.0

    @property
    def seconds(self) -> float:
        """The interval now in force."""
        low, high = self.settings.min_interval_s, self.settings.max_interval_s
        if self.settings.mtbp_hours is None:
            return high
        return min(high, max(low, young_daly_interval(self.cost_s, self.settings.mtbp_hours * 3600.0)))

    def due(self, seconds_since_last: float) -> bool:
        return seconds_since_last >= self.seconds
