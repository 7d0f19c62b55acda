"""How long a spot pool's offer will last: SkyNomad's survival estimate, on this project's model.

SkyNomad (arXiv 2601.06520; artifact github.com/andylizf/skynomad-artifact, Apache-2.0,
``sky_spot/strategies/unified_cost_model.py``) prices a spot region by the lifetime it expects
from it. This module is our own implementation of that estimate:

- Nelson-Aalen: from the pool's past runs of availability (a run that ended is a failure, the
  run in progress a censored observation), the cumulative hazard H0 as steps d_j / n_j at each
  failure time, and a flat tail hazard equal to the last step beyond the last failure.
- Burst (the artifact's "jitter"): each slot a pool is on offer adds its hazard increment
  H0(age now) - H0(age before) as risk, and each loss of the offer a failure; over the newest
  events (at most ``MAX_BURST_RISK`` of total risk) the densest suffix with at most one unit of
  risk gives the ratio failures / risk, and g = max(1, that ratio) scales the hazard up while
  a pool preempts more than its history says (g = 1 until one unit of risk has been seen).
- Expected remaining lifetime at age a: the integral of exp(-g * (H0(t) - H0(a))) over the
  knots after a, plus the tail as a geometric series of slots.

Where the artifact learns a region's runs from its own launches and one probe per region, a
policy here sees every pool's available count each slot, so every pool's runs are observed
(the artifact's ``--virtual-availability`` setting, with a free probe every slot).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

TINY_HAZARD = 1e-8
"""The tail hazard of a pool never seen to fail: its lifetime is then only capped, not estimated."""

MAX_BURST_RISK = 8.0
"""The burst detector forgets its oldest events beyond this much total risk."""


@dataclass
class PoolLifetime:
    """One pool's observed runs of availability and its burst state, updated once a slot."""

    slot_hours: float
    failures: list[float] = field(default_factory=list)  # lengths (hours) of runs that ended
    age_slots: int | None = None  # slots the current run has lasted, None while not on offer
    burst: deque[tuple[float, int]] = field(default_factory=deque)  # (risk, failures) per event
    g: float = 1.0

    @property
    def age_hours(self) -> float | None:
        return None if self.age_slots is None else self.age_slots * self.slot_hours

    def knots(self) -> tuple[list[tuple[float, float]], float]:
        """Nelson-Aalen steps (failure time, d_j / n_j) and the tail hazard."""
        samples = [(d, True) for d in self.failures]
        age = self.age_hours
        if age is not None and age > 0:
            samples.append((age, False))
        times = sorted(set(self.failures))
        steps = []
        for tau in times:
            failed = sum(1 for d, f in samples if f and abs(d - tau) <= 1e-9)
            at_risk = sum(1 for d, _ in samples if d + 1e-9 >= tau)
            steps.append((tau, failed / max(at_risk, 1)))
        tail = max(steps[-1][1], TINY_HAZARD) if steps else TINY_HAZARD
        return steps, tail

    def observe(self, offered: bool) -> None:
        """Take this slot's state: the offer continues, starts, ends, or stays absent."""
        was = self.age_hours
        failed = 0
        if offered:
            self.age_slots = 0 if self.age_slots is None else self.age_slots + 1
        elif self.age_slots is not None:
            self.failures.append((self.age_slots + 1) * self.slot_hours)  # the offer held until this slot began
            self.age_slots, failed = None, 1
        steps, tail = self.knots()
        risk = 0.0
        now = self.age_hours
        if now is not None:
            before = was if was is not None else max(now - self.slot_hours, 0.0)
            risk = max(0.0, cumulative_hazard(steps, tail, now) - cumulative_hazard(steps, tail, before))
            if risk <= 0.0 and not steps:
                risk = tail * self.slot_hours
            elif risk <= 0.0 and before >= steps[-1][0]:
                risk = tail * (now - before)
        if failed and risk <= 0.0:
            risk = tail * self.slot_hours
        if risk > 0.0 or failed:
            self._add_burst(risk, failed)

    def _add_burst(self, risk: float, failed: int) -> None:
        self.burst.append((risk, failed))
        total = sum(r for r, _ in self.burst)
        while self.burst and total - self.burst[0][0] >= MAX_BURST_RISK:
            total -= self.burst.popleft()[0]
        self.g = 1.0 if total < 1.0 else max(1.0, densest_suffix(self.burst))

    def expected_hours(self) -> float:
        """Expected remaining lifetime of the pool's offer from its current age (0 if none)."""
        steps, tail = self.knots()
        t = self.age_hours or 0.0
        expected, survival = 0.0, 1.0
        for tau, step in steps:
            if tau <= t + 1e-12:
                continue
            expected += survival * (tau - t)
            survival *= math.exp(-self.g * step)
            t = tau
        denominator = 1.0 - math.exp(-self.g * tail)
        expected += survival * self.slot_hours / (denominator if denominator > 1e-9 else max(self.g * tail, 1e-9))
        return expected


def cumulative_hazard(steps: list[tuple[float, float]], tail: float, t: float) -> float:
    """H0(t): the steps before t, plus the tail hazard per hour beyond the last failure."""
    if t <= 0:
        return 0.0
    total, last = 0.0, 0.0
    for tau, step in steps:
        if tau >= t:
            break
        total, last = total + step, tau
    return total + (t - last) * tail if t > last else total


def densest_suffix(events: deque[tuple[float, int]]) -> float:
    """Failures per unit of risk over the newest events holding at most one unit of risk."""
    best, best_len, risk, failures = 0.0, 0, 0.0, 0
    for length, (r, f) in enumerate(reversed(events), start=1):
        risk, failures = risk + r, failures + f
        if length == 1 and risk <= 1e-6 and failures <= 0:
            continue
        if risk > 1.0 + 1e-9:
            if length == 1:
                best = failures / max(risk, 1e-6)
            break
        ratio = failures / risk if risk > 0 else (failures / 1e-6 if failures else 0.0)
        if best_len == 0 or ratio > best + 1e-9:
            best, best_len = ratio, length
    return best
