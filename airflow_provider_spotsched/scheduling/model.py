"""The scheduling model of ``shared/spec/scheduling-model.md``: job, allocation and accounting.

This module is the one place where progress, reconfiguration, billing, completion time, value
and utility are computed. The simulator, every policy that needs a number and every report call
:func:`advance` (one slot) or :func:`evaluate` (a whole schedule) instead of re-deriving them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

# Progress within this many work units of the total counts as done (float round-off only).
WORK_EPSILON = 1e-9

DEFAULT_MAX_INSTANCES_LIMIT = 1024
"""The most instances a job may ask for unless its caller raises the limit: a typo such as
``max_instances=10**12`` is refused instead of planned for (and allocated)."""

MIN_SLOT_HOURS = 1 / 60
"""One minute: shorter slots cannot change what runs (instances take minutes to start), and a
week of history would take millions of them."""

MAX_COUNT = 2**53
"""The largest whole number a float holds exactly."""

MAX_HORIZON_SLOTS = 100_000
"""The most slots up to a job's hard deadline (11 years of hourly slots): more is a typo in
``slot_hours`` or ``deadline_hours``, which would make every policy plan over millions of slots."""


class JobError(ValueError):
    """A job description is invalid or infeasible; the message names the field and the fix."""


@dataclass(frozen=True)
class Throughput:
    """Work units per hour on ``n`` instances: ``H(n) = alpha * n + beta`` for n >= 1, H(0) = 0."""

    alpha: float
    beta: float = 0.0

    def __call__(self, n: int) -> float:
        return self.alpha * n + self.beta if n > 0 else 0.0


@dataclass(frozen=True)
class Job:
    """A fine-tuning job as the spec defines it (all times in hours after submission)."""

    work: float
    deadline_hours: float
    max_instances: int
    throughput: Throughput
    value: float
    min_instances: int = 1
    hard_deadline_factor: float = 1.0
    reconfig_overhead_hours: float = 0.0
    slot_hours: float = 1.0
    start: datetime | None = None

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def hard_deadline_hours(self) -> float:
        return self.hard_deadline_factor * self.deadline_hours

    @property
    def horizon_slots(self) -> int:
        """Slots up to the hard deadline: nothing after it can earn value."""
        return max(1, math.ceil(self.hard_deadline_hours / self.slot_hours - 1e-9))

    def rate(self, n: int) -> float:
        return self.throughput(n)

    def value_at(self, completion_hours: float | None) -> float:
        """V(T): full value by the soft deadline, linear decay to the hard one, then 0."""
        if completion_hours is None:
            return 0.0
        d, gamma = self.deadline_hours, self.hard_deadline_factor
        if completion_hours <= d + 1e-9:
            return self.value
        if gamma <= 1.0 or completion_hours > gamma * d + 1e-9:
            return 0.0
        return self.value * (gamma * d - completion_hours) / ((gamma - 1.0) * d)

    def check_instances(self, max_instances_limit: int = DEFAULT_MAX_INSTANCES_LIMIT) -> None:
        """Refuse more instances than the caller allows, before anything is planned or launched."""
        if self.max_instances > max_instances_limit:
            raise JobError(
                f"max_instances={self.max_instances}: more than the limit of {max_instances_limit} instances; "
                "lower max_instances, or raise max_instances_limit if the job really needs that many"
            )

    def check_feasible(self, max_instances_limit: int = DEFAULT_MAX_INSTANCES_LIMIT) -> None:
        """Refuse a job over the instance limit, or one that N_max on-demand instances cannot
        finish by the soft deadline."""
        self.check_instances(max_instances_limit)
        effective = self.deadline_hours - self.reconfig_overhead_hours  # > 0: overhead < slot <= deadline
        capacity = effective * self.rate(self.max_instances)
        if capacity + WORK_EPSILON < self.work:
            needed_hours = self.work / self.rate(self.max_instances) + self.reconfig_overhead_hours
            needed_n = (self.work / effective - self.throughput.beta) / self.throughput.alpha
            more = f" or max_instances >= {math.ceil(needed_n)}" if math.isfinite(needed_n) else ""
            raise JobError(
                f"job is infeasible: {self.max_instances} on-demand instances finish only "
                f"{capacity:.4g} of work={self.work:.4g} units by deadline_hours={self.deadline_hours:g}; "
                f"set deadline_hours >= {needed_hours:.4g}{more}"
            )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["start"] = None if self.start is None else self.start.strftime("%Y-%m-%dT%H:%M:%SZ")
        if data["start"] is None:
            del data["start"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Job:
        """Build a job from the spec's JSON object, naming any unknown or missing field."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise JobError(f"unknown job field(s) {unknown}; known fields are {sorted(known)}")
        missing = sorted(k for k in ("work", "deadline_hours", "max_instances", "throughput", "value") if k not in data)
        if missing:
            raise JobError(f"job is missing required field(s) {missing}")
        fields = dict(data)
        tp = check_throughput(fields["throughput"])
        fields["throughput"] = Throughput(
            as_number("throughput.alpha", tp["alpha"]), as_number("throughput.beta", tp.get("beta", 0.0))
        )
        if fields.get("start") is not None:
            from airflow_provider_spotsched.market.trace import parse_timestamp

            try:
                fields["start"] = parse_timestamp(str(fields["start"]))
            except (ValueError, OverflowError):
                raise JobError(
                    f"start={shown(fields['start'])}: not a UTC ISO-8601 timestamp; give one like 2025-10-04T00:10:00Z"
                ) from None
        return cls(**fields)


def check_throughput(tp: object) -> Mapping[str, Any]:
    """``tp`` as the throughput object, refusing one without ``alpha`` or with any other key:
    a typo such as ``bta`` would otherwise plan with beta = 0."""
    if not isinstance(tp, Mapping) or "alpha" not in tp:
        raise JobError(f'throughput={shown(tp)}: not an object with alpha; give {{"alpha": 1.0, "beta": 0.0}}')
    extra = sorted(set(tp) - {"alpha", "beta"})
    if extra:
        raise JobError(f"unknown throughput field(s) {extra}; use alpha and beta")
    return tp


def shown(value: object) -> str:
    """``repr(value)`` cut short: an error about junk input stays one readable line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_number(value: object) -> bool:
    """A finite int or float: a bool, text (a command-line value), NaN or infinity is not."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def as_number(name: str, value: object) -> float:
    """``value`` as a float, refusing what only looks like a number: a bool, text, NaN, infinity."""
    if isinstance(value, str):
        raise JobError(f"{name}={shown(value)}: text, not a number; write the number without quotes")
    if isinstance(value, bool):
        raise JobError(f"{name}={shown(value)}: a boolean, not a number; give a number")
    if not isinstance(value, (int, float)):
        raise JobError(f"{name}={shown(value)}: not a number; give a finite number")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise JobError(f"{name}={shown(value)}: not a finite number; give a finite number")
    return number


def as_count(name: str, value: object) -> int:
    """``value`` as an instance count: an integer, never a bool (JSON ``true`` is no count), and
    one a float holds exactly (the model computes H(n) in floats)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise JobError(f"{name}={shown(value)}: not an integer; give a whole number of instances")
    if abs(int(value)) > MAX_COUNT:
        raise JobError(f"{name}={shown(value)}: too large to count instances; give a whole number of instances")
    return int(value)


FIELD_RULES: dict[str, tuple[bool, float, bool, str]] = {
    "work": (False, 0, False, "give the job's size in work units (e.g. training samples)"),
    "deadline_hours": (False, 0, False, "give the soft deadline in hours after submission"),
    "value": (False, 0, True, "give the USD that finishing by the deadline is worth"),
    "slot_hours": (False, MIN_SLOT_HOURS, True, "a slot lasts a minute or more (instances take minutes to start); give "
                   "its length in hours, e.g. 1.0"),
    "hard_deadline_factor": (False, 1, True, "the hard deadline is this multiple of deadline_hours; use 1 for none"),
    "reconfig_overhead_hours": (False, 0, True, "give the compute hours a reconfiguration loses"),
    "min_instances": (True, 1, True, "a running job uses at least one instance"),
    "max_instances": (True, 1, True, "a running job uses at least one instance"),
    "throughput.alpha": (False, 0, False, "give the work units per hour each instance adds"),
}
"""A field's rule on its own: (an integer?, its bound, whether the bound is allowed, the fix).
The operator checks an argument no template will change with these when the DAG is parsed."""


def check_field(name: str, value: object) -> None:
    """Refuse ``value`` for job field ``name`` (or ``throughput.alpha``/``.beta``) on its own."""
    integer, bound, inclusive, fix = FIELD_RULES.get(name, (False, -math.inf, True, ""))
    number = as_count(name, value) if integer else as_number(name, value)
    if number < bound or (number == bound and not inclusive):
        raise JobError(f"{name}={number:g}: must be {'>=' if inclusive else '>'} {bound:g}; {fix}")


def check_overhead(reconfig_overhead_hours: float, slot_hours: float) -> None:
    """Refuse an overhead of a slot or more: a reconfiguration slot would make no progress."""
    if reconfig_overhead_hours >= slot_hours:
        raise JobError(
            f"reconfig_overhead_hours={reconfig_overhead_hours:g}: must be < slot_hours={slot_hours:g}; "
            "a reconfiguration loses less than one slot"
        )


def _validate(job: Job) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise JobError(message)

    fields = {name: getattr(job, name) for name in FIELD_RULES if "." not in name}
    for name, value in {**fields, "throughput.alpha": job.throughput.alpha, "throughput.beta": job.throughput.beta}.items():
        check_field(name, value)
    check_overhead(job.reconfig_overhead_hours, job.slot_hours)
    need(
        job.slot_hours <= job.deadline_hours,
        f"slot_hours={job.slot_hours:g}: longer than deadline_hours={job.deadline_hours:g}, so the first slot "
        "ends past the deadline; use slot_hours <= deadline_hours",
    )
    slots = job.hard_deadline_factor * job.deadline_hours / job.slot_hours
    need(
        slots <= MAX_HORIZON_SLOTS,
        f"deadline_hours={job.deadline_hours:g}: with slot_hours={job.slot_hours:g} the job spans {slots:.3g} slots "
        f"to its hard deadline, more than {MAX_HORIZON_SLOTS}; use longer slots or a nearer deadline",
    )
    need(
        job.min_instances <= job.max_instances,
        f"max_instances={job.max_instances}: must be >= min_instances={job.min_instances}; "
        "raise max_instances or lower min_instances",
    )
    tp = job.throughput
    need(
        tp(job.min_instances) > 0,
        f"throughput.beta={tp.beta:g}: H(min_instances={job.min_instances}) is not > 0; raise throughput.beta",
    )
    need(
        math.isfinite(tp(job.max_instances)),
        f"throughput.alpha={tp.alpha:g}: H(max_instances={job.max_instances}) overflows; give the work units per hour "
        "each instance adds",
    )


@dataclass(frozen=True)
class Allocation:
    """Instances in one slot: ``spot[m]`` in pool m and ``on_demand`` on-demand ones."""

    spot: tuple[int, ...]
    on_demand: int = 0

    @property
    def total(self) -> int:
        return sum(self.spot) + self.on_demand

    @classmethod
    def idle(cls, num_pools: int) -> Allocation:
        return cls((0,) * num_pools, 0)

    def hourly_price(self, spot_prices: Sequence[float], on_demand_price: float) -> float:
        """USD an hour of running this allocation costs at ``spot_prices`` and ``on_demand_price``."""
        return float(np.dot(self.spot, spot_prices)) + self.on_demand * on_demand_price

    def check(self, job: Job, available: Sequence[int]) -> None:
        """Raise ValueError if this allocation breaks a constraint of the spec's Decisions."""
        if len(self.spot) != len(available):
            raise ValueError(f"allocation has {len(self.spot)} pools, market has {len(available)}")
        if self.on_demand < 0 or any(s < 0 for s in self.spot):
            raise ValueError(f"allocation has a negative count: {self}")
        over = [m for m, (s, a) in enumerate(zip(self.spot, available)) if s > a]
        if over:
            raise ValueError(f"allocation {self} exceeds availability {list(available)} in pools {over}")
        n = self.total
        if n and not job.min_instances <= n <= job.max_instances:
            raise ValueError(f"allocation runs {n} instances, outside [{job.min_instances}, {job.max_instances}]")


@dataclass(frozen=True)
class SlotResult:
    """What one slot did: the spec's e[t], w[t], its bill, and completion inside it."""

    reconfiguration: bool
    effective_hours: float
    progress: float
    cost: float
    completion_hours: float | None


@dataclass
class Progress:
    """Running totals of a job while slots are applied one at a time."""

    slot: int = 0
    work_done: float = 0.0
    cost: float = 0.0
    previous: Allocation | None = None
    completion_hours: float | None = None

    @property
    def done(self) -> bool:
        return self.completion_hours is not None


def advance(
    job: Job,
    progress: Progress,
    allocation: Allocation,
    spot_prices: Sequence[float],
    on_demand_price: float,
) -> SlotResult:
    """Apply one slot's allocation to ``progress`` (in place) following the spec's rules."""
    if progress.done:
        raise ValueError("the job has already completed; nothing runs after T")
    s = job.slot_hours
    n = allocation.total
    previous = progress.previous or Allocation.idle(len(allocation.spot))
    reconfiguration = n > 0 and allocation != previous
    effective = max(s - job.reconfig_overhead_hours, 0.0) if reconfiguration else (s if n > 0 else 0.0)
    rate = job.rate(n)
    progress_made = effective * rate
    hourly = allocation.hourly_price(spot_prices, on_demand_price)
    start = progress.slot * s
    completion = None
    billed_hours = s
    remaining = job.work - progress.work_done
    if n > 0 and progress_made >= remaining - WORK_EPSILON:
        billed_hours = (s - effective) + max(remaining, 0.0) / rate
        completion = start + billed_hours
        progress_made = max(remaining, 0.0)
    cost = hourly * billed_hours
    progress.slot += 1
    progress.work_done += progress_made
    progress.cost += cost
    progress.previous = allocation
    progress.completion_hours = completion
    return SlotResult(reconfiguration, effective, progress_made, cost, completion)


@dataclass(frozen=True)
class Outcome:
    """The spec's result of a schedule: cost, completion, value, utility, misses."""

    cost: float
    completion_hours: float | None
    value: float
    utility: float
    soft_miss: bool
    hard_miss: bool
    slots: tuple[SlotResult, ...] = field(repr=False, default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "cost": self.cost,
            "completion_hours": self.completion_hours,
            "value": self.value,
            "utility": self.utility,
            "soft_miss": self.soft_miss,
            "hard_miss": self.hard_miss,
        }


def outcome(job: Job, progress: Progress, slots: Iterable[SlotResult] = ()) -> Outcome:
    """Value and utility of the totals in ``progress``."""
    t = progress.completion_hours
    value = job.value_at(t)
    return Outcome(
        cost=progress.cost,
        completion_hours=t,
        value=value,
        utility=value - progress.cost,
        soft_miss=t is None or t > job.deadline_hours + 1e-9,
        hard_miss=t is None or t > job.hard_deadline_hours + 1e-9,
        slots=tuple(slots),
    )


def evaluate(
    job: Job,
    allocations: Sequence[Allocation],
    spot_prices: np.ndarray,
    on_demand_price: float,
    available: np.ndarray | None = None,
) -> Outcome:
    """Account a whole schedule; allocations after completion are ignored (nothing runs after T).

    ``spot_prices[t][m]`` and ``available[t][m]`` are the realised market per slot; when
    ``available`` is given every allocation is checked against it and the job's bounds.
    """
    progress = Progress()
    results = []
    for t, allocation in enumerate(allocations):
        if progress.done:
            break
        if available is not None:
            allocation.check(job, available[t])
        results.append(advance(job, progress, allocation, spot_prices[t], on_demand_price))
    return outcome(job, progress, results)
