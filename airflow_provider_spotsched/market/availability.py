"""Availability signals and how they become counts: placement scores and launch outcomes.

No cloud publishes "how many spot instances could I get now". Two kinds of evidence exist:

- a *score* (AWS spot placement score, 1..10): how likely a request for ``target`` instances
  would succeed; turned into a count by :func:`score_to_count`;
- a *launch outcome* (:class:`~airflow_provider_spotsched.market.launch.LaunchOutcome`, what a
  backend recorded): a shortfall (``launched < requested``, e.g. ``InsufficientInstanceCapacity``
  or ``ZONE_RESOURCE_POOL_EXHAUSTED``) says exactly ``launched`` could be had then (0 when none
  started); a full success of ``k`` says at least ``k`` could.

How they combine (:func:`available_at`): evidence older than ``ttl`` is forgotten; the rest is
read oldest first, each score or shortfall *replacing* the estimate, each success *raising* it to
at least its count. So the latest evidence wins, except that a success never lowers an estimate.
Where no evidence is in force the count is unknown (``None``): a source then emits no tick, and
the slot resampling treats the gap as unknown, never as "available".
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from airflow_provider_spotsched.market.launch import LaunchOutcome

SCORE_MIN, SCORE_MAX = 1, 10

OutcomeReader = Callable[[datetime, datetime], Iterable[LaunchOutcome]]
"""Returns the launch outcomes recorded in [start, end], e.g. ``MarketHistoryStore.outcomes``."""


class SignalKind(str, enum.Enum):
    """How a signal's count is read (see the module docstring)."""

    SCORE = "score"  # an estimate: replaces
    SHORTFALL = "shortfall"  # exactly this many: replaces
    SUCCESS = "success"  # at least this many: raises


@dataclass(frozen=True)
class AvailabilitySignal:
    """One piece of availability evidence for ``pool`` at ``time`` (UTC)."""

    time: datetime
    pool: str
    count: int
    kind: SignalKind


def score_to_count(score: int, target: int) -> int:
    """The count a placement score for ``target`` instances stands for.

    Linear from score 1 (no instance) to 10 (all ``target``), rounded: AWS defines the score as a
    likelihood of success, not a capacity, so this is a documented heuristic. With ``target=1``
    scores 6..10 read as 1 and 1..5 as 0.
    """
    if isinstance(score, bool) or not isinstance(score, int) or not SCORE_MIN <= score <= SCORE_MAX:
        raise ValueError(f"placement score {score!r} must be an integer in {SCORE_MIN}..{SCORE_MAX}")
    if target < 1:
        raise ValueError(f"target capacity {target!r} must be >= 1 (the instances the score was asked for)")
    return int(round(target * (score - SCORE_MIN) / (SCORE_MAX - SCORE_MIN)))


def outcome_signal(outcome: LaunchOutcome) -> AvailabilitySignal:
    """A recorded launch outcome as evidence: a shortfall is exact, a full success a lower bound."""
    if outcome.requested < 0 or outcome.launched < 0 or outcome.launched > outcome.requested:
        raise ValueError(
            f"launch outcome for pool {outcome.pool!r} at {outcome.time.isoformat()}: launched "
            f"{outcome.launched} must lie in 0..requested ({outcome.requested})"
        )
    kind = SignalKind.SHORTFALL if outcome.launched < outcome.requested else SignalKind.SUCCESS
    return AvailabilitySignal(_utc(outcome.time), outcome.pool, outcome.launched, kind)


def available_at(signals: Sequence[AvailabilitySignal], when: datetime, ttl: timedelta) -> int | None:
    """The count in force in one pool at ``when`` from its ``signals``, or ``None`` if unknown."""
    when = _utc(when)
    live = sorted((s for s in signals if when - ttl < s.time <= when), key=lambda s: s.time)
    estimate: int | None = None
    for signal in live:
        if signal.kind is SignalKind.SUCCESS:
            estimate = max(estimate or 0, signal.count)
        else:
            estimate = signal.count
    return estimate


def by_pool(signals: Iterable[AvailabilitySignal]) -> dict[str, list[AvailabilitySignal]]:
    """Signals grouped per pool, each group in time order."""
    grouped: dict[str, list[AvailabilitySignal]] = {}
    for signal in sorted(signals, key=lambda s: s.time):
        grouped.setdefault(signal.pool, []).append(signal)
    return grouped


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)
