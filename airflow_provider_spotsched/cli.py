"""The ``spotsched`` command line: each subcommand is a few lines over the library modules.

Bad input (a job or trace file that does not parse, an infeasible job, an unknown policy or
parameter) ends with exit code 2 and one line that names the file or field, never a traceback;
Ctrl-C ends with exit code 130 and one line.
The library's warnings (a long hole in a trace, a pool short of capacity) go to stderr as
``spotsched <command>: warning: ...`` lines.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import os
import re
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_provider_spotsched.backends.local_settings import DEFAULT_SECONDS_PER_SLOT, LocalReplaySettings
from airflow_provider_spotsched.execution.driver import Load, Persist, RunDriver, TrainingFailedError
from airflow_provider_spotsched.execution.environment import SpotEnvironment, local_environment
from airflow_provider_spotsched.forecast import LIVE_FORECASTERS, Forecaster, make_forecaster
from airflow_provider_spotsched.forecast.backtest import BacktestError, run_backtest
from airflow_provider_spotsched.forecast.snapshot import MAX_HORIZON, MAX_STALENESS_HOURS, forecast_document, snapshot_at
from airflow_provider_spotsched.market.slots import resample
from airflow_provider_spotsched.market.synthetic import SyntheticMarketConfig, generate, write_trace
from airflow_provider_spotsched.market.trace import Trace, TraceError, format_timestamp, load_trace, parse_timestamp
from airflow_provider_spotsched.runtime.config import TrainConfig
from airflow_provider_spotsched.runtime.contract import runtime_command, write_config
from airflow_provider_spotsched.scheduling.model import DEFAULT_MAX_INSTANCES_LIMIT, MIN_SLOT_HOURS, Job
from airflow_provider_spotsched.scheduling.online import OnlineRun, RunConfig
from airflow_provider_spotsched.scheduling.policies import make_policy, policy_class
from airflow_provider_spotsched.scheduling.replay import job_market, simulate
from airflow_provider_spotsched.scheduling.selector_store import SelectorStoreError, starting_state, store_round
from airflow_provider_spotsched.scheduling.true_throughput import TrueThroughput
from airflow_provider_spotsched.simulation.evaluation import (
    OPT_IN_POLICIES,
    POLICY_SPECS,
    EvaluationError,
    GridConfig,
    evaluate,
    trace_name,
)

BAD_INPUT = 2
INTERRUPTED = 130
"""The exit code of a command ended by Ctrl-C (SIGINT), as a shell reports one (128 + 2)."""
MAX_SLOT_HOURS = 24 * 365.0
"""The longest ``--slot-hours``: longer slots are no decisions, and past ~1e9 hours a date overflows."""


class InputError(Exception):
    """Bad input from the command line; the message names the file, option or field."""


def parse_param(text: str) -> tuple[str, Any]:
    """``key=value`` with ``value`` read as JSON where it parses (ints, floats, bools, lists), else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise InputError(f"--param {text!r} must look like key=value, e.g. --param window=24")
    try:
        return key.strip(), json.loads(raw)
    except json.JSONDecodeError:
        return key.strip(), raw


def seeded_params(name: str, params: Mapping[str, Any], seed: int | None) -> dict[str, Any]:
    """``params`` plus ``seed`` when policy ``name`` takes one; a ``seed`` in ``params`` wins."""
    accepted = inspect.signature(policy_class(name).__init__).parameters
    if seed is None or "seed" in params or "seed" not in accepted:
        return dict(params)
    return {**params, "seed": seed}


def read_job(path: Path, max_instances_limit: int = DEFAULT_MAX_INSTANCES_LIMIT) -> Job:
    """The job in ``path`` (the spec's JSON object), checked against the instance limit and for feasibility."""
    if max_instances_limit < 1:
        raise InputError(f"--max-instances-limit {max_instances_limit}: must be >= 1 instance")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read the job file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: must hold one JSON object with the job's fields, got {type(data).__name__}")
    try:
        job = Job.from_dict(data)
        job.check_feasible(max_instances_limit)
    except (ValueError, TypeError) as exc:  # JobError, and a non-number where a number belongs
        raise InputError(f"{path}: {exc}") from None
    return job


def cmd_simulate(args: argparse.Namespace) -> int:
    truth = true_throughput(args)
    params = dict(parse_param(p) for p in args.param)
    job = read_job(args.job, args.max_instances_limit)
    pools = [p.strip() for p in args.pools.split(",")] if args.pools is not None else None
    try:
        market = job_market(load_trace(args.trace), job, pools)
    except TraceError as exc:
        raise InputError(str(exc)) from None
    try:
        policy = make_policy(args.policy, seeded_params(args.policy, params, args.seed))
    except (ValueError, TypeError) as exc:
        raise InputError(f"--policy {args.policy}: {exc}") from None
    if policy.single_instance and job.max_instances != 1:
        raise InputError(f"{args.job}: max_instances={job.max_instances}: --policy {args.policy} runs a single instance; "
                         "set max_instances=1, or choose a multi-instance policy such as uniform-progress or chc")
    result = simulate(policy, job, market, truth, not args.no_throughput_estimate)
    _write_json(args.out, result.to_dict())
    out = result.outcome
    finish = "never completed" if out.completion_hours is None else f"completed at {out.completion_hours:.2f} h"
    misses = "hard miss" if out.hard_miss else "soft miss" if out.soft_miss else "deadline met"
    print(
        f"{result.policy}: {finish} (deadline {job.deadline_hours:g} h, {misses}), cost ${out.cost:.2f}, "
        f"value ${out.value:.2f}, utility ${out.utility:.2f} -> {args.out}"
    )
    return 0


def true_throughput(args: argparse.Namespace) -> TrueThroughput:
    """The simulated job's real throughput from ``--true-throughput`` and ``--slowdown-*``."""
    try:
        return TrueThroughput(args.true_throughput, args.slowdown_at_hours, args.slowdown_factor)
    except ValueError as exc:
        flags = {"factor": "--true-throughput", "slowdown_at_hours": "--slowdown-at-hours", "slowdown_factor": "--slowdown-factor"}
        text = re.sub(r"\b(" + "|".join(flags) + r")\b", lambda m: flags[m.group(1)], str(exc))
        raise InputError(text) from None


def add_throughput_flags(parser: argparse.ArgumentParser) -> None:
    """The simulator's true-throughput options, shared by ``simulate`` and ``evaluate``."""
    parser.add_argument("--true-throughput", type=float, default=1.0, metavar="F",
                        help="the job really runs at F x its declared throughput (e.g. 0.77: declared 30%% too high)")
    parser.add_argument("--slowdown-at-hours", type=float, metavar="H",
                        help="from the slot starting at or after H hours the throughput slows down by --slowdown-factor")
    parser.add_argument("--slowdown-factor", type=float, default=1.0, metavar="F",
                        help="the multiple of the throughput after --slowdown-at-hours (e.g. 0.77)")
    parser.add_argument("--no-throughput-estimate", action="store_true",
                        help="policies plan on the declared throughput, not on the one measured so far (the old behaviour)")


def cmd_evaluate(args: argparse.Namespace) -> int:
    from airflow_provider_spotsched.simulation.report import write_report  # imports matplotlib: only here

    truth = true_throughput(args)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {args.out}: cannot create the folder ({exc.strerror})") from None
    try:
        config = GridConfig(
            traces=tuple(str(p) for p in args.traces),
            scenarios=args.scenarios,
            n_max=tuple(args.nmax),
            slack=tuple(args.slack),
            overhead=tuple(args.overhead),
            policies=tuple(args.policies),
            base_hours=args.base_hours,
            hard_deadline_factor=args.hard_deadline_factor,
            seed=args.seed,
            true_throughput=truth,
            estimate_throughput=not args.no_throughput_estimate,
        )
        evaluation = evaluate(config, workers=args.workers, on_progress=_ProgressLine())
    except (EvaluationError, TraceError) as exc:
        raise InputError(str(exc)) from None
    command = "spotsched " + " ".join(shlex.quote(a) for a in args.argv)
    written = write_report(evaluation, args.out, command, datetime.now(timezone.utc))
    names = ", ".join(p.name for p in written)
    print((args.out / "summary.md").read_text(encoding="utf-8"))
    print(f"{len(evaluation.rows)} rows over {len(config.traces)} trace(s) -> {args.out}: {names}")
    return 0


BACKTEST_MODELS = ("auto", "arima", "holt-winters", "markov-count", "sojourn-chain", "seasonal-naive", "persistence")


def cmd_forecast(args: argparse.Namespace) -> int:
    if not 1 <= args.horizon <= MAX_HORIZON:
        raise InputError(
            f"--horizon {args.horizon}: must be 1..{MAX_HORIZON} slots; the forecasters model a daily season "
            f"and two seasons ahead they only repeat its profile"
        )
    if not MIN_SLOT_HOURS <= args.slot_hours <= MAX_SLOT_HOURS:  # NaN and infinity fail too
        raise InputError(f"--slot-hours {args.slot_hours:g}: must be from a minute ({MIN_SLOT_HOURS:.4g}) to a year "
                         f"({MAX_SLOT_HOURS:g}) of hours; give e.g. 1")
    pools = _names(args.pools + args.market) or None
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        raise InputError(str(exc)) from None
    return _backtest(args, trace, pools) if args.backtest else _live_forecast(args, trace, pools)


def cmd_run(args: argparse.Namespace) -> int:
    """Run a job for real on the local backend, in this process, to its end (see docs/architecture.md)."""
    job = read_job(args.job, args.max_instances_limit)
    try:
        settings = LocalReplaySettings.from_extra(
            {"workdir": _absolute(str(args.workdir)), "trace": args.trace, "seconds_per_slot": args.seconds_per_slot,
             "market_start": args.market_start, "history_slots": args.history_slots},
            "spotsched run",
        )
        env = local_environment(settings, job.slot_hours)
    except (ValueError, TraceError) as exc:
        raise InputError(str(exc)) from None
    try:
        settings.workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--workdir {args.workdir}: cannot be a directory ({exc.strerror}); give a directory path") from None
    job_id = args.job_id or _job_id(args.job)
    state_file = settings.workdir / "runs" / f"{job_id}.json"
    selector_file = args.selector_state or settings.workdir / "selector.json"

    given = _run_flags(args, job, settings)
    flags: dict[str, Any] | None = given

    def persist(state: dict[str, Any]) -> None:  # the flags ride along: RunDriver reads only its own keys
        _write_json(state_file, state if flags is None else {**state, "flags": flags}, "run state")

    def load() -> Any:  # another `spotsched run` of the job may have moved the run on (RunDriver.step)
        return _read_json(state_file)

    if state_file.exists():
        stored = _read_json(state_file)
        stored_flags = stored.get("flags") if isinstance(stored, dict) else None
        if stored_flags is not None:
            _check_same_flags(stored_flags, given, state_file)
        flags = stored_flags  # a run stored before flags were: it stays without them
        print(f"re-attaching to job {job_id} ({state_file})")
        try:
            driver = RunDriver.from_state(env, stored, persist, load)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{state_file}: not a run state spotsched run wrote ({exc!r}); remove it to start afresh") from None
        reattach = True
    else:
        driver = _start_run(args, job, job_id, env, persist, selector_file, load)
        reattach = False
    shown = len(driver.run.records)

    def show(run: OnlineRun) -> None:
        nonlocal shown
        for record in run.records[shown:]:
            print(f"slot {record.slot}: {record.allocation} (cost so far {record.cost_so_far:.2f} USD)", flush=True)
        shown = len(run.records)

    try:
        run = driver.run_to_completion(reattach, on_step=show)
    except TrainingFailedError as exc:  # the training failed, not the input: exit 1, yet no traceback
        print(f"spotsched run: error: {exc}; run the same command again to retry from the last checkpoint, or fix the "
              f"training command and remove {state_file} to start a new run", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # run_until released every instance before it re-raised (a second Ctrl-C that cuts
        # that release short may leave some running: the re-run the message offers re-attaches to them)
        print(f"spotsched run: interrupted; {_left_after_interrupt(job_id, state_file)}", file=sys.stderr)
        return INTERRUPTED
    if run.member is not None:
        try:
            store_round(lambda: _read_text(selector_file), lambda doc: _write_json(selector_file, doc, "selector state"),
                        run, f"file {selector_file}")
        except SelectorStoreError as exc:
            raise InputError(str(exc)) from None
    result = run.result()
    if args.out:
        _write_json(args.out, {**result, "decision_log": run.decision_log()})
    met = "deadline met" if result["deadline_met"] else "DEADLINE MISSED"
    print(f"{result['policy']}: completed at {result['completion_hours']:.2f} h ({met}), cost ${result['cost']:.2f} "
          f"against ${result['on_demand_cost']:.2f} on demand, {result['preemptions']} preemption(s)")
    return 0


def _left_after_interrupt(job_id: str, state_file: Path) -> str:
    """What an interrupted run left behind and how to go on: its state is stored before anything is launched."""
    if not state_file.exists():
        return f"nothing of job {job_id} was launched or stored; run the same command again to start it"
    return (f"every instance of job {job_id} was released (its checkpoints stay) and the run is kept in {state_file}: "
            f"run the same command again to resume it from the last checkpoint, or remove {state_file} to drop it")


def _run_flags(args: argparse.Namespace, job: Job, settings: LocalReplaySettings) -> dict[str, Any]:
    """What a run is started with, stored in its state: a re-run re-attaches with the stored run's
    market clock, command and decisions, so it must be given the same (:func:`_check_same_flags`)."""
    return {
        "--job": job.to_dict(),
        "--trace": _absolute(str(settings.trace)),
        "--market-start": None if settings.market_start is None else format_timestamp(settings.market_start),
        "--seconds-per-slot": settings.seconds_per_slot,
        "--history-slots": settings.history_slots,
        "--pools": ",".join(_names([args.pools])) if args.pools else None,
        "--policy": args.policy,
        "--param": dict(parse_param(p) for p in args.param),
        "--forecaster": args.forecaster,
        "--command": args.training_command,
        "--training-config": None if args.training_config is None else _absolute(str(args.training_config)),
        CONFIG_CONTENT: None if args.training_config is None else _config_digest(args.training_config),
        "--checkpoint-uri": _absolute(args.checkpoint_uri) if args.checkpoint_uri else args.checkpoint_uri,
    }


PATH_FLAGS = ("--trace", "--training-config", "--checkpoint-uri")
CONFIG_CONTENT = "--training-config content"
"""The stored digest of the --training-config file: the run goes on with the copy it wrote under its
checkpoint URI when it started, so an edit of the file since would be silently ignored."""


def _absolute(location: str) -> str:
    """A local path (or ``file://`` URI) as the absolute path it names from here (a URI such as
    ``s3://...`` as given): a re-run from another directory that names the same file matches, one
    whose relative path now names another file does not."""
    location = location.removeprefix("file://")
    return location if "://" in location else str(Path(location).expanduser().resolve())


def _config_digest(path: Path) -> str | None:
    """The --training-config file's SHA-256 (hex), ``None`` when it does not exist."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"--training-config {path}: cannot read ({exc.strerror})") from None


def _check_same_flags(stored: Mapping[str, Any], given: Mapping[str, Any], state_file: Path) -> None:
    """Refuse a re-run whose flags differ from those its stored run was started with (it would
    re-attach, and silently run the stored ones, or drive the stored clock on another market).

    A flag the stored run lacks is not compared: a run stored before it was (the config's digest,
    say) re-attaches as before. Paths compare resolved; a run stored before they were stored
    resolved has them as typed, and those resolve from here, as the text comparison read them.
    ``--command`` compares as the argument list it runs (:func:`_command_argv`), not as typed."""
    stored = {**stored, **{flag: _absolute(stored[flag]) for flag in PATH_FLAGS if stored.get(flag)}}
    differ = [flag for flag in given if flag in stored and not _same_flag(flag, stored[flag], given[flag])]
    if CONFIG_CONTENT in differ and ("--training-config" in differ or given[CONFIG_CONTENT] is None):
        # another file, whose content says nothing more; or the same file since removed (a temporary
        # config): the run goes on with the copy it wrote under its checkpoint URI, which nobody edited
        differ.remove(CONFIG_CONTENT)
    if not differ:
        return
    if "--job" in differ:  # name the job's fields that differ, not all of them
        fields = [key for key in {**stored["--job"], **given["--job"]} if stored["--job"].get(key) != given["--job"].get(key)]
        stored = {**stored, "--job": {key: stored["--job"].get(key) for key in fields}}
        given = {**given, "--job": {key: given["--job"].get(key) for key in fields}}
    what = "; ".join(f"{flag}: stored {_flag_text(flag, stored[flag])}, given {_flag_text(flag, given[flag])}" for flag in differ)
    fix = " ".join(_flag_text(flag, stored[flag], as_option=True) for flag in differ)
    raise InputError(f"the stored run {state_file.stem} was started with other flags ({what}); "
                     f"give {fix}, or remove {state_file} to start a new run")


def _same_flag(flag: str, stored: Any, given: Any) -> bool:
    """Whether a stored flag's value and the one given run the same: two training commands that
    split into the same arguments do, however they were spaced or quoted."""
    if flag == "--command" and stored and given:
        return _command_argv(stored) == _command_argv(given)
    return bool(stored == given)


def _command_argv(command: str) -> list[str]:
    """The arguments a --command runs as (split as a shell splits words, no shell started)."""
    try:
        return shlex.split(command)
    except ValueError as exc:  # an unclosed quote, a trailing backslash
        raise InputError(f"--command {command}: cannot be split into arguments ({exc}); close its quotes") from None


def _flag_text(flag: str, value: Any, as_option: bool = False) -> str:
    """A stored flag's value as text, or (``as_option``) as the option that gives it."""
    if flag == CONFIG_CONTENT:  # compared only for the same file, which the stored run had
        text = f"sha256 {value[:12]}"
        return f"the --training-config file as it was when the run started ({text})" if as_option else text
    if value is None or value == {}:
        return f"no {flag}" if as_option else "none"
    if flag == "--job":
        text = ", ".join(f"{key}={json.dumps(v)}" for key, v in value.items())
        return f"a --job file with {text}" if as_option else text
    if flag == "--param":
        return " ".join(f"--param {shlex.quote(f'{key}={json.dumps(v)}')}" for key, v in value.items())
    text = value if isinstance(value, str) else json.dumps(value)
    return f"{flag} {shlex.quote(text)}" if as_option else text


def _start_run(
    args: argparse.Namespace, job: Job, job_id: str, env: SpotEnvironment, persist: Persist, selector_file: Path,
    load: Load,
) -> RunDriver:
    """Every check before anything launches; the training command follows the runtime's contract.

    The run keeps absolute paths (the workdir's, the checkpoint URI's): a re-run from another
    directory re-attaches, and relaunches the stored command, with the same checkpoints."""
    checkpoint_uri = _absolute(args.checkpoint_uri) if args.checkpoint_uri else args.checkpoint_uri
    if checkpoint_uri:
        fs, path = env.locate(checkpoint_uri)
        if fs.isfile(path):  # the runtime writes progress.json and checkpoints under it
            raise InputError(f"--checkpoint-uri {args.checkpoint_uri}: is a file; give a directory (new or existing) for the checkpoints")
    params = dict(parse_param(p) for p in args.param)
    pools = _names([args.pools]) if args.pools else list(env.market.history(datetime.now(timezone.utc)).pools)
    try:
        config = RunConfig(job_id=job_id, job=job, pools=tuple(pools), policy=args.policy, policy_params=params,
                           forecaster=args.forecaster, seconds_per_slot=env.seconds_per_slot,
                           max_instances_limit=args.max_instances_limit)
        learnt = None
        if args.policy == "selector":
            learnt = starting_state(_read_text(selector_file), f"file {selector_file}")
            if learnt is None:
                print(f"selector: {selector_file} does not exist yet; starting a fresh selector")
        if args.training_command:
            command = _command_argv(args.training_command)
            driver = RunDriver.start(env, config, lambda uri: command, checkpoint_uri, persist, learnt, load)
        else:
            training_config = _read_json(args.training_config)
            if training_config is None:
                raise InputError(f"--training-config {args.training_config}: no such file")
            runtime = TrainConfig.from_dict(training_config).runtime
            driver = RunDriver.start(env, config, lambda uri: runtime_command(uri, runtime=runtime),
                                     checkpoint_uri, persist, learnt, load)
            write_config(driver.training.checkpoint_uri, training_config)
    except (ValueError, TraceError, SelectorStoreError) as exc:  # JobError, BudgetError, a bad pool, policy or state
        raise InputError(str(exc)) from None
    return driver


def cmd_synth(args: argparse.Namespace) -> int:
    """Write a seeded synthetic market (docs/evaluation.md: markets the project has never seen)."""
    try:
        config = SyntheticMarketConfig(
            seed=args.seed, pools=args.pools, days=args.days, regimes=not args.no_regimes,
            diurnal_amplitude=args.diurnal_amplitude, collapses_per_week=args.collapses_per_week,
            flap_episodes_per_day=args.flap_episodes_per_day, crunches_per_day=args.crunches_per_day,
            daily_availability=args.daily_availability, zones_per_region=args.zones_per_region,
            price_trend_per_week=args.price_trend_per_week,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    market = generate(config)
    try:
        path = write_trace(market, args.out)
    except OSError as exc:
        raise InputError(f"--out {args.out}: cannot write ({exc.strerror})") from None
    print(f"{config.pools} pools, {config.days:g} days, {len(market.collapses)} collapse(s), seed {config.seed} -> {path}")
    return 0


def _job_id(path: Path) -> str:
    """A job id from the job file's name: running the same file again re-attaches to its run."""
    readable = re.sub(r"[^a-z0-9-]+", "-", path.stem.lower()).strip("-")
    return readable or "job"


def _read_json(path: Path) -> Any:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not a readable JSON file ({exc})") from None


def _read_text(path: Path) -> str | None:
    """The file's text, ``None`` when it does not exist (the selector store's reader)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror})") from None


def _names(values: Sequence[str]) -> list[str]:
    """Repeated options and comma lists alike, in order."""
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def _live_forecast(args: argparse.Namespace, trace: Trace, pools: list[str] | None) -> int:
    if args.at is None or args.out is None:
        raise InputError("--at and --out are required without --backtest (the instant to forecast from, the JSON file)")
    try:
        at = parse_timestamp(args.at)
    except ValueError:
        raise InputError(f"--at {args.at!r}: not a UTC ISO-8601 timestamp like 2025-10-10T12:00:00Z") from None
    bad = [n for n in args.at_least if n < 1]
    if bad:
        raise InputError(f"--at-least {bad}: counts must be >= 1 instance")
    if not args.max_staleness_hours >= 0:
        raise InputError(f"--max-staleness-hours {args.max_staleness_hours:g}: must be >= 0 hours")
    try:
        snapshot = snapshot_at(trace, at, args.slot_hours, pools, args.max_staleness_hours)
    except TraceError as exc:
        raise InputError(str(exc)) from None
    market = snapshot.market
    forecaster = _forecaster(args.model, slot_hours=market.slot_hours)
    try:
        forecast = forecaster.forecast(market, args.horizon)
    except ValueError as exc:
        raise InputError(f"--model {args.model}: {exc}") from None
    document = forecast_document(forecast, market, at, args.at_least, forecaster.name, snapshot)
    _write_json(args.out, document)
    chosen = ", ".join(f"{pool}: {entry['model']}" for pool, entry in document["pools"].items())
    stale = [pool for pool, entry in document["pools"].items() if entry["stale"]]
    lag = f"data until {document['data_until']}, {document['staleness_seconds'] / 60:.0f} min before --at"
    if stale:
        lag += f"; availability unknown (counted as 0) in {', '.join(stale)}: last tick too old"
    print(f"forecast of {args.horizon} slots after {document['at']} from {market.describe()} ({lag}) ({chosen}) "
          f"-> {args.out}")
    return 0


def _forecaster(name: str, option: str = "--model", slot_hours: float | None = None) -> Forecaster:
    """Forecaster ``name`` with its defaults (a daily season of ``slot_hours`` slots); the oracle is
    refused, it would read the future."""
    if name not in LIVE_FORECASTERS:
        raise InputError(f"{option} {name!r}: unknown forecaster; choose from {list(LIVE_FORECASTERS)}")
    return make_forecaster(name, slot_hours=slot_hours)


def _backtest(args: argparse.Namespace, trace: Trace, pools: list[str] | None) -> int:
    from airflow_provider_spotsched.forecast.backtest_report import text_table, write_backtest_report

    models = _names(args.models) or list(BACKTEST_MODELS)
    bad = [n for n in args.at_least if n < 1]
    if bad:
        raise InputError(f"--at-least {bad}: counts must be >= 1 instance")
    for name in models:
        _forecaster(name, "--models")
    try:
        market = resample(trace, slot_hours=args.slot_hours, pools=pools)
        backtest = run_backtest(market, models, args.horizon, step=args.step, min_history=args.min_history,
                                workers=args.workers, on_progress=_ModelProgress(), origins=args.origins,
                                fresh=args.fresh, at_least=args.at_least)
    except (TraceError, BacktestError) as exc:
        raise InputError(str(exc)) from None
    name = trace_name(str(args.trace))
    out = args.out_dir or Path("docs") / "forecasting" / name
    command = "spotsched " + " ".join(shlex.quote(a) for a in args.argv)
    try:
        written = write_backtest_report(backtest, out, command, datetime.now(timezone.utc), name)
    except OSError as exc:
        raise InputError(f"--out-dir {out}: cannot write ({exc.strerror})") from None
    print(text_table(backtest))
    print(f"{len(backtest.origins)} origins x {len(backtest.models)} models -> {out}: {', '.join(p.name for p in written)}")
    return 0


class _ModelProgress:
    """Models done / total on stderr as each finishes, so a long backtest shows life."""

    def __init__(self) -> None:
        self.began = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        elapsed = _clock(time.monotonic() - self.began)
        print(f"backtest: {done}/{total} models done, {elapsed} elapsed", file=sys.stderr, flush=True)


class _ProgressLine:
    """Scenarios done / total, elapsed and ETA, on one stderr line (rewritten in place on a terminal)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, done: int, total: int, selector_done: int, selector_total: int, elapsed: float) -> None:
        finished = done == total and selector_done == selector_total
        if not (self.tty or finished or elapsed - self.last >= 10.0):
            return
        self.last = elapsed
        eta = f", ETA {_clock(elapsed / done * (total - done))}" if 0 < done < total else ""
        selector = f", selector {selector_done}/{selector_total} traces" if selector_total else ""
        line = f"evaluate: {done}/{total} scenarios{selector}, {_clock(elapsed)} elapsed{eta}"
        end = "\n" if finished or not self.tty else ""
        print(("\r" if self.tty else "") + line.ljust(72), end=end, file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _write_json(path: Path, data: Any, what: str = "--out") -> None:
    """Replace ``path`` in one step: a run killed mid-write leaves the previous state, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(f"{what} {path}: cannot write ({exc.strerror})") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotsched", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sim = commands.add_parser("simulate", help="replay one policy on one job over a trace")
    sim.add_argument("--trace", type=Path, required=True, help="trace CSV (optionally .gz), the spec's format")
    sim.add_argument("--job", type=Path, required=True, help="job JSON file, the spec's format")
    sim.add_argument("--policy", required=True, help="policy name, e.g. on-demand, greedy, chc, selector")
    sim.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                     help="policy parameter (repeatable); VALUE is read as JSON where it parses, else as a string")
    sim.add_argument("--pools", help="comma-separated pools to schedule over (default: all in the trace)")
    sim.add_argument("--seed", type=int, help="seed for policies that take one (a --param seed=... wins)")
    sim.add_argument("--max-instances-limit", type=int, default=DEFAULT_MAX_INSTANCES_LIMIT, metavar="N",
                     help="refuse a job with max_instances above N (default %(default)s)")
    sim.add_argument("--out", type=Path, required=True, help="where to write the simulation-result JSON")
    add_throughput_flags(sim)
    sim.set_defaults(run=cmd_simulate)

    default = GridConfig()
    ev = commands.add_parser("evaluate", help="run the evaluation grid and write tables and plots")
    ev.add_argument("--out", type=Path, required=True, help="output folder for results.csv, summary.md, *.png")
    ev.add_argument("--traces", type=Path, nargs="+", default=list(default.traces),
                    help="trace files (default: the two shipped traces)")
    ev.add_argument("--scenarios", type=int, default=default.scenarios, help="start times per trace")
    ev.add_argument("--policies", nargs="+", default=list(default.policies), choices=list(POLICY_SPECS),
                    metavar="POLICY",
                    help=f"policies to run, of {', '.join(POLICY_SPECS)} (default: all but {', '.join(OPT_IN_POLICIES)})")
    ev.add_argument("--nmax", type=int, nargs="+", default=list(default.n_max), help="N_max values")
    ev.add_argument("--slack", type=float, nargs="+", default=list(default.slack), help="deadline slack factors")
    ev.add_argument("--overhead", type=float, nargs="+", default=list(default.overhead),
                    help="reconfiguration overheads, hours")
    ev.add_argument("--base-hours", type=float, default=default.base_hours,
                    help="hours the job takes on N_max on-demand instances, without overhead")
    ev.add_argument("--hard-deadline-factor", type=float, default=default.hard_deadline_factor,
                    help="hard deadline as a multiple of the soft one (default %(default)s)")
    ev.add_argument("--seed", type=int, default=default.seed, help="base seed of seeded policies")
    add_throughput_flags(ev)
    ev.add_argument("--workers", "--jobs", "-j", type=int, default=2, help="worker processes")
    ev.set_defaults(run=cmd_evaluate)

    fc = commands.add_parser("forecast", help="forecast a trace's pools from an instant, or backtest the forecasters")
    fc.add_argument("--trace", type=Path, required=True, help="trace CSV (optionally .gz), the spec's format")
    fc.add_argument("--horizon", type=int, required=True, help=f"slots ahead, 1..{MAX_HORIZON}")
    fc.add_argument("--slot-hours", type=float, default=1.0, help="slot length, hours (default 1)")
    fc.add_argument("--pools", action="append", default=[], metavar="POOL[,POOL]",
                    help="pools to forecast (repeatable or comma list; default: all)")
    fc.add_argument("--market", action="append", default=[], metavar="POOL[,POOL]", help="same as --pools")
    fc.add_argument("--at", help="forecast from the slot starting at this UTC timestamp, using data up to it only")
    fc.add_argument("--max-staleness-hours", type=float, default=MAX_STALENESS_HOURS,
                    help="accept an --at up to this many hours after the trace's newest tick (live data lags the "
                         "clock; default %(default)g)")
    fc.add_argument("--model", default="auto", help="forecaster (default auto: a model chosen per pool)")
    fc.add_argument("--at-least", type=int, nargs="+", default=[], metavar="N",
                    help="also give P(available >= N) for these counts (N = 1 always); "
                         "with --backtest, score those chances too")
    fc.add_argument("--out", type=Path, help="forecast JSON file to write")
    fc.add_argument("--backtest", action="store_true", help="backtest the forecasters instead of forecasting")
    fc.add_argument("--models", action="append", default=[], metavar="MODEL[,MODEL]",
                    help=f"models to backtest (default: {', '.join(BACKTEST_MODELS)}; persistence is always added)")
    fc.add_argument("--step", type=int, default=6, help="slots between backtest origins (default 6)")
    fc.add_argument("--origins", type=int,
                    help="instead of every --step slots, this many backtest origins spread evenly over the trace")
    fc.add_argument("--fresh", action="store_true",
                    help="a new forecaster at each backtest origin (as a job submitted there), "
                         "instead of one running through them in order")
    fc.add_argument("--min-history", type=int,
                    help="slots known at the first origin (default: two weeks, or half the trace if shorter)")
    fc.add_argument("--workers", "-j", type=int, default=1, help="backtest models in this many processes at once")
    fc.add_argument("--out-dir", type=Path,
                    help="backtest output folder (default docs/forecasting/<trace name>/)")
    fc.set_defaults(run=cmd_forecast)

    run = commands.add_parser("run", help="run a job for real on local workers over a replayed trace, to its end")
    run.add_argument("--job", type=Path, required=True, help="job JSON file, the spec's format")
    training = run.add_mutually_exclusive_group(required=True)
    training.add_argument("--training-config", type=Path, help="the runtime's CONFIG JSON (LoRA fine-tune)")
    training.add_argument("--command", dest="training_command",
                          help="a training command that follows the runtime's contract instead")
    run.add_argument("--workdir", type=Path, required=True, help="job directories, checkpoints, run state")
    run.add_argument("--trace", default="gcp", help='"gcp", "aws" (the shipped traces) or a trace file (default gcp)')
    run.add_argument("--seconds-per-slot", type=float, default=DEFAULT_SECONDS_PER_SLOT,
                     help="wall-clock seconds per market slot (default %(default)s)")
    run.add_argument("--market-start", help="UTC timestamp in the trace where the job is submitted")
    run.add_argument("--history-slots", type=int, help="slots of market history before submission")
    run.add_argument("--pools", help="comma-separated pools (default: every pool of the trace)")
    run.add_argument("--policy", default="selector", help="policy name (default selector)")
    run.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="policy parameter (repeatable)")
    run.add_argument("--forecaster", default="persistence", help="the model whose forecast is logged each slot")
    run.add_argument("--max-instances-limit", type=int, default=DEFAULT_MAX_INSTANCES_LIMIT, metavar="N",
                     help="refuse a job with max_instances above N (default %(default)s)")
    run.add_argument("--checkpoint-uri", help="where checkpoints go (default: under --workdir)")
    run.add_argument("--job-id", help="the run's id (default: from the job file's name); the same id re-attaches")
    run.add_argument("--selector-state", type=Path, help="the selector's learnt state (default: WORKDIR/selector.json)")
    run.add_argument("--out", type=Path, help="result JSON with the decision log")
    run.set_defaults(run=cmd_run)

    syn = commands.add_parser("synth", help="write a seeded synthetic spot market as a trace file")
    syn.add_argument("--out", type=Path, required=True, help="trace file to write (.csv or .csv.gz)")
    syn.add_argument("--seed", type=int, default=0, help="random seed (the same seed, the same market)")
    syn.add_argument("--pools", type=int, default=6, help="spot pools (1..26)")
    syn.add_argument("--days", type=float, default=21.0, help="length in days")
    syn.add_argument("--no-regimes", action="store_true", help="availability always plentiful (no regime switching)")
    syn.add_argument("--diurnal-amplitude", type=float, default=0.3, help="daily price cycle, fraction of the mean (0: flat)")
    syn.add_argument("--collapses-per-week", type=float, default=1.0, help="all pools at 0 capacity, times per week")
    syn.add_argument(
        "--flap-episodes-per-day", type=float, default=0.0,
        help="per pool and day, hours-long episodes of hourly drops and returns (0: none)",
    )
    syn.add_argument(
        "--crunches-per-day", type=float, default=0.0,
        help="per day, waves of capacity loss that spread from pool to pool hour by hour (0: none)",
    )
    syn.add_argument(
        "--daily-availability", type=float, default=0.0,
        help="share of each pool's count taken in its busiest hour, on a daily cycle with its price (0: none)",
    )
    syn.add_argument(
        "--zones-per-region", type=int, default=1,
        help="consecutive pools that share one price series, as a region's zones do (1: none)",
    )
    syn.add_argument(
        "--price-trend-per-week", type=float, default=0.0,
        help="spot prices' drift, a share per week compounded: -0.1 falls 10%% a week (0: none)",
    )
    syn.set_defaults(run=cmd_synth)
    return parser


class _WarningLines(logging.Handler):
    """The library's warnings on stderr, one ``spotsched <command>: warning: ...`` line each."""

    def __init__(self, command: str) -> None:
        super().__init__(logging.WARNING)
        self.command = command

    def emit(self, record: logging.LogRecord) -> None:
        print(f"spotsched {self.command}: warning: {record.getMessage()}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    library = logging.getLogger("airflow_provider_spotsched")
    warnings = _WarningLines(args.command)
    library.addHandler(warnings)
    try:
        return args.run(args)
    except InputError as exc:
        print(f"spotsched {args.command}: error: {exc}", file=sys.stderr)
        return BAD_INPUT
    except KeyboardInterrupt:  # `spotsched run` says what its run was left in; elsewhere, one line, no traceback
        print(f"spotsched {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    finally:
        library.removeHandler(warnings)


if __name__ == "__main__":
    sys.exit(main())
