"""A stand-in for the training runtime that obeys its contract, in milliseconds and stdlib only.

``python tests/fake_worker.py --config CONFIG.json --checkpoint-uri DIR`` counts ``samples``
(global, ``WORLD_SIZE`` per step of ``step_s`` seconds) from the last ``DIR/progress.json``;
rank 0 rewrites that file every step. SIGTERM saves and exits 75; a notice (the file named by
``SPOTSCHED_NOTICE=file://...``) is logged and, with ``"exit_on_notice": true``, also exits 75.
Done: rank 0 writes ``DIR/final/`` and every rank exits 0. ``"fail_rank"``/``"fail_after_steps"``
make that rank exit 3 with a message on stderr; ``"linger_s"`` keeps every rank alive that long
after the work is done (as torchrun's exit barrier can). Every event is one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "pid": os.getpid(), **fields}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint-uri", required=True)
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    uri = Path(args.checkpoint_uri)
    uri.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    notice = os.environ.get("SPOTSCHED_NOTICE", "none")
    notice_path = Path(unquote(urlparse(notice).path)) if notice.startswith("file://") else None
    progress_file = uri / "progress.json"
    done = json.loads(progress_file.read_text())["samples_done"] if progress_file.exists() else 0
    total = int(config["samples"])
    emit("started", rank=rank, world_size=world, master_port=os.environ.get("MASTER_PORT"), samples_done=done)

    steps = 0
    step_s = float(config.get("step_s", 0.05))

    def save() -> None:
        if rank == 0:
            tmp = progress_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({
                "samples_done": done, "samples_total": total, "world_size": world, "step": steps,
                "loss": 2.0 / (1.0 + done / max(total, 1)), "samples_per_second": world / max(step_s, 1e-6),
                "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }))
            os.replace(tmp, progress_file)

    def on_sigterm(signum: int, frame: object) -> None:
        save()
        emit("preempted", cause="sigterm", samples_done=done)
        sys.exit(75)

    signal.signal(signal.SIGTERM, on_sigterm)
    noticed = False
    while done < total:
        time.sleep(step_s)
        done = min(total, done + world)
        steps += 1
        save()
        if rank == config.get("fail_rank") and steps >= int(config.get("fail_after_steps", 1)):
            print(f"fake worker rank {rank}: simulated crash at step {steps}", file=sys.stderr, flush=True)
            sys.exit(3)
        if notice_path is not None and not noticed and notice_path.exists():
            noticed = True
            emit("notice", samples_done=done)
            if config.get("exit_on_notice"):
                save()
                emit("preempted", cause="notice", samples_done=done)
                sys.exit(75)
    if rank == 0:
        (uri / "final").mkdir(exist_ok=True)
        (uri / "final" / "adapter.txt").write_text(f"{done} samples\n")
    time.sleep(float(config.get("linger_s", 0.0)))
    emit("done", samples_done=done)


if __name__ == "__main__":
    main()
