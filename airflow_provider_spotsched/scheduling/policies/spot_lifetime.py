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

The runs come from the policy: every pool's offer each slot (:meth:`PoolLifetime.observe`,
the artifact's ``--virtual-availability`` with a free probe every slot, where the open run counts
as censored), or the artifact's default of its own launches and probes (:meth:`begin`,
:meth:`finish`, :meth:`attempt_failed`, where only closed runs count).
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
    """One pool's observed runs and its burst state.

    A run opens with :meth:`begin` and closes with :meth:`finish`, as a failure (the offer was
    lost) or censored (the job left it); :meth:`update` feeds the burst detector once a slot.
    With ``count_open_run`` (the artifact's virtual availability) the open run counts in the
    Nelson-Aalen estimate as a censored observation.
    """

    slot_hours: float
    count_open_run: bool = True
    runs: list[tuple[int, int, bool]] = field(default_factory=list)  # (first slot, end slot, failed)
    start: int | None = None  # first slot of the open run, None while none is open
    age_slots: int | None = None  # slots the open run has lasted at the last update
    pending_failures: int = 0  # failures since the last update (lost offers, failed launches)
    burst: deque[tuple[float, int]] = field(default_factory=deque)  # (risk, failures) per event
    g: float = 1.0

    @property
    def age_hours(self) -> float | None:
        return None if self.age_slots is None else self.age_slots * self.slot_hours

    @property
    def failures(self) -> list[float]:
        """Lengths (hours) of the runs that ended in a failure."""
        return [(end - first) * self.slot_hours for first, end, failed in self.runs if failed]

    def begin(self, slot: int) -> None:
        """A run opens at ``slot`` (one already open is dropped, as the artifact's event log does)."""
        self.start, self.age_slots = slot, 0

    def finish(self, slot: int, failed: bool) -> None:
        """The open run ends at the start of ``slot``."""
        if self.start is not None:
            self.runs.append((self.start, slot, failed))
        self.start = self.age_slots = None
        self.pending_failures += int(failed)

    def attempt_failed(self) -> None:
        """A launch or probe found no instance: a failure for the burst detector only."""
        self.pending_failures += 1

    def observe(self, slot: int, offered: bool) -> None:
        """Every-pool observation: this slot's offer continues, starts, ends or stays absent."""
        if offered and self.start is None:
            self.begin(slot)
        elif not offered and self.start is not None:
            self.finish(slot, failed=True)
        self.update(slot)

    def knots(self) -> tuple[list[tuple[float, float]], float]:
        """Nelson-Aalen steps (failure time, d_j / n_j) and the tail hazard."""
        samples = [((end - first) * self.slot_hours, failed) for first, end, failed in self.runs]
        age = self.age_hours
        if self.count_open_run and age is not None and age > 0:
            samples.append((age, False))
        times = sorted({d for d, f in samples if f})
        steps = []
        for tau in times:
            failed = sum(1 for d, f in samples if f and abs(d - tau) <= 1e-9)
            at_risk = sum(1 for d, _ in samples if d + 1e-9 >= tau)
            steps.append((tau, failed / max(at_risk, 1)))
        tail = max(steps[-1][1], TINY_HAZARD) if steps else TINY_HAZARD
        return steps, tail

    def update(self, slot: int) -> None:
        """Once a slot: the open run's hazard increment and the failures since the last update."""
        self.age_slots = None if self.start is None else slot - self.start
        steps, tail = self.knots()
        risk, now = 0.0, self.age_hours
        if now is not None:
            before = max(now - self.slot_hours, 0.0)
            risk = max(0.0, cumulative_hazard(steps, tail, now) - cumulative_hazard(steps, tail, before))
            if risk <= 0.0 and not steps:
                risk = tail * self.slot_hours
            elif risk <= 0.0 and before >= steps[-1][0]:
                risk = tail * (now - before)
        failed, self.pending_failures = self.pending_failures, 0
        if failed and risk <= 0.0:
            risk = tail * self.slot_hours
        if risk > 0.0 or failed:
            self._add_burst(risk, failed)

    def offered_hours(self, first: int, slot: int) -> float:
        """Hours of runs (closed and open) inside slots ``first .. slot - 1``."""
        spans = [(a, b) for a, b, _ in self.runs] + ([(self.start, slot)] if self.start is not None else [])
        return sum(max(0, min(b, slot) - max(a, first)) for a, b in spans) * self.slot_hours

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
