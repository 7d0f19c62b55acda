"""Measure a job's throughput on this machine: the ``throughput.alpha`` its job spec should say.

The scheduler plans with ``H(n) = alpha * n + beta`` samples per hour and corrects it online from
measured progress (:mod:`airflow_provider_spotsched.scheduling.throughput_estimate`); a declared
``alpha`` far off makes the first slots' plan wrong. Run this once on an instance of the machine
type (the runtime-only install is enough): it trains the job's own config for ``--steps`` steps
on every GPU of the machine, through the same node launcher the backends use, in a scratch
checkpoint directory, and prints what the runtime measured (``samples_per_second`` in
``progress.json``: optimizer steps only, checkpoint saves excluded) as JSON; here the demo's paced
CPU instance (``samples_per_second_per_worker: 20``, ``batch_size: 4``, ``seq_len: 32``)::

    python -m airflow_provider_spotsched.runtime.calibrate --config CONFIG.json --steps 12
    {"samples_per_second": 20.0, "processes": 1, "steps": 12, "throughput": {"alpha": 72000.0, "beta": 0.0}}

One instance gives ``alpha``; ``beta`` (what several instances lose to communication) stays 0 and
is left to the online estimate. The first steps carry warm-up (CUDA context, kernel selection),
so more steps measure closer to the steady rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_spotsched.runtime.contract import EXIT_FAILURE, EXIT_USAGE, read_progress, runtime_command
from airflow_provider_spotsched.runtime.node import BACKEND_RENDEZVOUS

SECONDS_PER_HOUR = 3600.0
NO_PERIODIC_SAVES = {"min_interval_s": 1e9, "max_interval_s": 1e9}  # only the last step's save


class CalibrationError(RuntimeError):
    """The calibration run did not finish; the message carries its exit code and output tail."""


@dataclass(frozen=True)
class Calibration:
    samples_per_second: float
    processes: int
    steps: int

    def to_dict(self) -> dict[str, Any]:
        return {"samples_per_second": self.samples_per_second, "processes": self.processes, "steps": self.steps,
                "throughput": {"alpha": round(self.samples_per_second * SECONDS_PER_HOUR, 3), "beta": 0.0}}


def calibration_config(config: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The job's config cut to ``steps`` steps, with no periodic saves to disturb the measurement."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    raw = {key: value for key, value in config.items() if key not in ("samples", "steps")}
    return {**raw, "steps": steps, "checkpoint": {**dict(config.get("checkpoint") or {}), **NO_PERIODIC_SAVES}}


def calibrate(config: Mapping[str, Any], steps: int, workdir: Path, env: Mapping[str, str] | None = None,
              timeout_s: float = 3600.0) -> Calibration:
    """Train ``steps`` steps of ``config`` on this machine (one instance, all its GPUs) and read the rate."""
    checkpoint_uri = str(workdir / "checkpoint")
    config_path = workdir / "config.json"
    config_path.write_text(json.dumps(calibration_config(config, steps)))
    command = list(runtime_command(checkpoint_uri, sys.executable, str(config.get("runtime", "hf"))))
    command[command.index("--config") + 1] = str(config_path)
    launch_env = {name: value for name, value in (os.environ if env is None else env).items()
                  if name not in BACKEND_RENDEZVOUS}  # one instance, alone
    launch_env["SPOTSCHED_NOTICE"] = "none"
    done = subprocess.run(command, env=launch_env, capture_output=True, text=True, timeout=timeout_s)
    progress = read_progress(checkpoint_uri)
    if done.returncode != 0 or progress.status != "done" or not progress.samples_per_second:
        tail = (done.stderr or done.stdout)[-2000:]
        raise CalibrationError(f"the calibration run exited {done.returncode} (progress {progress.status!r}): {tail}")
    return Calibration(float(progress.samples_per_second), int(progress.world_size or 1), steps)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spotsched-calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="the job's CONFIG.json (runtime 'hf')")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps to time (default 30)")
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"{args.config} must hold a JSON object")
        with tempfile.TemporaryDirectory(prefix="spotsched-calibrate-") as workdir:
            result = calibrate(config, args.steps, Path(workdir))
    except (OSError, ValueError) as error:
        print(f"spotsched-calibrate: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (CalibrationError, subprocess.TimeoutExpired) as error:
        print(f"spotsched-calibrate: {error}", file=sys.stderr)
        return EXIT_FAILURE
    print(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
