"""Exact solver of the window planning problem: the best allocations for the next ``w`` slots.

Given the job's state at a window's first slot and the window's spot prices and availability
(actual or forecast), :func:`solve_plan` maximises ``V(T) - cost`` (or minimises cost plus a
terminal price for the work still left) on the spec's model exactly: reconfiguration overhead,
per-second billing of the completion slot, N_min..N_max or 0, spot within availability.

Method (``docs/policies-optimal-chc.md`` has the proofs): a schedule is a sequence of maximal
segments of one constant non-zero allocation vector, separated by pauses. A segment's progress
depends only on its instance count n and length, and the cheapest vector of n instances over it
is a greedy fill of the pools by their summed price under the segment's minimum availability,
then on-demand. Replacing every segment's vector by its cheapest one never hurts, so a
label-setting dynamic programme over (slot, work done, cost) with Pareto dominance, an
incumbent from a first beam-limited pass and a knapsack lower bound on the cost to go finds the
optimum. Every array operation is vectorised over labels, instance counts and segment ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from airflow_provider_spotsched.scheduling.model import WORK_EPSILON, Allocation, Job
from airflow_provider_spotsched.scheduling.rules import cheapest_allocation

# Labels per slot kept by the first pass, which only looks for a good incumbent.
BEAM_WIDTH = 8
# Labels per slot beyond which the exact pass keeps the most promising ones; the plan is then
# returned with ``proven_optimal=False``. Far above what real windows need (see the docs).
LABEL_LIMIT = 40_000
# Segment ends generated at once (labels x options x lengths); larger fronts go in chunks.
CHUNK_ENTRIES = 1 << 21
# A label is pruned when its lower bound is within this many USD of the incumbent.
COST_TOLERANCE = 1e-9

_CHEAPEST, _CONTINUE, _FALLBACK = 1, 2, 3


class PlanError(ValueError):
    """A planning request is invalid, or no plan meets its deadline-safe end."""


@dataclass(frozen=True)
class CostLimit:
    """A bound the plan keeps after every slot: the cost guard's invariant on the window's market.

    After window slot t the plan's cost in the window plus ``catch_up_price`` times the work by
    which it trails ``shadow_work[t]`` (the shadow Uniform Progress's work done by then, in the
    request's units) stays within ``cost_cap[t]``. A plan that has finished trails nothing. The
    bound grows with cost and shrinks with work, so it keeps Pareto dominance between partial
    plans (``docs/policies-optimal-chc.md`` has the one approximation: the slots before a
    completion slot). After a slot where the shadow is still at work (``shadow_at_work``), a
    plan that trails it keeps ``handover_margin`` hours of slack beyond what N_max on-demand
    instances need to finish by the soft deadline.
    """

    cost_cap: np.ndarray
    shadow_work: np.ndarray
    shadow_at_work: np.ndarray
    catch_up_price: float
    handover_margin: float = 0.0

    def __post_init__(self) -> None:
        cap, work = np.asarray(self.cost_cap, dtype=float), np.asarray(self.shadow_work, dtype=float)
        if cap.ndim != 1 or cap.shape != work.shape or np.shape(self.shadow_at_work) != cap.shape:
            raise PlanError(
                f"cost_cap {cap.shape}, shadow_work {work.shape} and shadow_at_work {np.shape(self.shadow_at_work)} must all be [w slots]"
            )
        if not (np.all(np.isfinite(cap)) and np.all(np.isfinite(work))):
            raise PlanError("cost_cap and shadow_work must be finite")
        if not (self.catch_up_price >= 0 and self.handover_margin >= 0):
            raise PlanError(f"catch_up_price ({self.catch_up_price}) and handover_margin ({self.handover_margin}) must be >= 0")


@dataclass(frozen=True)
class PlanRequest:
    """The job's state at the window's first slot and the window's market."""

    job: Job
    start_hours: float
    work_done: float
    previous: Allocation
    spot_price: np.ndarray
    available: np.ndarray
    on_demand_price: float
    # USD per unit of work still left at the window's end (no value is earned for it); None: the
    # window reaches the horizon and unfinished work simply earns no value.
    terminal_cost_per_work: float | None = None
    # If True, work left at the window's end must be finishable by the soft deadline on N_max
    # on-demand instances (one overhead unless the last slot already runs that fallback).
    deadline_safe_end: bool = False
    # If True, every slot of the plan passes rules.is_deadline_safe (which implies a safe end).
    deadline_safe: bool = False
    # If set, every slot of the plan keeps this bound (a guarded policy's invariant).
    cost_limit: CostLimit | None = None
    # USD added to every plan that does not keep ``previous`` through the window's first slot
    # where it could (it fits the slot): a tie-break, far below real cost differences, so that
    # a restart the forecast puts later is not made now, while the forecast may still be wrong.
    # A cost limit is checked on the cost with it in (by that much stricter for such a plan).
    keep_preference: float = 0.0

    def __post_init__(self) -> None:
        price = np.asarray(self.spot_price, dtype=float)
        available = np.asarray(self.available, dtype=float)
        if price.ndim != 2 or price.shape[0] < 1 or price.shape != available.shape:
            raise PlanError(
                f"spot_price {price.shape} and available {available.shape} must both be [w >= 1 slots, M pools]"
            )
        if len(self.previous.spot) != price.shape[1]:
            raise PlanError(f"previous has {len(self.previous.spot)} pools, spot_price has {price.shape[1]}")
        if not (np.all(np.isfinite(price)) and np.all(np.isfinite(available))):
            raise PlanError("spot_price and available must be finite; fill forecast gaps before planning")
        if self.cost_limit is not None and len(self.cost_limit.cost_cap) != price.shape[0]:
            raise PlanError(f"cost_limit covers {len(self.cost_limit.cost_cap)} slots, the window has {price.shape[0]}")
        slot = self.job.slot_hours
        if self.start_hours < 0 or abs(round(self.start_hours / slot) * slot - self.start_hours) > 1e-6:
            raise PlanError(f"start_hours must be a multiple of slot_hours={slot:g} and >= 0, got {self.start_hours}")
        if not 0 <= self.work_done < self.job.work - WORK_EPSILON:
            raise PlanError(
                f"work_done must be in [0, work={self.job.work:g}) for a job still running, got {self.work_done}"
            )
        if not self.on_demand_price >= 0:
            raise PlanError(f"on_demand_price must be >= 0, got {self.on_demand_price}")
        if self.terminal_cost_per_work is not None and not self.terminal_cost_per_work >= 0:
            raise PlanError(
                f"terminal_cost_per_work must be >= 0 USD per work unit or None, got {self.terminal_cost_per_work}"
            )
        if not (math.isfinite(self.keep_preference) and self.keep_preference >= 0):
            raise PlanError(f"keep_preference must be a finite number of USD >= 0, got {self.keep_preference}")


@dataclass(frozen=True)
class Plan:
    """The allocations of the window up to completion, and what the planner computed of them."""

    allocations: list[Allocation]
    objective: float
    completion_hours: float | None
    proven_optimal: bool


def solve_plan(request: PlanRequest) -> Plan:
    """The allocations that minimise cost (+ terminal cost) - value over the request's window."""
    return _Window(request).solve()


def _fill_costs(price: np.ndarray, cap: np.ndarray, on_demand: np.ndarray, n_max: int) -> np.ndarray:
    """Cost ``[K, n_max + 1]`` of the cheapest 0..n_max instances per row (greedy over sorted pools).

    Pools priced above ``on_demand`` are skipped, as :func:`rules.cheapest_allocation` does.
    """
    order = np.argsort(price, axis=1, kind="stable")
    sorted_price = np.take_along_axis(price, order, axis=1)
    sorted_cap = np.where(sorted_price <= on_demand[:, None], np.take_along_axis(cap, order, axis=1), 0)
    filled = np.cumsum(sorted_cap, axis=1)
    units = np.arange(1, n_max + 1)
    pool_of_unit = (filled[:, None, :] < units[None, :, None]).sum(axis=2)
    unit_price = np.take_along_axis(np.concatenate([sorted_price, on_demand[:, None]], axis=1), pool_of_unit, axis=1)
    return np.concatenate([np.zeros((price.shape[0], 1)), np.cumsum(unit_price, axis=1)], axis=1)


def _fill_cost_n(price: np.ndarray, cap: np.ndarray, on_demand: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Cost ``[K]`` of the cheapest ``n[k]`` instances of row k (same greedy as :func:`_fill_costs`)."""
    order = np.argsort(price, axis=1, kind="stable")
    sorted_price = np.take_along_axis(price, order, axis=1)
    sorted_cap = np.where(sorted_price <= on_demand[:, None], np.take_along_axis(cap, order, axis=1), 0)
    before = np.cumsum(sorted_cap, axis=1) - sorted_cap
    take = np.clip(n[:, None] - before, 0, sorted_cap)
    return (take * sorted_price).sum(axis=1) + (n - take.sum(axis=1)) * on_demand


def _fill_counts(price: np.ndarray, cap: np.ndarray, on_demand: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest fill of each count per row (same greedy as :func:`_fill_costs`): spot
    instances per pool ``[K, C, M]`` and on-demand ones ``[K, C]``."""
    order = np.argsort(price, axis=1, kind="stable")
    sorted_price = np.take_along_axis(price, order, axis=1)
    sorted_cap = np.where(sorted_price <= on_demand[:, None], np.take_along_axis(cap, order, axis=1), 0)
    before = np.cumsum(sorted_cap, axis=1) - sorted_cap
    take = np.clip(counts[None, :, None] - before[:, None, :], 0, sorted_cap[:, None, :])
    spot = np.zeros_like(take)
    np.put_along_axis(spot, np.broadcast_to(order[:, None, :], take.shape), take, axis=2)
    return spot, counts[None, :] - take.sum(axis=2)


class _Records:
    """Every label kept: the label it extends and the segment [first, end) that led to it.

    Label ids index these arrays; the plan is rebuilt by walking them back from the best end.
    """

    FIELDS = ("parent", "first", "end", "count", "kind")

    def __init__(self) -> None:
        self.chunks: dict[str, list[np.ndarray]] = {name: [] for name in self.FIELDS}
        self.size = 0

    def add(self, parent, first, end, count, kind) -> np.ndarray:
        k = len(parent)
        for name, values in zip(self.FIELDS, (parent, first, end, count, kind)):
            self.chunks[name].append(np.broadcast_to(values, (k,)).copy())
        self.size += k
        return np.arange(self.size - k, self.size)

    def frozen(self) -> dict[str, np.ndarray]:
        return {name: np.concatenate(chunks) for name, chunks in self.chunks.items()}


@dataclass
class _Best:
    """The best finished schedule seen: the segment that ends it and the label it extends."""

    objective: float
    parent: int = -1
    first: int = 0
    end: int = 0
    count: int = 0
    kind: int = 0
    fraction: float | None = None
    completion_hours: float | None = None

    def improve(self, objective: float, parent: int, first: int = 0, end: int = 0, count: int = 0, kind: int = 0,
                fraction: float | None = None, completion_hours: float | None = None) -> None:
        """Record a better schedule (kind 0: the label ``parent`` paused to the window's end)."""
        self.objective, self.parent, self.first, self.end = objective, parent, first, end
        self.count, self.kind, self.fraction, self.completion_hours = count, kind, fraction, completion_hours


class _Window:
    """One planning problem with its precomputed tables (segment costs, lower bounds)."""

    def __init__(self, request: PlanRequest) -> None:
        job = request.job
        self.request, self.job = request, job
        self.s, self.delta = job.slot_hours, job.reconfig_overhead_hours
        self.price = np.asarray(request.spot_price, dtype=float)
        self.avail = np.maximum(np.floor(np.asarray(request.available, dtype=float)), 0).astype(np.int64)
        self.w, self.pools = self.price.shape
        self.n_max = job.max_instances
        self.counts = np.arange(job.min_instances, job.max_instances + 1)
        self.rates = job.throughput.alpha * self.counts + job.throughput.beta
        self.rate_max = job.rate(job.max_instances)
        self.work = job.work
        self.od = float(request.on_demand_price)
        self.start = float(request.start_hours)
        self.terminal = request.terminal_cost_per_work
        self.end_hours = self.start + self.w * self.s
        self.guard = request.deadline_safe
        self.safe_end = request.deadline_safe_end or request.deadline_safe
        self.cum_price = np.vstack([np.zeros(self.pools), np.cumsum(self.price, axis=0)])
        self.limit = request.cost_limit
        self._segment_tables()
        self._continuation_tables()
        self._bound_tables()
        if self.limit is not None:
            self._limit_tables()

    # ----- tables -------------------------------------------------------------------------
    def _segment_tables(self) -> None:
        """Per segment [t1, t2): ``cap`` (min availability) and ``opt_cost`` (cost of each option).

        The options are the cheapest vector of each count N_min..N_max and, when a safe state
        matters, the fallback vector itself, which meets the deadline test without an overhead.
        """
        w, job = self.w, self.job
        self.cap = np.zeros((w, w + 1, self.pools), dtype=np.int64)
        for t1 in range(w):
            self.cap[t1, t1 + 1 :] = np.minimum.accumulate(self.avail[t1:], axis=0)
        first, end = np.triu_indices(w + 1, k=1)
        summed = self.cum_price[end] - self.cum_price[first]
        on_demand = (end - first) * self.od
        costs = _fill_costs(summed, self.cap[first, end], on_demand, self.n_max) * self.s
        seg_cost = np.full((w, w + 1, self.n_max + 1), np.inf)
        seg_cost[first, end] = costs
        self.opt_counts = self.counts
        self.opt_fallback = np.zeros(len(self.counts), dtype=bool)
        self.opt_cost = seg_cost[:, :, self.counts]
        if self.safe_end:
            fallback = np.full((w, w + 1), np.inf)
            fallback[first, end] = (end - first) * self.s * self.n_max * self.od
            self.opt_counts = np.append(self.counts, self.n_max)
            self.opt_fallback = np.append(self.opt_fallback, True)
            self.opt_cost = np.concatenate([self.opt_cost, fallback[:, :, None]], axis=2)
        self.opt_rates = job.throughput.alpha * self.opt_counts + job.throughput.beta
        self.opt_kind = np.where(self.opt_fallback, _FALLBACK, _CHEAPEST)

    def _continuation_tables(self) -> None:
        """Keeping ``previous`` from slot 0 (no overhead): how long it fits and what it costs."""
        prev = self.request.previous
        n = prev.total
        self.cont_ok = n > 0 and self.job.min_instances <= n <= self.n_max
        fits = np.all(self.avail >= np.asarray(prev.spot), axis=1)
        self.cont_end = int(np.argmin(fits)) if not fits.all() else self.w
        self.cont_hourly = self.price @ np.asarray(prev.spot, dtype=float) + prev.on_demand * self.od
        self.cont_cost = np.concatenate([[0.0], np.cumsum(self.cont_hourly)]) * self.s
        self.cont_rate = self.job.rate(n)
        self.cont_is_fallback = prev == Allocation((0,) * self.pools, self.n_max)
        self.leave_cost = self.request.keep_preference if self.cont_ok and self.cont_end > 0 else 0.0

    def _bound_tables(self) -> None:
        """Fractional-knapsack lower bound of the cost of doing R more work from slot t on.

        Each slot offers at most H(N_max) * slot_hours of work at no less than its cheapest price
        per work unit u[t] (min over n of the cheapest n-fill / H(n)); the bound buys the cheapest
        slots first. A second table caps each price at the terminal price (work left unfinished).
        """
        w, s = self.w, self.s
        hourly = _fill_costs(self.price, self.avail, np.full(w, self.od), self.n_max)
        unit = (hourly[:, self.counts] / self.rates).min(axis=1)  # no slot does work for less
        self.slot_work = self.rate_max * s
        pieces = w + math.ceil(self.work / self.slot_work) + 2
        sorted_unit = np.full((w + 1, pieces), np.inf)
        for t in range(w):
            sorted_unit[t, : w - t] = np.sort(unit[t:])
        self.unit_table, self.unit_prefix = sorted_unit, self._prefix(sorted_unit)
        if self.terminal is not None:
            self.capped_table = np.minimum(sorted_unit, self.terminal)
            self.capped_prefix = self._prefix(self.capped_table)
        min_hourly = hourly[:, self.job.min_instances]
        cheapest_after = np.append(np.minimum.accumulate(min_hourly[::-1])[::-1], np.inf)
        self.overhead_cost = cheapest_after * self.delta if self.delta > 0 else np.zeros(w + 1)

    def _limit_tables(self) -> None:
        """What the cost limit asks of a label before a segment: per segment [t1, t2) and option,
        the most its window cost so far may be (``limit_cost``) and the most its cost minus
        ``catch_up_price`` x its work may be (``limit_floor``), for the segment's own vector to keep
        the limit after each of its slots. Both the cost and the work of a segment grow slot by
        slot, so a label passes when these two minima over the segment's slots hold."""
        limit, w, s = self.limit, self.w, self.s
        assert limit is not None
        self.lim_cap = np.asarray(limit.cost_cap, dtype=float)
        shadow = np.asarray(limit.shadow_work, dtype=float)
        self.lim_price = float(limit.catch_up_price)
        self.lim_floor = self.lim_cap - self.lim_price * shadow
        # The least work after each slot: level with a shadow at work, or the margin's slack
        # (one overhead less for the fallback itself, which a switch to N_max on-demand keeps).
        hours_left = self.job.deadline_hours - (self.start + s * np.arange(1, w + 1)) - limit.handover_margin
        at_work = np.asarray(limit.shadow_at_work, dtype=bool)
        self.lim_work = np.where(at_work, np.minimum(shadow, self.work - (hours_left - self.delta) * self.rate_max), -np.inf)
        self.lim_work_fallback = np.where(at_work, np.minimum(shadow, self.work - hours_left * self.rate_max), -np.inf)
        options = len(self.opt_counts)
        self.limit_cost = np.full((w, w + 1, options), -np.inf)
        self.limit_floor = np.full((w, w + 1, options), -np.inf)
        self.limit_work = np.full((w, w + 1, options), np.inf)
        least = np.where(self.opt_fallback[:, None], self.lim_work_fallback[None, :], self.lim_work[None, :])
        spot_counts = self.opt_counts[~self.opt_fallback]
        for t1 in range(w):
            ends = np.arange(t1 + 1, w + 1)
            summed = self.cum_price[ends] - self.cum_price[t1]
            spot, on_demand = _fill_counts(summed, self.cap[t1, ends], (ends - t1) * self.od, spot_counts)
            hourly = np.einsum("ecm,km->eck", spot, self.price[t1:]) + on_demand[:, :, None] * self.od
            if self.opt_fallback.any():
                hourly = np.concatenate([hourly, np.full((len(ends), 1, w - t1), self.n_max * self.od)], axis=1)
            spent = np.cumsum(hourly * s, axis=2)  # [end, option, slot of the segment]
            lengths = np.arange(1, w - t1 + 1)
            work = (lengths[None, :] * s - self.delta) * self.opt_rates[:, None]  # [option, slot]
            inside = lengths[None, None, :] <= (ends - t1)[:, None, None]
            cost_room = np.where(inside, self.lim_cap[t1:] - spent, np.inf).min(axis=2)
            floor_room = np.where(inside, self.lim_floor[t1:] - spent + self.lim_price * work[None], np.inf).min(axis=2)
            work_needed = np.where(inside, (least[:, t1:] - work)[None], -np.inf).max(axis=2)
            self.limit_cost[t1, ends] = cost_room
            self.limit_floor[t1, ends] = floor_room
            self.limit_work[t1, ends] = work_needed

    def _within_limit(self, slot, work: np.ndarray, cost: np.ndarray, fallback=False) -> np.ndarray:
        """Whether labels (window cost and work after window slot ``slot``, run on the fallback
        there or not) keep the cost limit there."""
        if self.limit is None:
            return np.ones(np.broadcast(work, cost).shape, dtype=bool)
        least = np.where(fallback, self.lim_work_fallback[slot], self.lim_work[slot])
        return (
            (cost <= self.lim_cap[slot] + 1e-9)
            & (cost - self.lim_price * work <= self.lim_floor[slot] + 1e-9)
            & (work >= least - WORK_EPSILON)
        )

    def _prefix(self, table: np.ndarray) -> np.ndarray:
        """Cost of buying the first j pieces of each row of ``table`` (one slot's work each)."""
        return np.concatenate([np.zeros((len(table), 1)), np.cumsum(table * self.slot_work, axis=1)], axis=1)

    def _knapsack(self, table: np.ndarray, prefix: np.ndarray, t: np.ndarray, remaining: np.ndarray) -> np.ndarray:
        """Cost of ``remaining`` work bought from the slots after ``t`` cheapest first (inf if too much).

        Work that fills the slots left exactly must not read as a sliver more (round-off) priced at
        inf: that bound pruned the label leading to the optimum (the plan then paid up to 17 USD more
        on a 5-slot job and still said it was proven optimal). A sliver within WORK_EPSILON is free,
        which keeps the bound a lower one."""
        pieces = np.floor(np.maximum(remaining - WORK_EPSILON, 0.0) / self.slot_work).astype(np.int64)
        whole = np.minimum(pieces, table.shape[1] - 1)
        part = remaining - whole * self.slot_work
        with np.errstate(invalid="ignore"):  # 0 * inf where no slot is left: no work, no cost
            extra = np.where(part > WORK_EPSILON, part * table[t, whole], 0.0)
        return prefix[t, whole] + extra

    def _lower_bound(self, t: np.ndarray, work: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """A lower bound of the final objective of labels at slots ``t`` (all after slot 0)."""
        remaining = self.work - work
        finish = self._knapsack(self.unit_table, self.unit_prefix, t, remaining) + self.overhead_cost[t]
        earliest = self.start + t * self.s + self.delta + remaining / self.rate_max
        finish = finish - self._value(earliest)
        stop: float | np.ndarray  # a scalar without a terminal price, one bound per label with one
        if self.terminal is None:
            stop = 0.0
        else:
            stop = self._knapsack(self.capped_table, self.capped_prefix, t, remaining)
        return cost + np.minimum(finish, stop)

    def _value(self, hours: np.ndarray) -> np.ndarray:
        """V(T) vectorised, exactly as :meth:`Job.value_at`."""
        job = self.job
        d, gamma = job.deadline_hours, job.hard_deadline_factor
        value = np.zeros_like(hours)
        if gamma > 1.0:
            decaying = hours <= gamma * d + 1e-9
            value = np.where(decaying, job.value * (gamma * d - hours) / ((gamma - 1.0) * d), 0.0)
        return np.where(hours <= d + 1e-9, job.value, value)

    def _safe(self, slot, remaining, fallback) -> np.ndarray:
        """:func:`rules.is_deadline_safe` at the start of window slot ``slot``: N_max on-demand
        from there meets the soft deadline, with one overhead unless the slot before ran it."""
        hours = self.job.deadline_hours - (self.start + np.asarray(slot) * self.s) - np.where(fallback, 0.0, self.delta)
        return hours * self.rate_max >= remaining - WORK_EPSILON

    def _end_objective(self, work: np.ndarray, cost: np.ndarray, fallback) -> np.ndarray:
        """Objective of stopping unfinished at the window's end; inf where a required safe end fails."""
        remaining = self.work - work
        objective = cost + (0.0 if self.terminal is None else self.terminal * remaining)
        if self.safe_end:
            objective = np.where(self._safe(self.w, remaining, fallback), objective, np.inf)
        return objective

    # ----- search -------------------------------------------------------------------------
    def solve(self) -> Plan:
        incumbent = self._search(math.inf, BEAM_WIDTH)
        exact = self._search(incumbent[0].objective, None)
        best, allocations, truncated = exact if exact[1] is not None else (incumbent[0], incumbent[1], exact[2])
        if allocations is None:
            raise PlanError(
                "no plan keeps the job able to finish by its soft deadline on N_max on-demand instances "
                "(deadline_safe_end or deadline_safe is set); the state is already unsafe: run the on-demand fallback"
            )
        return Plan(allocations, float(best.objective), best.completion_hours, not truncated)

    def _search(self, bound: float, beam: int | None) -> tuple[_Best, list[Allocation] | None, bool]:
        """One label-setting pass; ``beam`` keeps that many labels per slot (None: exact)."""
        best = _Best(bound)
        records = _Records()
        root = records.add(np.array([-1]), 0, 0, 0, 0)
        # Every plan but those that keep ``previous`` (``_continue_previous``) starts at the tie-break.
        front = (np.array([self.request.work_done]), np.array([self.leave_cost]), root)
        buckets: list[list[tuple[np.ndarray, ...]]] = [[] for _ in range(self.w + 1)]
        truncated = False
        for t in range(self.w):
            if t > 0:
                front, cut = self._merge(t, front, buckets[t], records, best.objective, beam)
                buckets[t] = []
                truncated |= cut
            chunk = max(1, CHUNK_ENTRIES // ((self.w - t) * len(self.opt_counts)))
            for first in range(0, len(front[0]), chunk):
                self._extend(t, tuple(x[first : first + chunk] for x in front), buckets, best)
            if t == 0:
                self._continue_previous(front, buckets, best)
        work, cost, ids = front  # the labels that pause through the last slot
        paused = self._within_limit(self.w - 1, work, cost)
        self._offer_end(work[paused], cost[paused], ids[paused], best, fallback=False)
        if best.parent < 0:
            return best, None, truncated
        return best, self._rebuild(best, records.frozen()), truncated

    def _merge(self, t: int, front, bucket, records: _Records, bound: float, beam: int | None):
        """Labels at slot t: the carried ones (paused in slot t-1) and the new segment ends, pruned."""
        work, cost, ids = front
        if self.guard:
            safe = self._safe(t, self.work - work, False)
            work, cost, ids = work[safe], cost[safe], ids[safe]
        k = len(work)
        parts = [(work, cost, ids, np.full(k, -1), np.zeros(k, np.int64), np.zeros(k, np.int64), np.zeros(k, np.int64))]
        for chunk in bucket:
            parts.append((chunk[0], chunk[1], np.full(len(chunk[0]), -1), *chunk[2:]))
        work, cost, ids, parent, first, count, kind = (np.concatenate(x) for x in zip(*parts))
        if self.limit is not None:  # a label paused through slot t-1 is checked there too
            kept = self._within_limit(t - 1, work, cost, kind == _FALLBACK)
            work, cost, ids, parent, first, count, kind = (x[kept] for x in (work, cost, ids, parent, first, count, kind))
        lower = self._lower_bound(np.full(len(work), t), work, cost)
        keep = lower < bound - COST_TOLERANCE
        columns = (work, cost, ids, parent, first, count, kind, lower)
        work, cost, ids, parent, first, count, kind, lower = (x[keep] for x in columns)
        if not len(work):
            return (work, cost, ids), False
        # Pareto: a label is dropped when another has at least its work (to 1e-10 of the job) for no more cost.
        key = np.round(work / (self.work * 1e-10))
        order = np.lexsort((cost, -key))
        running_min = np.minimum.accumulate(cost[order])
        dominated = np.concatenate([[False], cost[order][1:] >= running_min[:-1] - 1e-12])
        order = order[~dominated]
        limit = LABEL_LIMIT if beam is None else beam
        cut = beam is None and len(order) > limit
        if len(order) > limit:
            order = order[np.argsort(lower[order], kind="stable")[:limit]]
        work, cost, ids, parent, first, count, kind = (x[order] for x in (work, cost, ids, parent, first, count, kind))
        new = ids < 0
        if new.any():
            ids = ids.copy()
            ids[new] = records.add(parent[new], first[new], t, count[new], kind[new])
        return (work, cost, ids), cut

    def _extend(self, t: int, front, buckets, best: _Best) -> None:
        """Every segment option from slot t to every later slot, and every completion from t."""
        work, cost, ids = front
        lengths = np.arange(1, self.w - t + 1)
        progress = (lengths[:, None] * self.s - self.delta) * self.opt_rates[None, :]
        ends_work = work[None, None, :] + progress[:, :, None]  # [length, option, label]
        ends_cost = cost[None, None, :] + self.opt_cost[t, t + 1 :][:, :, None]
        running = ends_work < self.work - WORK_EPSILON
        if self.guard:  # safe after a segment's last slot means safe after each of its slots
            running &= self._safe((t + lengths)[:, None, None], self.work - ends_work, self.opt_fallback[None, :, None])
        if self.limit is not None:
            running &= self._segment_within_limit(t, t + lengths[:, None, None], np.arange(len(self.opt_counts))[None, :, None], work, cost)
        if self.w - t > 1:
            self._push(t, ends_work[:-1], ends_cost[:-1], running[:-1], ids, buckets, best.objective)
        option, label = np.nonzero(running[-1])
        self._offer_end(
            ends_work[-1][option, label], ends_cost[-1][option, label], ids[label], best,
            fallback=self.opt_fallback[option], first=np.full(len(label), t),
            counts=self.opt_counts[option], kinds=self.opt_kind[option],
        )
        self._complete(t, work, cost, ids, best)

    def _segment_within_limit(self, first: int, end, option, work: np.ndarray, cost: np.ndarray) -> np.ndarray:
        """Whether labels (window work and cost at slot ``first``) keep the cost limit through a
        segment ``[first, end)`` of ``option`` (arrays broadcast together)."""
        room_cost = self.limit_cost[first, end, option]
        room_floor = self.limit_floor[first, end, option]
        least = self.limit_work[first, end, option]
        return (cost <= room_cost + 1e-9) & (cost - self.lim_price * work <= room_floor + 1e-9) & (work >= least - WORK_EPSILON)

    def _push(self, t: int, ends_work, ends_cost, running, ids, buckets, bound: float) -> None:
        """Queue the segment ends inside the window at their end slot, after the bound test."""
        length, option, label = np.nonzero(running)
        if not len(length):
            return
        end = t + 1 + length
        work = ends_work[length, option, label]
        cost = ends_cost[length, option, label]
        keep = self._lower_bound(end, work, cost) < bound - COST_TOLERANCE
        end, option, label, work, cost = end[keep], option[keep], label[keep], work[keep], cost[keep]
        cuts = np.searchsorted(end, np.arange(t + 2, self.w))
        for slot, part in zip(range(t + 1, self.w), np.split(np.arange(len(end)), cuts)):
            if len(part):
                chosen = option[part]
                firsts = np.full(len(part), t)
                buckets[slot].append(
                    (work[part], cost[part], ids[label[part]], firsts, self.opt_counts[chosen], self.opt_kind[chosen])
                )

    def _complete(self, t: int, work, cost, ids, best: _Best) -> None:
        """Each label finishing the job with each segment option from slot t, billed to the instant."""
        s, delta, options = self.s, self.delta, len(self.opt_counts)
        remaining = np.repeat(self.work - work, options)
        label = np.repeat(np.arange(len(work)), options)
        per_option = (self.opt_rates, self.opt_counts, self.opt_kind, self.opt_fallback)
        rates, counts, kinds, fallback = (np.tile(x, len(work)) for x in per_option)
        slots = self._completion_slots(remaining, rates, delta)
        ok = slots <= self.w - t
        if self.guard:  # safe before the completion slot, and completing by the soft deadline
            before = remaining - rates * ((slots - 1) * s - delta)
            ok &= (slots == 1) | self._safe(t + slots - 1, before, fallback)
            ok &= self.start + t * s + delta + remaining / rates <= self.job.deadline_hours + 1e-9
        if self.limit is not None:  # the slots before the completion slot; finished, the job trails nothing
            option = np.tile(np.arange(options), len(work))
            before_end = t + np.clip(slots - 1, 1, self.w - t)
            ok &= (slots == 1) | self._segment_within_limit(t, before_end, option, work[label], cost[label])
        columns = (remaining, label, rates, counts, kinds, fallback, slots)
        remaining, label, rates, counts, kinds, fallback, slots = (x[ok] for x in columns)
        if not len(label):
            return
        billed = remaining / rates + delta - (slots - 1) * s
        fraction = billed / s
        last = t + slots - 1
        summed = self.cum_price[last] - self.cum_price[t] + fraction[:, None] * self.price[last]
        on_demand = (slots - 1 + fraction) * self.od
        cap = self.cap[t, last + 1] * ~fallback[:, None]
        segment = _fill_cost_n(summed, cap, on_demand, counts) * s
        hours = self.start + t * s + delta + remaining / rates
        objective = cost[label] + segment - self._value(hours)
        if self.limit is not None:
            objective = np.where(cost[label] + segment <= self.lim_cap[last] + 1e-9, objective, np.inf)
        i = int(np.argmin(objective))
        if objective[i] < best.objective:
            best.improve(
                float(objective[i]), int(ids[label[i]]), t, int(last[i]) + 1, int(counts[i]), int(kinds[i]),
                float(fraction[i]), float(hours[i]),
            )

    def _completion_slots(self, remaining: np.ndarray, rate, overhead: float) -> np.ndarray:
        """Slots k >= 1 of a segment until it completes: the first k with H*(k*s - overhead) >= R - eps."""
        k = np.maximum(np.ceil(((remaining - WORK_EPSILON) / rate + overhead) / self.s), 1).astype(np.int64)
        k = np.where(rate * (k * self.s - overhead) < remaining - WORK_EPSILON, k + 1, k)
        return np.where((k > 1) & (rate * ((k - 1) * self.s - overhead) >= remaining - WORK_EPSILON), k - 1, k)

    def _continue_previous(self, front, buckets, best: _Best) -> None:
        """Keep ``previous`` unchanged from slot 0: no overhead, for as long as it fits."""
        if not self.cont_ok or self.cont_end == 0:
            return
        work0, root = float(front[0][0]), front[2][:1]
        s, rate, prev, fallback = self.s, self.cont_rate, self.request.previous, self.cont_is_fallback
        ends = np.arange(1, self.cont_end + 1)
        ends_work = work0 + rate * ends * s
        ends_cost = self.cont_cost[ends]
        running = ends_work < self.work - WORK_EPSILON
        if self.guard:
            running &= self._safe(ends, self.work - ends_work, fallback)
        kept_so_far = np.logical_and.accumulate(self._within_limit(ends - 1, ends_work, ends_cost, fallback))
        running &= kept_so_far
        segment = (root, np.array([0]), np.array([prev.total]), np.array([_CONTINUE]))
        for end in ends[running & (ends < self.w)]:
            buckets[end].append((ends_work[end - 1 : end], ends_cost[end - 1 : end], *segment))
        if self.cont_end == self.w and running[-1]:
            self._offer_end(
                ends_work[-1:], ends_cost[-1:], root, best,
                fallback=fallback, first=segment[1], counts=segment[2], kinds=segment[3],
            )
        remaining = self.work - work0
        k = int(self._completion_slots(np.array([remaining]), rate, 0.0)[0])
        billed = remaining / rate - (k - 1) * s
        hours = self.start + remaining / rate
        if k > self.cont_end or (k > 1 and not kept_so_far[k - 2]):
            return
        if self.guard:
            late = hours > self.job.deadline_hours + 1e-9
            if late or (k > 1 and not self._safe(k - 1, remaining - rate * (k - 1) * s, fallback)):
                return
        spent = self.cont_cost[k - 1] + billed * self.cont_hourly[k - 1]
        if self.limit is not None and spent > self.lim_cap[k - 1] + 1e-9:
            return
        objective = spent - float(self._value(np.array([hours]))[0])
        if objective < best.objective:
            best.improve(float(objective), int(root[0]), 0, k, prev.total, _CONTINUE, billed / s, hours)

    def _offer_end(self, work, cost, ids, best: _Best, fallback, first=None, counts=None, kinds=None) -> None:
        """Schedules that stop unfinished at the window's end: a last segment, or a label paused to it."""
        if not len(work):
            return
        objective = self._end_objective(work, cost, fallback)
        i = int(np.argmin(objective))
        if objective[i] < best.objective:
            if first is None:
                best.improve(float(objective[i]), int(ids[i]))
            else:
                best.improve(float(objective[i]), int(ids[i]), int(first[i]), self.w, int(counts[i]), int(kinds[i]))

    # ----- plan ---------------------------------------------------------------------------
    def _vector(self, first: int, end: int, count: int, kind: int, fraction: float | None) -> Allocation:
        """The allocation vector of a segment [first, end), as the tables priced it."""
        if kind == _CONTINUE:
            return self.request.previous
        if kind == _FALLBACK:
            return Allocation((0,) * self.pools, self.n_max)
        full = end - 1 if fraction is not None else end
        weight = fraction if fraction is not None else 0.0
        summed = self.cum_price[full] - self.cum_price[first] + weight * self.price[end - 1]
        on_demand = (full - first + weight) * self.od
        return cheapest_allocation(count, summed, self.cap[first, end], on_demand)

    def _rebuild(self, best: _Best, records: dict[str, np.ndarray]) -> list[Allocation]:
        """The plan's allocations: walk the labels back from the best schedule's end."""
        length = best.end if best.completion_hours is not None else self.w
        allocations = [Allocation.idle(self.pools)] * length
        segments = []
        if best.kind:
            fraction = best.fraction if best.completion_hours is not None else None
            segments.append((best.first, best.end, best.count, best.kind, fraction))
        label = best.parent
        while records["parent"][label] >= 0:
            first, end, count, kind = (int(records[name][label]) for name in ("first", "end", "count", "kind"))
            segments.append((first, end, count, kind, None))
            label = int(records["parent"][label])
        for first, end, count, kind, fraction in segments:
            allocations[first:end] = [self._vector(first, end, count, kind, fraction)] * (end - first)
        return allocations
