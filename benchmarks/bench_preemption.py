"""Work lost to preemptions, and whether a preempted job ends where an uninterrupted one does.

Runs the training entry point as real worker processes: first an uninterrupted job, then the
same job (same config and seeds) preempted ``--preemptions`` times at evenly spaced points of its
work, each time restarted from the latest checkpoint, optionally at another world size. A
preemption is ``notice`` (the workers' notice file appears, as a cloud notice or the local
backend's: the step in progress finishes, an emergency checkpoint, exit 75), ``sigterm`` (the
step in progress is abandoned, an emergency checkpoint, exit 75) or ``kill`` (kill -9 every
worker, no notice: the work since the last periodic checkpoint, at most one checkpoint interval,
is lost). Prints, per preemption, the samples redone and their share of the job's work, the
seconds of training they cost, the checkpoint interval in force and the restart's phases; then
the final-loss difference and the largest difference between the two loss curves (same sample
positions; also smoothed).

Then, in the same run, the same figures for the Hugging Face runtime: the example Trainer script
(``docs/examples/hf_trainer_lora.py``, ``spot_train``) launched by torchrun (``runtime.launch``: c10d
rendezvous on loopback, one process per unit of world size), ``--hf-steps`` optimizer steps of a global batch
of 8, stopped at the same evenly spaced points with the same modes and world sizes (``notice``
and ``sigterm``: the notice file / SIGTERM to the highest rank alone; ``kill``: kill -9 torchrun
and every worker), against one uninterrupted single-process run. ``--hf-steps 0`` skips it.

    python benchmarks/bench_preemption.py --minutes 2 --preemptions 3 --modes notice,kill,sigterm \
        --world-sizes 1,2,1,1
    python benchmarks/bench_preemption.py --minutes 30 --preemptions 3   # the issue's demo job
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_PREEMPTED

REPOSITORY = Path(__file__).resolve().parent.parent
SMOOTHING_STEPS = 20  # window of the moving average the smoothed curve difference is taken over
HF_SCRIPT = REPOSITORY / "docs" / "examples" / "hf_trainer_lora.py"
HF_CHECKPOINT = {"keep": 3, "min_interval_s": 1.0, "max_interval_s": 1.0}  # a save every second or so


def demo_config(samples: int, mtbp_hours: float) -> dict[str, Any]:
    """The CPU demo job on the builtin loop (it alone runs several workers): builtin tiny GPT-2,
    64-token samples, 16 per step at any world size, Young/Daly."""
    return {"runtime": "loop", "samples": samples, "global_batch_size": 16, "batch_size": 8, "seq_len": 64, "lr": 3e-3,
            "seed": 0, "log_every_steps": 1,
            "checkpoint": {"keep": 3, "min_interval_s": 10, "max_interval_s": 120, "mtbp_hours": mtbp_hours}}


class Segment:
    """One start of the job on ``world_size`` worker processes, until it exits or is preempted."""

    def __init__(self, config: Path, uri: Path, world_size: int, cache: Path, notice: Path) -> None:
        port = free_port()
        self.notice = notice
        self.started = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.processes = []
        for rank in range(world_size):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "SPOTSCHED_CACHE_DIR": str(cache), "PYTHONPATH": str(REPOSITORY),
                   "SPOTSCHED_NOTICE": f"file://{notice}"}
            self.processes.append(subprocess.Popen(
                [sys.executable, "-m", "airflow_provider_spotsched.runtime", "--config", str(config),
                 "--checkpoint-uri", str(uri)],
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True, env=env, cwd=REPOSITORY))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.processes[0].stdout:
            if line.startswith("{"):
                event = json.loads(line)
                event["wall_s"] = time.monotonic() - self.started
                self.events.append(event)

    def samples_done(self) -> int:
        steps = [e["samples_done"] for e in self.events if e["event"] in ("step", "resumed")]
        return steps[-1] if steps else 0

    def stop(self, mode: str) -> None:
        if mode == "notice":
            self.notice.touch()
            return
        for process in self.processes:
            process.send_signal(signal.SIGTERM if mode == "sigterm" else signal.SIGKILL)

    def wait(self) -> list[int]:
        codes = [process.wait() for process in self.processes]
        self.reader.join()
        return codes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_job(config: dict[str, Any], workdir: Path, cache: Path, stops: list[tuple[int, str]],
            world_sizes: list[int]) -> tuple[list[Segment], list[dict[str, Any]], float]:
    """The job from scratch to the end, stopped at ``(samples, mode)`` points; segments, losses, wall s."""
    path, uri = workdir / "config.json", workdir / "ckpt"
    path.write_text(json.dumps(config))
    segments, started = [], time.monotonic()
    for index in range(len(stops) + 1):
        segment = Segment(path, uri, world_sizes[min(index, len(world_sizes) - 1)], cache,
                          workdir / f"notice-{index}")
        segments.append(segment)
        if index < len(stops):
            target, mode = stops[index]
            while segment.samples_done() < target and segment.processes[0].poll() is None:
                time.sleep(0.05)
            segment.stop(mode)
        codes = segment.wait()
        expected = EXIT_DONE if index == len(stops) else (-9 if stops[index][1] == "kill" else EXIT_PREEMPTED)
        if any(code != expected for code in codes):
            raise SystemExit(f"segment {index}: exit codes {codes}, expected {expected}; see stderr above")
    losses: dict[int, float] = {}
    for segment in segments:  # a position redone after kill -9 keeps its latest loss
        losses.update({e["samples_done"]: e["loss"] for e in segment.events if e["event"] == "step"})
    return segments, [{"samples": s, "loss": losses[s]} for s in sorted(losses)], time.monotonic() - started


def calibrate(cache: Path, seconds: float) -> float:
    """Samples per second of one CPU worker on this machine, from a short run of the demo job."""
    with tempfile.TemporaryDirectory(prefix="spotsched-calibrate-") as workdir:
        segment_config = demo_config(samples=100_000, mtbp_hours=1.0)
        path = Path(workdir) / "config.json"
        path.write_text(json.dumps(segment_config))
        segment = Segment(path, Path(workdir) / "ckpt", 1, cache, Path(workdir) / "notice")
        while not any(e["event"] == "step" for e in segment.events) and segment.processes[0].poll() is None:
            time.sleep(0.05)
        time.sleep(seconds)
        segment.stop("kill")
        segment.wait()
        steps = [e for e in segment.events if e["event"] == "step"]
    if len(steps) < 2:
        raise SystemExit("calibration run trained fewer than 2 steps; give --samples instead")
    return (steps[-1]["samples_done"] - steps[0]["samples_done"]) / (steps[-1]["wall_s"] - steps[0]["wall_s"])


def report(segments: list[Segment], stops: list[tuple[int, str]], samples: int) -> None:
    print(f"\n{'#':>2} {'mode':>6} {'world':>5} {'reached':>8} {'resumed':>8} {'redone':>7} {'discard':>7} "
          f"{'% of job':>8} {'lost_s':>7} {'interval_s':>10} {'ckpt_age_s':>10} {'save_s':>7} {'restart_s':>9} "
          f"{'rdzv_s':>7} {'load_s':>7}")
    for index, (_, mode) in enumerate(stops):
        before, after = segments[index], segments[index + 1]
        reached = before.samples_done()
        resumed = next(e for e in after.events if e["event"] == "resumed")
        redone = reached - resumed["samples_done"]
        discarded = next((e["discarded_samples"] for e in before.events if e["event"] == "preempted"), 0)
        lost = redone + discarded
        # seconds: the segment's own clock from the resumed-from position to the last step, plus
        # the abandoned step at the segment's own pace (world sizes differ in throughput)
        steps = [e for e in before.events if e["event"] == "step"]
        at_resume = next((e["wall_s"] for e in steps if e["samples_done"] >= resumed["samples_done"]), None)
        pace = (steps[-1]["wall_s"] - steps[0]["wall_s"]) / max(1, steps[-1]["samples_done"] - steps[0]["samples_done"])
        lost_s = (steps[-1]["wall_s"] - at_resume if redone and at_resume is not None else 0.0) + discarded * pace
        checkpoints = [e for e in before.events if e["event"] == "checkpoint"]
        interval = checkpoints[-1]["interval_s"] if checkpoints else float("nan")
        periodic = [e for e in checkpoints if e["kind"] != "emergency"]
        age = steps[-1]["wall_s"] - periodic[-1]["wall_s"] if periodic else float("nan")
        save = next((e["save_s"] for e in before.events if e["event"] == "preempted"), float("nan"))
        print(f"{index + 1:>2} {mode:>6} {len(before.processes):>5} {reached:>8} {resumed['samples_done']:>8} "
              f"{redone:>7} {discarded:>7} {100 * lost / samples:>7.3f}% {lost_s:>7.2f} {interval:>10.1f} "
              f"{age:>10.1f} {save:>7.3f} {resumed['wall_s']:>9.2f} {resumed['rendezvous_s']:>7.3f} "
              f"{resumed['load_s']:>7.3f}")
    print("  redone = samples trained twice (reached before the stop minus the position resumed from);\n"
          "  discard = samples of the step abandoned at a SIGTERM; % of job and lost_s count both;\n"
          "  ckpt_age_s = age of the last periodic checkpoint at the stop (what a kill -9 loses);\n"
          "  restart_s = process start to resumed (imports, model build, rendezvous, checkpoint load);\n"
          "  nan: the segment wrote no periodic checkpoint (it was shorter than the interval)")


class HfSegment:
    """One torchrun launch of the example Trainer script at ``world_size`` (0: plain python, no torchrun)."""

    def __init__(self, uri: Path, world_size: int, steps: int, notice: Path) -> None:
        self.notice, self.started = notice, time.monotonic()
        env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "OMP_NUM_THREADS": "1",
               "SPOTSCHED_NOTICE": f"file://{notice}", "SPOTSCHED_NOTICE_POLL_S": "0.1",
               "SPOTSCHED_CHECKPOINT": json.dumps(HF_CHECKPOINT)}
        script = [str(HF_SCRIPT), "--checkpoint-uri", str(uri), "--max-steps", str(steps), "--batch-size", "8"]
        # runtime.launch is torchrun with the spot exit codes; one node here, so the rendezvous does
        # not wait torchrun's default 30 s (last_call_timeout) for a second one
        launcher = [sys.executable] if not world_size else [
            sys.executable, "-m", "airflow_provider_spotsched.runtime.launch", "--nnodes=1:2",
            f"--nproc-per-node={world_size}", "--rdzv-backend=c10d", "--rdzv-conf=last_call_timeout=1",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0"]
        self.world_size = max(1, world_size)
        self.process = subprocess.Popen(launcher + script, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, env=env, cwd=REPOSITORY, start_new_session=True)
        self.events: list[dict[str, Any]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # the Trainer's own prints
            if isinstance(event, dict) and "event" in event:
                event["wall_s"] = time.monotonic() - self.started
                self.events.append(event)

    def step(self) -> int:
        steps = [e["step"] for e in self.events if e["event"] in ("log", "resumed")]
        return steps[-1] if steps else 0

    def stop(self, mode: str) -> None:
        workers = psutil.Process(self.process.pid).children(recursive=True)
        if mode == "notice":
            self.notice.touch()
        elif mode == "sigterm":  # the highest rank alone: the others stop on its word
            next(w for w in workers if w.environ().get("RANK") == str(self.world_size - 1)).send_signal(signal.SIGTERM)
        else:
            for process in [psutil.Process(self.process.pid), *workers]:
                process.send_signal(signal.SIGKILL)

    def wait(self) -> int:
        code = self.process.wait()
        self.reader.join()
        return code


def run_hf_job(workdir: Path, steps: int, stops: list[tuple[int, str]], world_sizes: list[int]) -> list[HfSegment]:
    """The HF job from scratch to the end under torchrun, stopped at ``(step, mode)`` points."""
    segments = []
    for index in range(len(stops) + 1):
        segment = HfSegment(workdir / "ckpt", world_sizes[min(index, len(world_sizes) - 1)], steps,
                            workdir / f"notice-{index}")
        segments.append(segment)
        if index < len(stops):
            target, mode = stops[index]
            while segment.step() < target and segment.process.poll() is None:
                time.sleep(0.05)
            segment.stop(mode)
        code = segment.wait()
        expected = EXIT_DONE if index == len(stops) else (-9 if stops[index][1] == "kill" else EXIT_PREEMPTED)
        if code != expected:
            raise SystemExit(f"HF segment {index}: the launcher exited {code}, expected {expected}")
    return segments


def hf_report(reference: HfSegment, segments: list[HfSegment], stops: list[tuple[int, str]], steps: int) -> None:
    """Per preemption: steps reached, resumed from, redone (work lost), restart time; then the loss curves."""
    batch = 8
    print(f"\nHugging Face runtime under torchrun ({steps} steps of {batch} samples; reference: one process, "
          f"{reference.events[-1]['wall_s']:.1f} s wall)")
    print(f"{'#':>2} {'mode':>7} {'world':>5} {'reached':>7} {'resumed':>7} {'redone':>6} {'% of job':>8} "
          f"{'lost_s':>7} {'interval_s':>10} {'restart_s':>9}")
    for index, (_, mode) in enumerate(stops):
        before, after = segments[index], segments[index + 1]
        reached = before.step()
        resumed = next(e for e in after.events if e["event"] == "resumed")
        redone = reached - resumed["step"]
        # seconds from the position resumed from (a step end, or the segment's own resume) to the last step
        marks = {e["step"]: e["wall_s"] for e in before.events if e["event"] in ("resumed", "log")}
        lost_s = marks[reached] - marks[resumed["step"]] if redone else 0.0
        saves = [e for e in before.events if e["event"] == "checkpoint"]
        interval = saves[-1]["interval_s"] if saves else float("nan")
        print(f"{index + 1:>2} {mode:>7} {before.world_size:>5} {reached:>7} {resumed['step']:>7} {redone:>6} "
              f"{100 * redone / steps:>7.2f}% {lost_s:>7.2f} {interval:>10.1f} {resumed['wall_s']:>9.2f}")
    print("  redone = steps trained twice (the work lost); lost_s = their seconds in the stopped segment;\n"
          "  restart_s = launcher start to resumed (torch import, rendezvous, the workers' imports and model\n"
          "  build, the checkpoint choice; the checkpoint load comes after it); nan: no save in the segment")
    ours: dict[int, float] = {}
    for segment in segments:
        ours.update({e["step"]: e["loss"] for e in segment.events if e["event"] == "log"})
    theirs = {e["step"]: e["loss"] for e in reference.events if e["event"] == "log"}
    common = sorted(set(ours) & set(theirs))
    print(f"  loss curves at {len(common)} common steps (of {len(theirs)}): max |difference| "
          f"{max(abs(ours[s] - theirs[s]) for s in common):.2e}, final {ours[steps] - theirs[steps]:+.2e}")


def smoothed(values: np.ndarray) -> np.ndarray:
    window = min(SMOOTHING_STEPS, len(values))
    return np.convolve(values, np.ones(window) / window, mode="valid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=1.0, help="length of the uninterrupted job (calibrated)")
    parser.add_argument("--samples", type=int, help="the job's samples (skips the calibration)")
    parser.add_argument("--preemptions", type=int, default=3)
    parser.add_argument("--modes", default="notice,kill",
                        help="cycled over the preemptions: notice (notice file), sigterm, or kill (-9)")
    parser.add_argument("--world-sizes", default="1", help="world size of each start, e.g. 1,2,1,1 (the last repeats)")
    parser.add_argument("--mtbp-hours", type=float, help="mean time between preemptions for Young/Daly "
                        "(default: the job's length / preemptions)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "spotsched-bench-cache")
    parser.add_argument("--hf-steps", type=int, default=40,
                        help="steps of the Hugging Face runtime's job under torchrun (0 skips it)")
    args = parser.parse_args()
    if args.hf_steps and args.hf_steps <= args.preemptions:
        parser.error(f"--hf-steps {args.hf_steps} must exceed --preemptions {args.preemptions} (or be 0)")

    modes = args.modes.split(",")
    if not set(modes) <= {"notice", "sigterm", "kill"}:
        parser.error(f"--modes takes notice, sigterm and kill, got {args.modes}")
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    if args.samples:
        samples = args.samples
    else:
        samples = max(100, int(calibrate(args.cache, seconds=min(20.0, 5 + args.minutes)) * args.minutes * 60))
    mtbp_hours = args.mtbp_hours or args.minutes / 60 / max(1, args.preemptions)
    config = demo_config(samples, mtbp_hours)
    stops = [(samples * (k + 1) // (args.preemptions + 1), modes[k % len(modes)]) for k in range(args.preemptions)]
    print(f"job: {samples} samples, config {json.dumps(config)}")
    print(f"preemptions at samples {[s for s, _ in stops]}, modes {[m for _, m in stops]}, world sizes {world_sizes}")

    with tempfile.TemporaryDirectory(prefix="spotsched-bench-") as workdir:
        base_dir, preempted_dir = Path(workdir) / "uninterrupted", Path(workdir) / "preempted"
        base_dir.mkdir()
        preempted_dir.mkdir()
        base_segments, base_curve, base_wall = run_job(config, base_dir, args.cache, [], [world_sizes[0]])
        steps = [e for e in base_segments[0].events if e["event"] == "step"]
        throughput = (steps[-1]["samples_done"] - steps[0]["samples_done"]) / (steps[-1]["wall_s"] - steps[0]["wall_s"])
        segments, curve, wall = run_job(config, preempted_dir, args.cache, stops, world_sizes)

    print(f"\nuninterrupted: {base_wall:.1f} s wall, {throughput:.1f} samples/s, "
          f"final loss {base_curve[-1]['loss']:.4f}")
    print(f"preempted {len(stops)}x: {wall:.1f} s wall (+{wall - base_wall:.1f} s), final loss {curve[-1]['loss']:.4f}")
    report(segments, stops, samples)

    base = {point["samples"]: point["loss"] for point in base_curve}
    common = [point["samples"] for point in curve if point["samples"] in base]
    ours = np.array([next(p["loss"] for p in curve if p["samples"] == s) for s in common])
    theirs = np.array([base[s] for s in common])
    tail = max(1, len(common) // 20)
    print(f"\nloss curves at {len(common)} common sample positions (of {len(base_curve)}):")
    print(f"  final loss difference            {curve[-1]['loss'] - base_curve[-1]['loss']:+.5f}")
    print(f"  mean of the last 5% difference   {ours[-tail:].mean() - theirs[-tail:].mean():+.5f}")
    print(f"  max |difference|, raw            {np.abs(ours - theirs).max():.5f}")
    print(f"  max |difference|, {SMOOTHING_STEPS}-step mean   {np.abs(smoothed(ours) - smoothed(theirs)).max():.5f}")
    print(f"  step-to-step noise (std of consecutive raw differences, uninterrupted) {np.diff(theirs).std():.5f}")

    if args.hf_steps:
        hf_stops = [(args.hf_steps * (k + 1) // (args.preemptions + 1), mode) for k, (_, mode) in enumerate(stops)]
        with tempfile.TemporaryDirectory(prefix="spotsched-bench-hf-") as workdir:
            (Path(workdir) / "reference").mkdir()
            (Path(workdir) / "preempted").mkdir()
            reference = HfSegment(Path(workdir) / "reference" / "ckpt", 0, args.hf_steps, Path(workdir) / "none")
            if reference.wait() != EXIT_DONE:
                raise SystemExit("the uninterrupted HF run failed")
            hf_segments = run_hf_job(Path(workdir) / "preempted", args.hf_steps, hf_stops, world_sizes)
        hf_report(reference, hf_segments, hf_stops, args.hf_steps)


if __name__ == "__main__":
    main()
