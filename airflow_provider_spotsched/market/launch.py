"""Launch outcomes: what a backend's launch request got, the evidence availability is read from.

The type lives in the market layer because both layers need it: the compute backends record
outcomes, the market sources and the history store read them; backends depend on the market,
never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class LaunchOutcome:
    """One launch request and what came of it: the availability signal a market source reads.

    ``launched < requested`` with ``reason`` (for example ``InsufficientInstanceCapacity``) says
    the pool had less capacity than asked at ``time`` (UTC).
    """

    time: datetime
    pool: str
    requested: int
    launched: int
    reason: str = ""


LaunchRecorder = Callable[[LaunchOutcome], None]
"""Called by a backend after every launch request (to keep outcomes for availability forecasts)."""
