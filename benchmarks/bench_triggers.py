"""What waiting costs the triggerer, and how fast a slot boundary becomes a running allocation.

1. Waiting triggers: 1,000 :class:`SpotJobTrigger` s waiting on one real local job (a fake
   worker, tests/fake_worker.py) in ONE asyncio event loop for ``--seconds``, polling every
   ``--poll-interval`` seconds (each poll one ``status`` call in a thread, as in the triggerer);
   their boundary lies a day ahead and the job neither ends nor is preempted, so none fires.
   The same is measured for 1,000 :class:`SpotMarketTrigger` s watching the shipped GCP trace
   for a price that never comes, and for 1,000 bare ``asyncio.sleep`` loops (the baseline).
   Each kind runs in a fresh process of this run, so its RSS growth is its own; the table gives
   CPU seconds (user + system, every thread) and RSS growth per trigger, and the ratio to the
   baseline.
2. Boundary to allocation: the fine-tune operator on the local backend (fake worker, replayed
   GCP market, ``--seconds-per-slot``): for each of ``--boundaries`` slot boundaries, the time
   from the boundary instant to the trigger's event, and from the event to ``execute_slot``
   deferring again (the slot decided, the backend reconciled, the state saved); median and p90.
   ``[spotsched] min_deferral_seconds`` is 0 here (unless set): with the default 15 s the
   operator waits in the worker for boundaries closer than that, every one of these short
   slots, and never defers, so the path from a boundary to its allocation is measured bare.

Plain script (prints a table):

    python benchmarks/bench_triggers.py
    python benchmarks/bench_triggers.py --triggers 1000 --seconds 30 --poll-interval 5 --boundaries 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import psutil

os.environ.setdefault("AIRFLOW__SPOTSCHED__MIN_DEFERRAL_SECONDS", "0")  # before Airflow reads its config: see phase 2
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the fake task context and worker the operator tests use
from tests.task_context import TaskContext, TaskStateStore, rebuilt  # noqa: E402

FAKE_WORKER = REPO / "tests" / "fake_worker.py"
POOLS = ["us-east4-a", "europe-west1-c"]
MARKET_START = "2025-10-11T03:10:00Z"


def fine_tune_operator(workdir: Path, seconds_per_slot: float, poll_interval: float, step_s: float, policy: str):
    from airflow_provider_spotsched.operators.fine_tune import DeadlineSpotFineTuneOperator

    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "worker.json"
    config.write_text(json.dumps({"samples": 10**9, "step_s": step_s}))
    checkpoint = workdir / "checkpoint"
    return DeadlineSpotFineTuneOperator(
        task_id="fine_tune", pools=POOLS, work=240, deadline=6.0, hard_deadline_factor=1.5,
        throughput={"alpha": 60.0}, value=100.0, max_instances=2, reconfig_overhead_hours=0.2,
        command=[sys.executable, str(FAKE_WORKER), "--config", str(config), "--checkpoint-uri", str(checkpoint)],
        checkpoint_uri=str(checkpoint),
        backend_options={"workdir": str(workdir / "local"), "seconds_per_slot": seconds_per_slot, "market_start": MARKET_START},
        policy=policy, forecaster="seasonal-naive", poll_interval=poll_interval, deferrable=True,
    )


def start(operator: Any, context: dict) -> Any:
    from airflow.sdk.exceptions import TaskDeferred

    try:
        operator.execute(context)
    except TaskDeferred as deferred:
        return deferred
    raise RuntimeError("the operator finished without deferring")


# -- 1. waiting triggers -------------------------------------------------------------------------


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_phase(kind: str, count: int, seconds: float, poll_interval: float, job_trigger: dict | None) -> dict:
    """One kind of waiter, ``count`` of them in one event loop for ``seconds`` (run in a child)."""
    from airflow_provider_spotsched.triggers.market import SpotMarketTrigger
    from airflow_provider_spotsched.triggers.spot_job import SpotJobTrigger

    polls = [0]

    def make(i: int):
        if kind == "sleep":
            async def sleeper() -> None:
                while True:
                    await asyncio.sleep(poll_interval)
                    polls[0] += 1
            return sleeper()
        if kind == "job":
            trigger = SpotJobTrigger(**job_trigger)
        else:
            now = datetime.now(timezone.utc)
            trigger = SpotMarketTrigger(
                market={"kind": "trace", "options": {"path": "gcp"}}, pools=POOLS,
                conditions={"price_below": 0.01}, timeout_at=(now + timedelta(days=1)).isoformat(),
                poll_interval=poll_interval, history_hours=24.0,
                replay={"origin": now.isoformat(), "market_start": MARKET_START, "seconds_per_slot": 3600.0},
            )

        async def consume() -> None:
            async for event in rebuilt(trigger).run():
                raise RuntimeError(f"a waiting trigger fired: {event.payload}")
        return consume()

    async def main() -> dict:
        process = psutil.Process()
        rss0, cpu0 = process.memory_info().rss, cpu_seconds()
        tasks = [asyncio.create_task(make(i)) for i in range(count)]
        await asyncio.sleep(seconds)
        rss1, cpu1 = process.memory_info().rss, cpu_seconds()
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return {"kind": kind, "cpu_s": cpu1 - cpu0, "rss_bytes": rss1 - rss0, "polls": polls[0]}

    # import everything first, so that neither imports nor the shipped trace's parse count as waiting
    if kind == "market":
        from airflow_provider_spotsched.hooks.market_spec import MarketSpec

        MarketSpec("trace", options={"path": "gcp"}).observe(
            datetime(2025, 10, 10, tzinfo=timezone.utc), datetime(2025, 10, 11, tzinfo=timezone.utc)
        )
    return asyncio.run(main())


def waiting_triggers(args: argparse.Namespace, workdir: Path) -> list[dict]:
    operator = fine_tune_operator(workdir, seconds_per_slot=3600.0, poll_interval=args.poll_interval, step_s=1.0, policy="uniform-progress")
    context = TaskContext(TaskStateStore())
    deferred = start(operator, context)
    try:
        kwargs = deferred.trigger.serialize()[1]
        kwargs["boundary"] = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
        rows = []
        for kind in ("sleep", "job", "market"):
            child = subprocess.run(
                [sys.executable, __file__, "--phase", kind, "--triggers", str(args.triggers), "--seconds", str(args.seconds),
                 "--poll-interval", str(args.poll_interval), "--job-trigger", json.dumps(kwargs)],
                cwd=REPO, capture_output=True, text=True, timeout=args.seconds + 600,
            )
            if child.returncode != 0:
                raise RuntimeError(f"phase {kind} failed:\n{child.stderr[-3000:]}")
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        return rows
    finally:
        operator.on_kill()


# -- 2. boundary to allocation -------------------------------------------------------------------


def boundary_latency(args: argparse.Namespace, workdir: Path) -> list[dict]:
    from airflow.sdk.exceptions import TaskDeferred

    operator = fine_tune_operator(workdir, args.seconds_per_slot, poll_interval=0.2, step_s=0.2, policy=args.policy)
    context = TaskContext(TaskStateStore())
    deferred = start(operator, context)
    samples = []
    try:
        while len(samples) < args.boundaries:
            trigger = rebuilt(deferred.trigger)
            boundary = datetime.fromisoformat(trigger.boundary)
            event = asyncio.run(first_event(trigger))
            fired = time.time()
            try:
                operator.execute_slot(context, event)
                raise RuntimeError("the job finished during the benchmark; give the fake worker more samples")
            except TaskDeferred as again:
                deferred = again
            applied = time.time()
            if event["reason"] == "boundary":
                since_boundary = fired - boundary.timestamp()
                samples.append({"fire_s": since_boundary, "apply_s": applied - fired, "total_s": applied - boundary.timestamp()})
    finally:
        operator.on_kill()
    return samples


async def first_event(trigger: Any) -> dict:
    async for event in trigger.run():
        return event.payload
    raise RuntimeError("the trigger ended without an event")


# -- report --------------------------------------------------------------------------------------


def p90(values: list[float]) -> float:
    return float(np.percentile(values, 90))


def report(rows: list[dict], samples: list[dict], args: argparse.Namespace) -> None:
    n = args.triggers
    base = next(r for r in rows if r["kind"] == "sleep")
    print(f"\n{n} waiters in one event loop for {args.seconds:g} s, polling every {args.poll_interval:g} s "
          f"({psutil.cpu_count()} CPU(s), load average {psutil.getloadavg()[0]:.1f})")
    print(f"{'waiter':<28}{'CPU s total':>12}{'CPU ms/waiter':>15}{'x sleep':>9}{'RSS MiB':>10}{'RSS KiB/waiter':>16}{'x sleep':>9}")
    names = {"sleep": "asyncio.sleep loop", "job": "SpotJobTrigger (local)", "market": "SpotMarketTrigger (trace)"}
    for r in rows:
        cpu_ratio = r["cpu_s"] / base["cpu_s"] if base["cpu_s"] > 0 else float("nan")
        rss_ratio = r["rss_bytes"] / base["rss_bytes"] if base["rss_bytes"] > 0 else float("nan")
        print(f"{names[r['kind']]:<28}{r['cpu_s']:>12.2f}{1000 * r['cpu_s'] / n:>15.3f}{cpu_ratio:>9.1f}"
              f"{r['rss_bytes'] / 2**20:>10.1f}{r['rss_bytes'] / n / 1024:>16.1f}{rss_ratio:>9.1f}")
    if samples:
        print(f"\nslot boundary -> allocation applied, local backend, fake worker, policy {args.policy}, "
              f"{len(samples)} boundaries of {args.seconds_per_slot:g} s slots")
        print(f"{'phase':<42}{'median s':>10}{'p90 s':>10}")
        for key, label in (("fire_s", "boundary -> trigger fires"), ("apply_s", "fires -> decided + reconciled + saved"),
                           ("total_s", "boundary -> allocation applied")):
            values = [s[key] for s in samples]
            print(f"{label:<42}{statistics.median(values):>10.3f}{p90(values):>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triggers", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the waiters wait")
    parser.add_argument("--poll-interval", type=float, default=5.0)
    parser.add_argument("--boundaries", type=int, default=8)
    parser.add_argument("--seconds-per-slot", type=float, default=3.0)
    parser.add_argument("--policy", default="chc")
    parser.add_argument("--phase", choices=("sleep", "job", "market"), help=argparse.SUPPRESS)
    parser.add_argument("--job-trigger", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        job_trigger = json.loads(args.job_trigger) if args.job_trigger else None
        print(json.dumps(measure_phase(args.phase, args.triggers, args.seconds, args.poll_interval, job_trigger)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = waiting_triggers(args, Path(tmp) / "waiting")
        samples = boundary_latency(args, Path(tmp) / "latency")
    report(rows, samples, args)


if __name__ == "__main__":
    main()
