"""The evaluation grid: scenarios cut from traces, every evaluated policy on each, one row per run.

A scenario is (trace, start, N_max, deadline slack, reconfiguration overhead). Its job is sized
from the grid alone, never from a trace's prices: N_max instances' work for ``base_hours``, a
deadline that on-demand meets with ``slack`` to spare, and a value above the on-demand cost, so
every scenario is feasible and "relative to optimal" and "relative to on-demand" are defined.

Scenarios run in parallel processes. The selector learns across the scenarios of one trace in
chronological order, so its whole sequence is one task per trace, run once that trace's
scenarios (which compute its feedback) are done.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.market.trace import Trace
from airflow_provider_spotsched.scheduling.guard import DEFAULT_GUARD
from airflow_provider_spotsched.scheduling.model import Job, JobError, Throughput
from airflow_provider_spotsched.scheduling.policies import make_policy, policy_class
from airflow_provider_spotsched.scheduling.policy import Policy
from airflow_provider_spotsched.scheduling.replay import JobMarket, SimulationResult, job_market, simulate
from airflow_provider_spotsched.scheduling.rules import on_demand_cost
from airflow_provider_spotsched.scheduling.selector import SelectorPolicy, job_context
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput
from airflow_provider_spotsched.simulation.forecaster_value import Origin, submission_errors

if TYPE_CHECKING:
    from airflow_provider_spotsched.scheduling.selector import Round

ORACLE_ERRORS = (0.0, 0.1, 0.25, 0.5)
CHC_FORECASTERS = ("persistence", "seasonal-naive", "arima", "holt-winters", "markov-count", "sojourn-chain", "auto")
"""The real forecasters CHC runs on in the evaluation: what each buys is judged by CHC's cost."""
ROBUST_LEVEL = 0.75  # chc-auto-robust plans on spot available with at least this probability
CHC_COMMIT = 1
"""Slots every evaluated CHC commits to per plan: re-planning every slot paid less than the paper's
4 on the tuning seeds 41-46 under the guard (13.4% against 15.1% and 25.1% against 29.6% over
the optimum, docs/evaluation.md), and every CHC of the grid plans alike so that the forecasters
and the oracle's errors are compared on one planner."""
SELECTOR = "selector"


class EvaluationError(ValueError):
    """The grid cannot be laid on a trace or names an unknown policy; the message says the fix."""


@dataclass(frozen=True)
class PolicySpec:
    """One evaluated policy: a registry name with fixed parameters, reported under ``key``.

    ``seeded`` policies get a seed per run (the oracle's noise, the selector's draws); the
    others get none, since e.g. CHC refuses a seed that its forecaster would not use.
    A single-instance policy (:attr:`Policy.single_instance`, the SkyNomad artifact's) runs only
    on the grid's N_max = 1 scenarios, so its ``runs`` in a summary count those alone.
    """

    key: str
    name: str
    params: tuple[tuple[str, Any], ...] = ()
    seeded: bool = False

    def runs_on(self, n_max: int) -> bool:
        """Whether the policy is evaluated on scenarios of ``n_max`` instances."""
        return n_max == 1 or not policy_class(self.name).single_instance

    def build(self, seed: int) -> Policy:
        return make_policy(self.name, {**dict(self.params), "seed": seed} if self.seeded else dict(self.params))

    @property
    def forecast_error(self) -> float | None:
        """The injected relative forecast error of an oracle-forecast CHC, else None."""
        params = dict(self.params)
        return float(params["error"]) if params.get("forecaster") == "oracle" else None


def _chc(**params: Any) -> tuple[tuple[str, Any], ...]:
    """An evaluated CHC's parameters: ``params`` and the grid's commitment (:data:`CHC_COMMIT`)."""
    return (("commit", CHC_COMMIT), *params.items())


def _policy_specs() -> dict[str, PolicySpec]:
    specs = [
        PolicySpec("on-demand", "on-demand"),
        PolicySpec("greedy", "greedy"),
        PolicySpec("uniform-progress", "uniform-progress"),
        PolicySpec("optimal", "optimal"),
        PolicySpec("prediction-free", "prediction-free"),
        *(PolicySpec(f"chc-{name}", "chc", _chc(forecaster=name)) for name in CHC_FORECASTERS if name != "auto"),
        PolicySpec("chc-auto", "chc", _chc(forecaster="auto", guard=DEFAULT_GUARD)),
        # The selector's favourite member on its own (its utility is the selector's feedback too).
        PolicySpec("chc-blend", "chc", _chc(forecaster="blend", guard=DEFAULT_GUARD)),
        PolicySpec("chc-auto-unguarded", "chc", _chc(forecaster="auto")),
        # Level chosen on seeded synthetic markets only (docs/policies-optimal-chc.md, section 5).
        PolicySpec(
            "chc-auto-robust",
            "chc",
            _chc(forecaster="auto", uncertainty="quantile", level=ROBUST_LEVEL, guard=DEFAULT_GUARD),
        ),
        *(PolicySpec(f"chc-oracle-{e:g}", "chc", _chc(forecaster="oracle", error=e), seeded=True) for e in ORACLE_ERRORS),
        *(PolicySpec(name, name) for name in PEERS),
        PolicySpec(SELECTOR, "selector", seeded=True),
    ]
    return {spec.key: spec for spec in specs}


PEERS: tuple[str, ...] = ("skynomad", "up-s", "up-ap")
"""SkyNomad's policy and its multi-region Uniform Progress baselines, single-instance as in its artifact."""

POLICY_SPECS: dict[str, PolicySpec] = _policy_specs()
# The default grid runs CHC on the forecaster the operator uses (auto), under the cost guard, and
# on the blend, the selector's favourite member.
# `make evaluate-forecasters` runs plain CHC on every forecaster (chc-auto-unguarded for auto) to
# see what each buys; chc-auto-robust (about chc-auto's mean cost, measured in
# docs/policies-optimal-chc.md) is named with --policies. The peers run on N_max = 1 cells only.
OPT_IN_POLICIES: tuple[str, ...] = (
    *(f"chc-{name}" for name in CHC_FORECASTERS if name != "auto"),
    "chc-auto-unguarded",
    "chc-auto-robust",
)
DEFAULT_POLICIES: tuple[str, ...] = tuple(key for key in POLICY_SPECS if key not in OPT_IN_POLICIES)


def plain_chc_forecaster(key: str) -> str | None:
    """The forecaster of a policy key that is the grid's CHC on a real forecaster and nothing else (no guard), else None."""
    spec = POLICY_SPECS.get(key)
    params = dict(spec.params) if spec is not None else {}
    if spec is None or spec.name != "chc" or set(params) != {"commit", "forecaster"}:
        return None
    return params["forecaster"] if params["forecaster"] in CHC_FORECASTERS else None


def _build_selector(seed: int) -> SelectorPolicy:
    """The evaluated selector, typed as one: its rounds, weights and state are used beyond :class:`Policy`."""
    policy = POLICY_SPECS[SELECTOR].build(seed)
    if not isinstance(policy, SelectorPolicy):
        raise EvaluationError(f"policy spec {SELECTOR!r} built a {type(policy).__name__}, not a SelectorPolicy")
    return policy


@dataclass(frozen=True)
class GridConfig:
    """The grid and the job template; the defaults are the documented evaluation."""

    traces: tuple[str, ...] = (str(AWS_TRACE), str(GCP_TRACE))
    scenarios: int = 8
    n_max: tuple[int, ...] = (1, 4, 8, 16)
    slack: tuple[float, ...] = (1.25, 1.5, 2.0)
    overhead: tuple[float, ...] = (0.1, 0.25)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    base_hours: float = 12.0
    throughput: Throughput = Throughput(1.0, 0.0)
    hard_deadline_factor: float = 1.5
    value_factor: float = 1.3
    slot_hours: float = 1.0
    lookback_hours: float = 7 * 24.0
    min_lookback_hours: float = 2 * 24.0
    seed: int = 0
    true_throughput: TrueThroughput = TrueThroughput()
    estimate_throughput: bool = True

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in POLICY_SPECS]
        if unknown:
            raise EvaluationError(f"unknown policies {unknown}; choose from {list(POLICY_SPECS)}")
        for name in ("traces", "n_max", "slack", "overhead", "policies"):
            if not getattr(self, name):
                raise EvaluationError(f"{name} is empty; give at least one value")
        names = [trace_name(path) for path in self.traces]
        if len(set(names)) != len(names):
            raise EvaluationError(f"traces must have distinct file names (reports name traces by them), got {names}")
        if self.scenarios < 1:
            raise EvaluationError(f"scenarios must be >= 1, got {self.scenarios}")
        if min(self.n_max) < 1:
            raise EvaluationError(f"n_max values must be >= 1 instance, got {self.n_max}")
        if min(self.slack) < 1:
            raise EvaluationError(f"slack values must be >= 1 so that on-demand meets the deadline, got {self.slack}")
        if self.base_hours <= 0:
            raise EvaluationError(f"base_hours must be > 0, got {self.base_hours}")
        for n, s, o in itertools.product(self.n_max, self.slack, self.overhead):
            try:
                template_job(self, n, s, o).check_feasible()
            except JobError as exc:
                raise EvaluationError(f"grid cell n_max={n}, slack={s}, overhead={o}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["throughput"] = {"alpha": self.throughput.alpha, "beta": self.throughput.beta}
        data["true_throughput"] = asdict(self.true_throughput)
        return data


@dataclass(frozen=True)
class Scenario:
    """One cell of the grid on one trace; ``index`` orders a trace's scenarios in time."""

    trace: str
    start: datetime
    n_max: int
    slack: float
    overhead: float
    index: int
    lookback_hours: float

    @property
    def trace_name(self) -> str:
        return trace_name(self.trace)

    @property
    def start_text(self) -> str:
        return self.start.strftime("%Y-%m-%dT%H:%M:%SZ")


def trace_name(path: str) -> str:
    """A trace's short name in reports: its file name without ``.csv``/``.csv.gz``."""
    name = Path(path).name
    for suffix in (".gz", ".csv"):
        name = name.removesuffix(suffix)
    return name


def template_job(config: GridConfig, n_max: int, slack: float, overhead: float) -> Job:
    """The grid's job for one cell, valued 0: H(N_max) * base_hours of work, deadline slack * (base + overhead)."""
    return Job(
        work=config.throughput(n_max) * config.base_hours,
        deadline_hours=slack * (config.base_hours + overhead),
        max_instances=n_max,
        min_instances=1,
        throughput=config.throughput,
        value=0.0,
        hard_deadline_factor=config.hard_deadline_factor,
        reconfig_overhead_hours=overhead,
        slot_hours=config.slot_hours,
    )


def scenario_job(config: GridConfig, trace: Trace, scenario: Scenario) -> tuple[Job, JobMarket]:
    """The scenario's job and market; its value is ``value_factor`` x its on-demand cost."""
    draft = replace(template_job(config, scenario.n_max, scenario.slack, scenario.overhead), start=scenario.start)
    market = job_market(trace, draft, lookback_hours=scenario.lookback_hours)
    job = replace(draft, value=config.value_factor * on_demand_cost(draft, market.market.on_demand_price))
    job.check_feasible()
    return job, market


def plan_scenarios(config: GridConfig, trace: Trace) -> list[Scenario]:
    """The trace's scenarios in chronological order: ``scenarios`` starts x the grid's cells.

    Starts spread evenly over the part of the trace that leaves ``lookback`` hours of history
    before them and the longest cell's whole horizon (to its hard deadline) after them. The
    lookback is ``lookback_hours`` capped at half of what the trace leaves beyond one horizon,
    and never under ``min_lookback_hours``.
    """
    step = config.slot_hours * 3600.0
    cells = list(itertools.product(config.n_max, config.slack, config.overhead))
    horizon_slots = max(template_job(config, *cell).horizon_slots for cell in cells)
    span_hours = (trace.last_time - trace.first_time) / 3600.0
    room_hours = span_hours - (horizon_slots - 1) * config.slot_hours
    lookback = max(config.min_lookback_hours, min(config.lookback_hours, room_hours / 2))
    lookback = math.floor(lookback / config.slot_hours) * config.slot_hours
    if lookback > room_hours or lookback < config.min_lookback_hours:
        raise EvaluationError(
            f"{trace.source} spans {span_hours:.1f} h; the grid needs {config.min_lookback_hours:g} h of history "
            f"plus {horizon_slots} slots to the longest hard deadline: use a longer trace, smaller slack or base_hours"
        )
    first = _minute(trace.first_time + lookback * 3600.0, math.ceil)
    last = _minute(trace.last_time - (horizon_slots - 1) * step, math.floor)
    starts = [_minute(t, math.floor) for t in np.linspace(first, max(first, last), config.scenarios)]
    return [
        Scenario(trace.source, datetime.fromtimestamp(t, timezone.utc), n, s, o, i * len(cells) + j, lookback)
        for i, t in enumerate(starts)
        for j, (n, s, o) in enumerate(cells)
    ]


def _minute(epoch: float, rounding: Callable[[float], int]) -> float:
    return float(rounding(epoch / 60.0) * 60)


@dataclass(frozen=True)
class Row:
    """One policy on one scenario: the spec's outcome, decision times, and relatives.

    ``excess_cost`` = cost / optimal cost - 1, ``utility_vs_optimal`` = utility / optimal
    utility, ``cost_vs_on_demand`` = cost / on-demand cost, all on the same scenario (empty
    when the reference policy was not run or is zero).
    """

    trace: str
    start: str
    n_max: int
    slack: float
    overhead: float
    policy: str
    params: str
    cost: float
    value: float
    utility: float
    completion_hours: float | None
    soft_miss: bool
    hard_miss: bool
    decision_ms_mean: float
    decision_ms_p50: float
    excess_cost: float | None = None
    utility_vs_optimal: float | None = None
    cost_vs_on_demand: float | None = None

    @property
    def scenario_key(self) -> tuple[str, str, int, float, float]:
        return (self.trace, self.start, self.n_max, self.slack, self.overhead)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(Row))


def make_row(scenario: Scenario, spec: PolicySpec, result: SimulationResult) -> Row:
    out = result.outcome
    ms = np.asarray(result.decision_seconds or [0.0]) * 1000.0
    return Row(
        trace=scenario.trace_name,
        start=scenario.start_text,
        n_max=scenario.n_max,
        slack=scenario.slack,
        overhead=scenario.overhead,
        policy=spec.key,
        params=json.dumps(dict(spec.params), sort_keys=True),
        cost=out.cost,
        value=out.value,
        utility=out.utility,
        completion_hours=out.completion_hours,
        soft_miss=out.soft_miss,
        hard_miss=out.hard_miss,
        decision_ms_mean=float(ms.mean()),
        decision_ms_p50=float(np.median(ms)),
    )


@dataclass(frozen=True)
class ScenarioRun:
    """One scenario's rows and, when the selector is evaluated, its members' counterfactual utilities."""

    scenario: Scenario
    rows: list[Row]
    member_utilities: dict[str, float] | None


def run_scenario(config: GridConfig, scenario: Scenario, keys: Sequence[str], selector: bool) -> ScenarioRun:
    """Every policy in ``keys`` on one scenario; seeded ones get ``config.seed + scenario.index``.

    With ``selector``, also every selector pool member's utility on the scenario's realised
    market at the grid's true throughput: the selector's full-information feedback, computed
    here so that it runs in parallel. A member that is one of the evaluated policies (the default
    grid's `chc-blend` and `uniform-progress`) takes that run's utility rather than running again.
    """
    job, market = scenario_job(config, cached_trace(scenario.trace), scenario)
    rows = []
    unseeded: dict[str, float] = {}
    for key in keys:
        spec = POLICY_SPECS[key]
        if not spec.runs_on(scenario.n_max):
            continue
        policy = spec.build(config.seed + scenario.index)
        result = simulate(policy, job, market, *_truth(config))
        rows.append(make_row(scenario, spec, result))
        if not spec.seeded:
            unseeded[policy.label] = result.outcome.utility
    utilities = (
        _build_selector(config.seed).counterfactual_utilities(job, market, *_truth(config), known=unseeded)
        if selector else None
    )
    return ScenarioRun(scenario, rows, utilities)


def _truth(config: GridConfig) -> tuple[TrueThroughput, bool]:
    """:func:`simulate`'s true throughput and whether the policies see the estimate."""
    return config.true_throughput, config.estimate_throughput


def run_selector(
    config: GridConfig, runs: Sequence[ScenarioRun], draw_numbers: dict[int, int] | None = None
) -> tuple[list[Row], dict[str, Any]]:
    """The selector over scenarios of one trace in order of start time, one round per scenario.

    Each kind of job warms up on the history before its first start. A round's feedback (its
    members' counterfactual utilities) is learnt only once its job's horizon has ended, i.e.
    before the first round that starts at or after that instant, so the selector never learns
    from market data later than the job it is deciding. ``plays`` records the probabilities
    each job's member was drawn with, from which the selector's expected excess cost follows
    without the noise of its draws.

    Kinds of job learn independently and share only the sequence of draws, so a trace's
    sequence can run as one task per kind (see :func:`selector_tasks`): ``draw_numbers`` maps a
    scenario's ``index`` to its draw in the whole trace's sequence (default: ``runs`` is that
    whole sequence).
    """
    spec = POLICY_SPECS[SELECTOR]
    selector = _build_selector(config.seed)
    trace = cached_trace(runs[0].scenario.trace)
    ordered = sorted(runs, key=lambda r: r.scenario.index)
    draws = draw_numbers or {run.scenario.index: n for n, run in enumerate(ordered)}
    waiting: list[tuple[datetime, ScenarioRun, Job, JobMarket, Round]] = []
    rows: list[Row] = []
    plays: list[dict[str, Any]] = []
    rounds: list[dict[str, Any]] = []
    warm_up: dict[str, int] = {}

    def learn(before: Scenario | None) -> None:
        waiting.sort(key=lambda item: item[0])
        while waiting and (before is None or waiting[0][0] <= before.start):
            ends, run, job, market, played = waiting.pop(0)
            selector.close_round(played, job, market, run.member_utilities)
            rounds.append({
                **_cell(run.scenario), "context": job_context(job), "ends": ends.isoformat(),
                "learnt_before": None if before is None else before.start_text, "utilities": run.member_utilities,
            })

    for run in ordered:
        scenario = run.scenario
        learn(before=scenario)
        job, market = scenario_job(config, trace, scenario)
        context = job_context(job)
        fresh = not selector.knows(job)
        selector.set_next_draw(draws[scenario.index])
        row = make_row(scenario, spec, simulate(selector, job, market, *_truth(config)))  # the round opens at slot 0
        played = selector.current_round
        if played is None:
            raise EvaluationError(f"the selector opened no round on scenario {scenario.index}, yet it draws one at slot 0")
        if fresh:
            warm_up[context] = selector.rounds_learnt(job)
        plays.append({
            **_cell(scenario), "draw": played.draw, "context": context, "played": played.label,
            "probabilities": selector.weights(job), "utilities": run.member_utilities,
        })
        rows.append(row)
        ends = scenario.start + timedelta(hours=job.horizon_slots * job.slot_hours)
        waiting.append((ends, run, job, market, played))
    learn(before=None)
    learning = {"members": list(selector.labels), "warm_up_rounds": warm_up, "plays": plays, "rounds": rounds}
    return rows, {**learning, "final_state": selector.to_state()}


def selector_tasks(config: GridConfig, runs: Sequence[ScenarioRun]) -> list[tuple[list[ScenarioRun], dict[int, int]]]:
    """A trace's selector sequence split by kind of job, each part with its draw numbers."""
    ordered = sorted(runs, key=lambda r: r.scenario.index)
    draws = {run.scenario.index: n for n, run in enumerate(ordered)}
    trace = cached_trace(ordered[0].scenario.trace)
    parts: dict[str, list[ScenarioRun]] = {}
    for run in ordered:
        parts.setdefault(job_context(scenario_job(config, trace, run.scenario)[0]), []).append(run)
    return [(part, {run.scenario.index: draws[run.scenario.index] for run in part}) for part in parts.values()]


def merge_selector_parts(parts: Sequence[tuple[list[Row], dict[str, Any]]]) -> tuple[list[Row], dict[str, Any]]:
    """One trace's selector rows and learning from its per-kind parts, as one sequence gives them
    (kinds in the state ordered by their last play)."""
    plays = sorted((p for _, part in parts for p in part["plays"]), key=lambda p: p["draw"])
    cell_order = {(p["start"], p["n_max"], p["slack"], p["overhead"]): p["draw"] for p in plays}
    rounds = sorted(
        (r for _, part in parts for r in part["rounds"]),
        key=lambda r: (r["ends"], cell_order[(r["start"], r["n_max"], r["slack"], r["overhead"])]),
    )
    last_play = {play["context"]: play["draw"] for play in plays}
    contexts = {k: v for _, part in parts for k, v in part["final_state"]["contexts"].items()}
    final_state = {
        **parts[0][1]["final_state"],
        "contexts": {k: contexts[k] for k in sorted(contexts, key=last_play.__getitem__)},
        "draws": len(plays),
    }
    learning = {
        "members": parts[0][1]["members"],
        "warm_up_rounds": {k: v for _, part in parts for k, v in part["warm_up_rounds"].items()},
        "plays": plays,
        "rounds": rounds,
        "final_state": final_state,
    }
    return [row for part_rows, _ in parts for row in part_rows], learning


def _cell(scenario: Scenario) -> dict[str, Any]:
    return {"start": scenario.start_text, "n_max": scenario.n_max, "slack": scenario.slack, "overhead": scenario.overhead}


def with_relatives(rows: Sequence[Row]) -> list[Row]:
    """``rows`` with each one's cost and utility relative to its scenario's optimal and on-demand."""
    reference: dict[tuple[Any, ...], Row] = {}
    for row in rows:
        if row.policy in ("optimal", "on-demand"):
            key = (row.policy, *row.scenario_key)  # mypy reads reference[(a, *b)] as 3.11's starred index a[*b]
            reference[key] = row
    out = []
    for row in rows:
        best = reference.get(("optimal", *row.scenario_key))
        base = reference.get(("on-demand", *row.scenario_key))
        out.append(
            replace(
                row,
                excess_cost=None if best is None else _ratio(row.cost, best.cost, minus=1.0),
                utility_vs_optimal=None if best is None else _ratio(row.utility, best.utility),
                cost_vs_on_demand=None if base is None else _ratio(row.cost, base.cost),
            )
        )
    return out


def _ratio(x: float, reference: float, minus: float = 0.0) -> float | None:
    return None if reference == 0 else x / reference - minus


@dataclass
class Evaluation:
    """Everything one evaluation produced: the rows and, per trace, the selector's learning."""

    config: GridConfig
    rows: list[Row]
    selector: dict[str, Any] = field(default_factory=dict)
    forecast_errors: dict[str, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    """Per trace, forecaster and quantity, the MAE per lead at the jobs' submissions (see forecaster_value)."""


ProgressCallback = Callable[[int, int, int, int, float], None]
"""Called as ``(scenarios_done, scenarios_total, selector_traces_done, selector_traces_total, elapsed_s)``."""


def evaluate(config: GridConfig, workers: int = 2, on_progress: ProgressCallback | None = None) -> Evaluation:
    """Run the grid over ``workers`` processes; rows come back in grid order.

    Scenarios run first, in parallel; a trace's selector sequence starts, one task per kind of
    job, as soon as all of that trace's scenarios (which carry its feedback) are done.
    """
    if workers < 1:
        raise EvaluationError(f"workers must be >= 1, got {workers}")
    began = time.monotonic()
    plans = {path: plan_scenarios(config, cached_trace(path)) for path in config.traces}
    keys = [k for k in config.policies if k != SELECTOR]
    with_selector = SELECTOR in config.policies
    total = sum(len(plan) for plan in plans.values())
    selector_total = len(plans) if with_selector else 0
    rows: list[Row] = []
    runs: dict[str, list[ScenarioRun]] = {path: [] for path in plans}
    parts: dict[str, list[tuple[list[Row], dict[str, Any]]]] = {path: [] for path in plans}
    expected_parts: dict[str, int] = {}
    selector: dict[str, Any] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        pending: dict[Future, str | None] = {
            pool.submit(run_scenario, config, scenario, keys, with_selector): None
            for plan in plans.values()
            for scenario in plan
        }
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                path = pending.pop(future)
                if path is None:
                    run = future.result()
                    rows += run.rows
                    runs[run.scenario.trace].append(run)
                    trace_runs = runs[run.scenario.trace]
                    if with_selector and len(trace_runs) == len(plans[run.scenario.trace]):
                        tasks = selector_tasks(config, trace_runs)
                        expected_parts[run.scenario.trace] = len(tasks)
                        for part, draws in tasks:
                            pending[pool.submit(run_selector, config, part, draws)] = run.scenario.trace
                else:
                    parts[path].append(future.result())
                    if len(parts[path]) == expected_parts[path]:
                        selector_rows, selector[trace_name(path)] = merge_selector_parts(parts[path])
                        rows += selector_rows
            if on_progress is not None:
                done = sum(len(r) for r in runs.values())
                on_progress(done, total, len(selector), selector_total, time.monotonic() - began)
    rows.sort(key=_grid_order(config))
    ordered = {name: selector[name] for name in map(trace_name, config.traces) if name in selector}
    return Evaluation(config, with_relatives(rows), ordered, forecaster_errors(config, plans, workers))


def forecaster_errors(
    config: GridConfig, plans: dict[str, list[Scenario]], workers: int
) -> dict[str, dict[str, dict[str, list[float]]]]:
    """The MAE per lead of every forecaster CHC ran on, at each trace's job submissions.

    Only when the grid compares forecasters (CHC on two or more): a single one has nothing to be
    judged against but persistence, which the evaluation did not run CHC on.
    """
    forecasters = [name for key in config.policies if (name := plain_chc_forecaster(key))]
    if len(forecasters) < 2:
        return {}
    origins = {}
    for path, scenarios in plans.items():
        first = {scenario.start: scenario for scenario in reversed(scenarios)}
        trace = cached_trace(path)
        origins[trace_name(path)] = [
            Origin(trace_name(path), scenario.start_text, scenario_job(config, trace, scenario)[1])
            for _, scenario in sorted(first.items())
        ]
    return submission_errors(origins, forecasters, workers)


def _grid_order(config: GridConfig) -> Callable[[Row], tuple[Any, ...]]:
    """Sort key: trace as given, then start, the grid's cell order, and the policies' order."""
    names = [trace_name(p) for p in config.traces]

    def key(row: Row) -> tuple[Any, ...]:
        return (
            names.index(row.trace),
            row.start,
            config.n_max.index(row.n_max),
            config.slack.index(row.slack),
            config.overhead.index(row.overhead),
            config.policies.index(row.policy),
        )

    return key
