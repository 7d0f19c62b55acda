"""The paper's integer program (arXiv 2512.20967, generalised to M spot pools), in PuLP.

It answers the question :func:`planner.solve_plan` answers with a dynamic program, the
allocations of a window of slots that minimise cost (+ terminal cost) - value, with a MILP solver
instead, so that each checks the other. It is exact on the spec's model: reconfiguration
overhead, per-second billing of the completion slot and the value function are modelled without
approximation. ``docs/integer-program.md`` derives every constraint and why each linearisation
is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pulp

from airflow_provider_spotsched.scheduling.model import Allocation, Progress, advance
from airflow_provider_spotsched.scheduling.planner import Plan, PlanError, PlanRequest

SOLVERS = ("auto", "highs", "cbc")
# Stop when the incumbent is within this much of the bound: exact up to float round-off.
GAP_RELATIVE = 1e-9
GAP_ABSOLUTE = 1e-7


def whole_counts(available: np.ndarray) -> np.ndarray:
    """Instances obtainable: forecasts may be fractional or negative; only whole ones count."""
    return np.maximum(np.floor(np.asarray(available, dtype=float)), 0).astype(np.int64)


@dataclass(frozen=True)
class PoolReduction:
    """Exact symmetry breaking: the pools that get variables and the order imposed between them.

    ``order`` holds pairs ``(a, b)`` meaning ``s[t][a] >= s[t][b]`` in every slot. Both index the
    request's pools.
    """

    kept: tuple[int, ...]
    order: tuple[tuple[int, int], ...]


def reduce_pools(request: PlanRequest) -> PoolReduction:
    """Drop pools no optimal plan needs and order pools that one dominates another.

    A pool never available, or never cheaper than on-demand (its instances can move to
    on-demand), gets no variables unless ``previous`` uses it. Pool a dominates pool b when it
    is at least as cheap and at least as available in every slot of the window and
    ``previous`` holds at least as many in a as in b; then some optimal plan has
    ``s[t][a] >= s[t][b]`` throughout (swapping the counts of a violating pair keeps every slot
    feasible, costs no more and changes the vector only when the original changed). Identical
    pools are the special case, ordered by index; only the covering pairs are kept.
    """
    price, available = np.asarray(request.spot_price, dtype=float), whole_counts(request.available)
    previous = request.previous.spot
    kept = tuple(
        m
        for m in range(price.shape[1])
        if available[:, m].max() > 0 and (previous[m] > 0 or (price[:, m] < request.on_demand_price).any())
    )

    def dominates(a: int, b: int) -> bool:
        cheaper = (price[:, a] <= price[:, b]).all()
        return bool(cheaper and (available[:, a] >= available[:, b]).all() and previous[a] >= previous[b])

    relation = {(a, b) for a in kept for b in kept if a != b and dominates(a, b) and not (dominates(b, a) and b < a)}
    covering = tuple(
        sorted((a, b) for a, b in relation if not any((a, c) in relation and (c, b) in relation for c in kept))
    )
    return PoolReduction(kept, covering)


@dataclass
class MilpModel:
    """A built integer program of one request, and how its solution becomes a plan."""

    request: PlanRequest
    problem: pulp.LpProblem
    spot: dict[tuple[int, int], pulp.LpVariable]
    on_demand: list[pulp.LpVariable]
    level: dict[tuple[int, int], pulp.LpVariable]

    def solve(
        self, time_limit: float | None = None, solver: str = "auto", warm_start: Sequence[Allocation] | None = None
    ) -> Plan:
        """Solve, and return the plan with the spec's accounting of its allocations.

        ``warm_start`` (allocations from slot 0, idle after they end) is a plan for the solver to
        improve on; it is dropped if it breaks a constraint.
        """
        if warm_start is not None:
            self._start_from(warm_start)
        self.problem.solve(_solver(solver, time_limit, warm_start is not None))
        if self.problem.status == pulp.LpStatusInfeasible:
            raise PlanError(
                "no plan keeps the job able to finish by its soft deadline on N_max on-demand instances "
                "(deadline_safe_end or deadline_safe is set); the state is already unsafe: run the on-demand fallback"
            )
        if self.problem.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            raise RuntimeError(
                f"the MILP solver found no plan (status {pulp.LpStatus[self.problem.status]}); "
                f"raise time_limit (now {time_limit})"
            )
        allocations, objective, completion = _account(self.request, self.allocations())
        return Plan(allocations, objective, completion, self.problem.sol_status == pulp.LpSolutionOptimal)

    @property
    def bound(self) -> float | None:
        """The solver's proven lower bound of the objective after :meth:`solve` (HiGHS only)."""
        highs = getattr(self.problem, "solverModel", None)
        return None if highs is None else float(highs.getInfo().mip_dual_bound)

    def _start_from(self, allocations: Sequence[Allocation]) -> None:
        """Give the counts and levels their values in ``allocations``; the solver completes the rest."""
        width = len(self.on_demand)
        plan = list(allocations)[:width]
        plan += [Allocation.idle(len(self.request.previous.spot))] * (width - len(plan))
        for (t, m), variable in self.spot.items():
            variable.setInitialValue(plan[t].spot[m])
        for t, variable in enumerate(self.on_demand):
            variable.setInitialValue(plan[t].on_demand)
        for (t, n), variable in self.level.items():
            variable.setInitialValue(int(plan[t].total == n))

    def allocations(self) -> list[Allocation]:
        """The solved allocation of every slot of the window."""
        pools = len(self.request.previous.spot)
        return [
            Allocation(tuple(_integer(self.spot.get((t, m))) for m in range(pools)), _integer(od))
            for t, od in enumerate(self.on_demand)
        ]


def _integer(variable: pulp.LpVariable | None) -> int:
    return 0 if variable is None else int(round(variable.varValue or 0.0))


@dataclass(frozen=True)
class _Component:
    """One entry of the allocation vector as the program sees it: a spot pool or on-demand."""

    name: str
    counts: list  # per slot: the integer variable, or 0 where nothing is available
    bounds: list[int]
    prices: list[float]


def build_model(request: PlanRequest, reduction: PoolReduction | None = None) -> MilpModel:
    """The integer program of ``request``: minimise cost (+ terminal cost) - value."""
    return _Formulation(request, reduction or reduce_pools(request)).model


class _Formulation:
    """Builds one request's program, one family of variables and constraints per method.

    Work is measured as a fraction of the work left at the window's start, so every progress
    coefficient is O(1) whatever the job's units.
    """

    def __init__(self, request: PlanRequest, reduction: PoolReduction) -> None:
        job = self.job = request.job
        self.request, self.reduction = request, reduction
        self.price = np.asarray(request.spot_price, dtype=float)
        self.available = whole_counts(request.available)
        width = self.price.shape[0]
        self.slots = range(width)
        self.levels = range(job.min_instances, job.max_instances + 1)
        self.rate = {n: job.rate(n) for n in self.levels}
        self.left = job.work - request.work_done
        self.prob = pulp.LpProblem("spotsched", pulp.LpMinimize)
        self._decisions()
        self._symmetry()
        self.keep = self._reconfiguration() if job.reconfig_overhead_hours > 0 else {}
        self._completion()
        objective = self._cost() - self._refund() - self._value()
        if request.terminal_cost_per_work is not None:
            objective += self._terminal(request.terminal_cost_per_work)
        if request.deadline_safe:
            self._deadline_guard()
        elif request.deadline_safe_end:
            self._safe_after(self.slots[-1])
        self.prob += objective
        self.model = MilpModel(request, self.prob, self.spot, self.od, self.level)

    def _bound(self, t: int, m: int) -> int:
        return int(min(self.available[t, m], self.job.max_instances))

    def _decisions(self) -> None:
        """Spot and on-demand counts, and the one-hot instance level (no level = paused)."""
        job, prob = self.job, self.prob
        self.spot = {
            (t, m): self.prob.add_variable(f"s_{t}_{m}", 0, self._bound(t, m), cat="Integer")
            for t in self.slots
            for m in self.reduction.kept
            if self._bound(t, m) > 0
        }
        self.od = [self.prob.add_variable(f"od_{t}", 0, job.max_instances, cat="Integer") for t in self.slots]
        self.level = {(t, n): prob.add_variable(f"y_{t}_{n}", cat="Binary") for t in self.slots for n in self.levels}
        self.components = [
            _Component(
                f"p{m}",
                [self.spot.get((t, m), 0) for t in self.slots],
                [self._bound(t, m) for t in self.slots],
                [float(self.price[t, m]) for t in self.slots],
            )
            for m in self.reduction.kept
        ]
        width = len(self.slots)
        self.components.append(
            _Component("od", list(self.od), [job.max_instances] * width, [self.request.on_demand_price] * width)
        )
        self.running = [pulp.lpSum(self.level[t, n] for n in self.levels) for t in self.slots]
        for t in self.slots:
            total = pulp.lpSum(c.counts[t] for c in self.components)
            prob += total == pulp.lpSum(n * self.level[t, n] for n in self.levels)
            prob += self.running[t] <= 1

    def _symmetry(self) -> None:
        for a, b in self.reduction.order:
            for t in self.slots:
                if (t, b) in self.spot:
                    self.prob += self.spot[t, a] >= self.spot[t, b]

    def _reconfiguration(self) -> dict[tuple[int, int], pulp.LpVariable]:
        """keep[t, n] = 1 only if slot t runs, at level n, the vector of slot t-1 (or ``previous``).

        ``same[t, c] <= min(x[t][c], x[t-1][c])`` counts the instances of component c that slot t
        shares with slot t-1; keeping asks them to add up to the level n, which both slots run,
        so every component is equal. (This overlap form has a far tighter LP than big-M rows on
        the differences.) Keeping earns progress, so the solver keeps wherever the vectors are
        equal: the running slots without keep are exactly the spec's reconfigurations.
        """
        job, prob, previous = self.job, self.prob, self.request.previous
        keep = {}
        if job.min_instances <= previous.total <= job.max_instances and all(
            c <= a for c, a in zip(previous.spot, self.available[0])
        ):
            keep[0, previous.total] = self.prob.add_variable(f"k_0_{previous.total}", cat="Binary")
        for t in self.slots[1:]:
            for n in self.levels:
                keep[t, n] = self.prob.add_variable(f"k_{t}_{n}", cat="Binary")
                prob += keep[t, n] <= self.level[t - 1, n]
        carried = [previous.spot[m] for m in self.reduction.kept] + [previous.on_demand]
        for t in self.slots:
            held = [(n, keep[t, n]) for n in self.levels if (t, n) in keep]
            for n, v in held:
                prob += v <= self.level[t, n]
            shared = []
            for c, before in zip(self.components, carried):
                earlier, room = (before, before) if t == 0 else (c.counts[t - 1], c.bounds[t - 1])
                if held and c.bounds[t] > 0 and room > 0:
                    same = prob.add_variable(f"o_{c.name}_{t}", 0)
                    prob += same <= c.counts[t]
                    prob += same <= earlier
                    shared.append(same)
            if held:
                prob += pulp.lpSum(shared) == pulp.lpSum(n * v for n, v in held)
        return keep

    def _effective(self, t: int, n: int) -> pulp.LpAffineExpression:
        """Effective hours of slot t if it runs at level n (0 otherwise): s - delta, or s if kept."""
        s, delta = self.job.slot_hours, self.job.reconfig_overhead_hours
        kept = delta * self.keep[t, n] if (t, n) in self.keep else 0
        return (s - delta) * self.level[t, n] + kept

    def _completion(self) -> None:
        """Cumulative work, the completion slot, and the completion slot's unbilled hours.

        ``unused[t, n]``, nonzero only in the completion slot at its level, is the slot's time
        after T; it turns the slot's excess work (work done beyond what was left) into hours at
        the fixed rate H(n), which is what makes T and the billed time linear.
        """
        prob, s = self.prob, self.job.slot_hours
        self.done = [self.prob.add_variable(f"c_{t}", cat="Binary") for t in self.slots]
        self.unused = {(t, n): self.prob.add_variable(f"u_{t}_{n}", 0, s) for t in self.slots for n in self.levels}
        self.unbilled = [self.prob.add_variable(f"ub_{t}", 0, s) for t in self.slots]
        self.work = [self.prob.add_variable(f"w_{t}", 0) for t in self.slots]
        finished = [self.prob.add_variable(f"f_{t}", 0, 1) for t in self.slots]
        excess = [self.prob.add_variable(f"e_{t}", 0) for t in self.slots]
        for t in self.slots:
            progress = pulp.lpSum(self.rate[n] / self.left * self._effective(t, n) for n in self.levels)
            surplus = pulp.lpSum(self.rate[n] / self.left * self.unused[t, n] for n in self.levels)
            if t == 0:
                prob += self.work[t] == progress
                prob += finished[t] == self.done[t]
                prob += excess[t] == surplus
            else:
                prob += self.work[t] == self.work[t - 1] + progress
                prob += finished[t] == finished[t - 1] + self.done[t]
                prob += excess[t] == excess[t - 1] + surplus
                prob += self.running[t] + finished[t - 1] <= 1
            # Done by t needs all the work by t, plus the completion slot's excess.
            prob += finished[t] + excess[t] <= self.work[t]
            prob += self.done[t] <= self.running[t]
            for n in self.levels:
                prob += self.unused[t, n] <= self._effective(t, n)
            prob += self.unbilled[t] == pulp.lpSum(self.unused[t, n] for n in self.levels)
            prob += self.unbilled[t] <= s * self.done[t]
        self.ends = [self.request.start_hours + (t + 1) * s for t in self.slots]
        self.completion = pulp.lpSum(e * c for e, c in zip(self.ends, self.done)) - pulp.lpSum(self.unbilled)

    def _cost(self) -> pulp.LpAffineExpression:
        """Every running slot billed in full; :meth:`_refund` takes back the completion slot's rest."""
        s = self.job.slot_hours
        return pulp.lpSum(s * c.prices[t] * c.counts[t] for c in self.components for t in self.slots)

    def _refund(self) -> pulp.LpAffineExpression:
        """The completion slot's unbilled part: sum over components of price * count * unbilled.

        count * unbilled multiplies an integer by a continuous variable. Only the completion slot
        has unbilled hours, so one binary expansion of that slot's counts is exact: ``bits[c, j]``
        may be 1 only if the completion slot's count of c has the bit 2**j, and each
        ``part[c, j] <= 2**j * (price * unbilled)``, ``<= 2**j * max price * slot_hours * bit``.
        McCormick rows on hourly price * unbilled, per slot and level, are added for the LP bound.
        """
        prob, s = self.prob, self.job.slot_hours
        envelope = []
        for t in self.slots:
            hourly = pulp.lpSum(c.prices[t] * c.counts[t] for c in self.components)
            share = self.prob.add_variable(f"rm_{t}", 0)
            prob += share <= pulp.lpSum(self._fill(t, n, dearest=True) * self.unused[t, n] for n in self.levels)
            prob += share <= s * hourly - pulp.lpSum(
                self._fill(t, n, dearest=False) * (s * self.level[t, n] - self.unused[t, n]) for n in self.levels
            )
            envelope.append(share)
        parts = []
        for c in self.components:
            top = max(c.bounds)
            if top == 0:
                continue
            paid = pulp.lpSum(p * u for p, u in zip(c.prices, self.unbilled))
            bits = [self.prob.add_variable(f"b_{c.name}_{j}", cat="Binary") for j in range(top.bit_length())]
            expansion = pulp.lpSum(2**j * b for j, b in enumerate(bits))
            for t in self.slots:
                prob += expansion <= c.counts[t] + top * (1 - self.done[t])
            for j, b in enumerate(bits):
                part = self.prob.add_variable(f"r_{c.name}_{j}", 0)
                prob += part <= 2**j * paid
                prob += part <= 2**j * max(c.prices) * s * b
                parts.append(part)
        prob += pulp.lpSum(parts) <= pulp.lpSum(envelope)
        return pulp.lpSum(parts)

    def _fill(self, t: int, n: int, dearest: bool) -> float:
        """Hourly price of the cheapest (or the dearest) n instances obtainable in slot t."""
        offers = sorted(((c.prices[t], c.bounds[t]) for c in self.components), reverse=dearest)
        total, rest = 0.0, n
        for price, count in offers:
            take = min(count, rest)
            total += take * price
            rest -= take
        return total

    def _value(self) -> pulp.LpVariable:
        """V(T): at most V0 if done by the value limit, and at most the linear decay after d.

        Maximised, the smaller of the two upper bounds is V(T), concave up to gamma*d. The one slot
        that straddles the limit (gamma*d; d when gamma = 1) splits its completion into an on-time
        part, which must have T <= limit, and a late part, which earns nothing.
        """
        job, prob = self.job, self.prob
        s, d, gamma, v0 = job.slot_hours, job.deadline_hours, job.hard_deadline_factor, job.value
        limit = gamma * d
        on_time = []
        late = []
        for t, end in enumerate(self.ends):
            if end <= limit + 1e-9:
                on_time.append(self.done[t])
            elif end - s >= limit - 1e-9:
                late.append((end, self.done[t]))
            else:
                split = self.prob.add_variable(f"c_ok_{t}", cat="Binary")
                prob += split <= self.done[t]
                prob += self.completion <= limit + (self.ends[-1] - limit) * (1 - split)
                on_time.append(split)
                late.append((end, self.done[t] - split))
        value = self.prob.add_variable("value", 0)
        prob += value <= v0 * pulp.lpSum(on_time)
        if gamma > 1:
            slope = v0 / ((gamma - 1) * d)
            slack = pulp.lpSum(slope * (end - limit) * c for end, c in late)
            prob += value <= slope * (limit - self.completion) + slack
        return value

    def _terminal(self, price: float) -> pulp.LpAffineExpression:
        """``price`` (the request's terminal_cost_per_work) times the work still left at the window's end."""
        rest = self.prob.add_variable("rest", 0)
        self.prob += rest >= 1 - self.work[-1]
        return price * self.left * rest

    def _safe_after(self, t: int) -> None:
        """After slot t, the work left is finishable by d on N_max on-demand instances.

        As :func:`rules.is_deadline_safe` has it, the fallback pays the overhead unless slot t
        already runs it (``fallback`` = 1). Finished work (none left) is always safe.
        """
        job, prob = self.job, self.prob
        n_max, delta = job.max_instances, job.reconfig_overhead_hours
        hours = job.deadline_hours - self.ends[t]
        capacity = job.rate(n_max) / self.left
        fallback = self.prob.add_variable(f"fb_{t}", cat="Binary")
        prob += fallback <= self.level[t, n_max]
        prob += n_max * fallback <= self.od[t]
        if hours >= delta:
            reach = capacity * (hours - delta + delta * fallback)
        elif hours > 0:
            reach = capacity * hours * fallback
        else:
            reach = 0
        prob += 1 - self.work[t] <= reach

    def _deadline_guard(self) -> None:
        """The planner's ``deadline_safe``: safe after every slot, and done by d if done at all.

        Safety after every slot forces completion by the end of the slot holding d (if the
        window reaches it), so done-by-d is one row there: the work by the instant d, linear
        per level like the slot's progress, covers what was left.
        """
        job, s, delta = self.job, self.job.slot_hours, self.job.reconfig_overhead_hours
        d = job.deadline_hours
        if self.request.start_hours >= d - 1e-9:
            raise PlanError(
                f"deadline_safe asks for completion by deadline_hours={d:g}, but the window starts at "
                f"{self.request.start_hours:g} h: the state is already unsafe, run the on-demand fallback"
            )
        for t in self.slots:
            self._safe_after(t)
        for t, end in enumerate(self.ends):
            into = d - (end - s)
            if 1e-9 < into < s - 1e-9:
                before = self.work[t - 1] if t > 0 else 0
                running = max(into - delta, 0.0)
                by_d = pulp.lpSum(
                    self.rate[n]
                    / self.left
                    * (running * self.level[t, n] + ((into - running) * self.keep[t, n] if (t, n) in self.keep else 0))
                    for n in self.levels
                )
                self.prob += before + by_d >= 1


class _HiGHS(pulp.HiGHS):
    """pulp.HiGHS that also hands HiGHS the variables' initial values, as a partial MIP start."""

    def callSolver(self, lp: pulp.LpProblem) -> None:
        start = [(v.index, v.varValue) for v in lp.variables() if v.varValue is not None]
        if start:
            index, value = zip(*start)
            lp.solverModel.setSolution(len(start), np.array(index, dtype=np.int32), np.array(value, dtype=float))
        super().callSolver(lp)


def _solver(name: str, time_limit: float | None, warm: bool) -> pulp.LpSolver:
    if name not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {name!r}")
    highs = _HiGHS(msg=False, timeLimit=time_limit, gapRel=GAP_RELATIVE, gapAbs=GAP_ABSOLUTE)
    if name == "highs" or (name == "auto" and highs.available()):
        if not highs.available():
            raise ValueError("solver='highs' needs highspy; install it or use solver='cbc'")
        return highs
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=GAP_RELATIVE, gapAbs=GAP_ABSOLUTE, warmStart=warm)


def _account(request: PlanRequest, allocations: list[Allocation]) -> tuple[list[Allocation], float, float | None]:
    """The spec's accounting of ``allocations`` from the request's state, through model.advance.

    Returns the allocations up to completion, cost (+ terminal cost) - value, and T.
    """
    job = request.job
    first = round(request.start_hours / job.slot_hours)
    progress = Progress(slot=first, work_done=request.work_done, previous=request.previous)
    used = []
    for t, allocation in enumerate(allocations):
        if progress.done:
            break
        used.append(allocation)
        advance(job, progress, allocation, request.spot_price[t], request.on_demand_price)
    objective = progress.cost - job.value_at(progress.completion_hours)
    if not progress.done and request.terminal_cost_per_work is not None:
        objective += request.terminal_cost_per_work * max(job.work - progress.work_done, 0.0)
    return used, objective, progress.completion_hours


def solve_milp(
    request: PlanRequest,
    time_limit: float | None = None,
    solver: str = "auto",
    warm_start: Sequence[Allocation] | None = None,
) -> Plan:
    """The plan that minimises cost (+ terminal cost) - value, by the integer program.

    ``solver`` is ``"highs"``, ``"cbc"`` or ``"auto"`` (HiGHS when highspy is installed). With a
    ``time_limit`` (seconds) the best plan found is returned and ``proven_optimal`` says whether
    the solver proved it optimal. ``warm_start`` is a plan to start from (e.g. a policy's). The
    plan's numbers are the spec's accounting of its allocations.
    """
    return build_model(request).solve(time_limit, solver, warm_start)
