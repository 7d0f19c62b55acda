"""Measure what a reconfiguration costs on the local backend: the spec's delta, for real.

Runs the real runtime (the built-in tiny model, CPU) on on-demand local workers through a few
world-size changes. For each change it prints the phases in seconds, read from the supervisor's
``events.jsonl`` (SIGTERM, exit, launch times), the runtime's ``resumed`` event (rendezvous and
checkpoint load) and the moment rank 0's first log lines appeared (polled every 50 ms):

- stop: first SIGTERM to the last old worker's exit (emergency checkpoint included);
- relaunch: last exit to the new workers' launch (the supervisor's tick);
- start: launch to the ``resumed`` line, less rendezvous and load (interpreter, imports, model build);
- rendezvous, load: as the runtime reports them;
- first step: the ``resumed`` line to the first ``step`` line;
- total: first SIGTERM to the first step, as hours and as a fraction of a 1-hour slot,

next to the delta (``reconfig_overhead_hours``) of a job file. Plain script:

    python benchmarks/bench_reconfiguration.py                      # world sizes 1 -> 2 -> 3 -> 1
    python benchmarks/bench_reconfiguration.py --sizes 2 1 --job docs/examples/job.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from airflow_provider_spotsched.backends.base import TrainingJob
from airflow_provider_spotsched.backends.local import LocalBackend
from airflow_provider_spotsched.market.slots import SlotMarket
from airflow_provider_spotsched.scheduling.model import Allocation, Job

CONFIG = {  # the runtime's tiny job; far more samples than the benchmark will train
    # the builtin loop: it alone runs several workers (runtime "hf" is one process per job)
    "runtime": "loop", "samples": 1_000_000, "batch_size": 4, "seq_len": 32, "log_every_steps": 1,
    "checkpoint": {"keep": 2, "min_interval_s": 1.0, "max_interval_s": 2.0},
}
# on-demand workers only: the market never caps them
NO_SPOT = SlotMarket(
    pools=("none",), start=datetime(2025, 1, 1, tzinfo=timezone.utc), slot_hours=1.0,
    spot_price=np.ones((1, 1)), available=np.zeros((1, 1), dtype=np.int64), on_demand_price=1.0,
)
PHASES = ("stop", "relaunch", "start", "rendezvous", "load", "first step", "total")


def wait_for(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


class Run:
    """One job on the local backend, with the wall time at which each of rank 0's log lines appeared."""

    def __init__(self, root: Path, stop_timeout_s: float) -> None:
        self.backend = LocalBackend(
            root / "work",
            market=NO_SPOT,
            stop_timeout_s=stop_timeout_s,
            poll_interval_s=0.05,
        )
        config = root / "config.json"
        config.write_text(json.dumps(CONFIG))
        checkpoint = root / "checkpoint"
        self.job = TrainingJob(
            job_id="bench-reconfiguration",
            command=(sys.executable, "-m", "airflow_provider_spotsched.runtime", "--config", str(config),
                     "--checkpoint-uri", str(checkpoint)),
            checkpoint_uri=str(checkpoint),
            pools=(),
        )
        self.jobdir = self.backend.jobdir(self.job)
        self.seen: dict[tuple[str, int], float] = {}  # (log file, line number) -> wall time first seen

    def poll_logs(self) -> None:
        now = time.time()
        for log in self.jobdir.logs.glob("*.out"):
            for number, _ in enumerate(log.read_text().splitlines()):
                self.seen.setdefault((log.name, number), now)

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.jobdir.events.read_text().splitlines()]

    def rank0_lines(self, generation: int) -> list[tuple[float, dict]]:
        """(time seen, event) of every JSON line rank 0 of ``generation`` printed so far."""
        (launch,) = [e for e in self.events() if e["event"] == "launched" and e["generation"] == generation
                     and e["rank"] == 0]
        log = self.jobdir.logs / f"{launch['instance_id']}.g{generation}.out"
        lines = log.read_text().splitlines() if log.exists() else []
        return [(self.seen[(log.name, n)], json.loads(text)) for n, text in enumerate(lines)
                if text.startswith("{") and (log.name, n) in self.seen]

    def first_step(self, generation: int) -> bool:
        self.poll_logs()
        return any(e["event"] == "step" for _, e in self.rank0_lines(generation))

    def resize(self, size: int, timeout: float) -> int:
        """Reconcile to ``size`` workers and wait for rank 0's first step; return the new generation."""
        before = self.latest_generation()
        self.backend.reconcile(self.job, Allocation((), size))
        wait_for(f"the launch of {size} workers", lambda: self.latest_generation() > before, timeout)
        generation = self.latest_generation()
        wait_for(f"the first step on {size} workers", lambda: self.first_step(generation), timeout)
        return generation

    def latest_generation(self) -> int:
        """The last worker set launched (-1 before the first); exits if a worker failed."""
        self.poll_logs()
        status = self.backend.status(self.job)
        if status.failed:
            raise SystemExit(f"a worker failed: {status.to_dict()}")
        if not self.jobdir.events.exists():
            return -1
        return max((e["generation"] for e in self.events() if e["event"] == "launched"), default=-1)

    def phases(self, old: int, new: int) -> dict[str, float]:
        events = self.events()
        signalled = min(e["time"] for e in events if e["event"] == "sigterm" and e["generation"] == old)
        exited = max(e["time"] for e in events if e["event"] == "exited" and e["generation"] == old)
        launched = min(e["time"] for e in events if e["event"] == "launched" and e["generation"] == new)
        lines = self.rank0_lines(new)
        resumed_at, resumed = next((t, e) for t, e in lines if e["event"] == "resumed")
        step_at = next(t for t, e in lines if e["event"] == "step")
        return {
            "stop": exited - signalled,
            "relaunch": launched - exited,
            "start": resumed_at - launched - resumed["rendezvous_s"] - resumed["load_s"],
            "rendezvous": resumed["rendezvous_s"],
            "load": resumed["load_s"],
            "first step": step_at - resumed_at,
            "total": step_at - signalled,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 1], help="world sizes in turn")
    parser.add_argument("--train-s", type=float, default=3.0, help="training between changes (seconds)")
    parser.add_argument("--job", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "examples" / "job.json",
                        help="the job whose reconfig_overhead_hours (delta) the figures are set against")
    parser.add_argument("--timeout", type=float, default=300.0, help="the longest wait for any one phase")
    args = parser.parse_args()
    if len(args.sizes) < 2 or min(args.sizes) < 1:
        parser.error("--sizes needs at least two world sizes, each >= 1")
    delta = Job.from_dict(json.loads(args.job.read_text())).reconfig_overhead_hours

    with tempfile.TemporaryDirectory(prefix="bench-reconfiguration-") as tmp:
        run = Run(Path(tmp), stop_timeout_s=args.timeout)
        try:
            generation = run.resize(args.sizes[0], args.timeout)
            rows = []
            for old_size, size in zip(args.sizes, args.sizes[1:]):
                time.sleep(args.train_s)
                new_generation = run.resize(size, args.timeout)
                rows.append((f"{old_size} -> {size}", run.phases(generation, new_generation)))
                generation = new_generation
        finally:
            run.backend.release(run.job)

    print(f"reconfiguration phases (s), real runtime, tiny model on CPU, world sizes {args.sizes}")
    print(f"{'change':<10}" + "".join(f"{p:>12}" for p in PHASES))
    for label, phases in rows:
        print(f"{label:<10}" + "".join(f"{phases[p]:>12.2f}" for p in PHASES))
    median = {p: statistics.median(phases[p] for _, phases in rows) for p in PHASES}
    print(f"{'median':<10}" + "".join(f"{median[p]:>12.2f}" for p in PHASES))
    total = median["total"]
    print(f"\nmeasured total: {total:.1f} s = {total / 3600:.4f} h = {total / 3600:.1%} of a 1-hour slot")
    print(f"spec's delta in {args.job}: reconfig_overhead_hours = {delta:g} h = {delta * 3600:.0f} s "
          f"({delta:.0%} of a 1-hour slot)")


if __name__ == "__main__":
    main()
