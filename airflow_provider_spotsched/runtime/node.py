"""One instance's share of a job, launched by elastic torchrun: a process per GPU, c10d rendezvous.

The backends start one command per instance and give it the rendezvous of the instance set they
run now (a *generation*): ``RANK`` (this instance's place), ``WORLD_SIZE`` (instances),
``MASTER_ADDR``/``MASTER_PORT`` (the first instance's) and ``SPOTSCHED_GENERATION``; the local
backend sets them itself, the cloud start-up script reads them from the instance's metadata
(:mod:`airflow_provider_spotsched.backends.bootstrap`). This entry point turns them into torchrun's
elastic launch and runs it through :mod:`.launch`, which keeps the spot exit codes:

- ``--nnodes=1:WORLD_SIZE``: the generation's instances at most, one is enough. When an instance is
  lost (preempted, killed) the others' workers fail, their agents restart them, and they meet again
  without it: the job goes on at the smaller world size from its newest checkpoint instead of
  waiting for the backend (the :class:`.hf_sampler.GlobalOrderSampler` keeps the data order);
- ``--nproc-per-node``: one process per GPU of the machine, 1 without one (``SPOTSCHED_NPROC_PER_NODE``
  overrides);
- ``--rdzv-backend=c10d --rdzv-endpoint=MASTER_ADDR:MASTER_PORT --rdzv-id=JOB-GENERATION``: the first
  instance hosts the rendezvous store (``is_host``), the others join it; a new generation is a new
  rendezvous, so that a stale instance can never join it. The rendezvous closes when the whole
  generation is there, or ``SPOTSCHED_RDZV_LAST_CALL_S`` (default 30 s, torchrun's ``last_call_timeout``)
  after the first ones met, so an instance that boots late joins as a membership change. One instance alone meets on loopback;
- ``--max-restarts=SPOTSCHED_MAX_RESTARTS`` (default 3): the worker restarts a job may use on lost
  peers within one generation (a late instance joining does not count).

A preemption notice on this instance (``SPOTSCHED_NOTICE``, as for the runtime) is this launcher's
to act on: it stops its own workers with SIGTERM, which makes every rank save one emergency
checkpoint (the ranks agree on a stop), and exits 75 without rejoining, while the other instances'
agents restart their workers without it. The workers therefore watch no notice themselves, so that a
worker on the noticed instance cannot stop first and be restarted there.

    python -m airflow_provider_spotsched.runtime.node -m airflow_provider_spotsched.runtime --config C --checkpoint-uri U
    python -m airflow_provider_spotsched.runtime.node train.py --its-args    # a user's spot_train() script
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Mapping, MutableMapping, Sequence

from airflow_provider_spotsched.runtime import launch
from airflow_provider_spotsched.runtime.contract import EXIT_USAGE, GENERATION_ENV
from airflow_provider_spotsched.runtime.preemption import NoticeSource, NoticeWatcher, StopFlag

NPROC_ENV = "SPOTSCHED_NPROC_PER_NODE"
RESTARTS_ENV = "SPOTSCHED_MAX_RESTARTS"
LAST_CALL_ENV = "SPOTSCHED_RDZV_LAST_CALL_S"
DEFAULT_MAX_RESTARTS = 3
NOTICE_POLL_S = 1.0
# What the backend's rendezvous means for one instance; torchrun sets its own for every worker.
BACKEND_RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


class NodeError(ValueError):
    """The backend's rendezvous environment is incomplete or invalid; the message names the variable."""


def _count(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise NodeError(f"${name}={raw!r} is not an integer") from None
    if value < minimum:
        raise NodeError(f"${name} must be >= {minimum}, got {value}")
    return value


def processes_per_node(env: Mapping[str, str]) -> int:
    """One per visible GPU, 1 on a machine without one; ``$SPOTSCHED_NPROC_PER_NODE`` overrides."""
    if env.get(NPROC_ENV):
        return _count(env, NPROC_ENV, 1, 1)
    import torch

    return torch.cuda.device_count() or 1


def torchrun_arguments(env: Mapping[str, str], nproc_per_node: int) -> list[str]:
    """torchrun's options (before the training script) for the backend's rendezvous in ``env``."""
    nodes = _count(env, "WORLD_SIZE", 1, 1)
    rank = _count(env, "RANK", 0, 0)
    if rank >= nodes:
        raise NodeError(f"$RANK={rank} is not below $WORLD_SIZE={nodes}")
    restarts = _count(env, RESTARTS_ENV, DEFAULT_MAX_RESTARTS, 0)
    run_id = f"{env.get('SPOTSCHED_JOB_ID') or 'spotsched'}-{env.get(GENERATION_ENV) or '0'}"
    common = [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={restarts}", "--monitor-interval=1"]
    if nodes == 1:  # one instance: a private rendezvous on loopback, nobody else to meet
        return ["--standalone", "--nnodes=1", *common]
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise NodeError(f"WORLD_SIZE={nodes} but {' and '.join('$' + name for name in missing)} not set: the backend "
                        "publishes the first instance's address with the generation")
    port = _count(env, "MASTER_PORT", 0, 1)
    is_host = "true" if rank == 0 else "false"
    last_call = f",last_call_timeout={_count(env, LAST_CALL_ENV, 0, 1)}" if env.get(LAST_CALL_ENV) else ""
    return [
        f"--nnodes=1:{nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={env['MASTER_ADDR']}:{port}",
        f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={is_host}{last_call}", *common,
    ]


def worker_environment(env: MutableMapping[str, str]) -> None:
    """Drop the backend's rendezvous (torchrun gives each worker its own) and the workers' notice watch."""
    for name in BACKEND_RENDEZVOUS:
        env.pop(name, None)
    env["SPOTSCHED_NOTICE"] = "none"


def stop_on_notice(source: NoticeSource) -> NoticeWatcher:
    """SIGTERM this launcher on a notice: torchrun stops the workers (emergency checkpoint) and exits."""
    flag = StopFlag()
    watcher = NoticeWatcher(source, flag, NOTICE_POLL_S, on_error=lambda message: print(message, file=sys.stderr))

    def signal_self() -> None:
        while not flag.wait(3600.0):
            pass
        print(f"spotsched-node: {flag.reason}; stopping this instance's workers", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_self, name="spotsched-node-notice", daemon=True).start()
    return watcher.start()


def main(argv: Sequence[str] | None = None) -> int:
    """Launch the training command in ``argv`` (default: this process's arguments) on this instance."""
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print("usage: python -m airflow_provider_spotsched.runtime.node [-m MODULE | SCRIPT] [ARGS...]",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        arguments = torchrun_arguments(os.environ, processes_per_node(os.environ))
        notice = NoticeSource.from_env(os.environ)
    except (NodeError, ValueError) as error:
        print(f"spotsched-node: {error}", file=sys.stderr)
        return EXIT_USAGE
    worker_environment(os.environ)
    watcher = stop_on_notice(notice) if notice is not None else None
    try:
        return launch.main([*arguments, *command])
    finally:
        if watcher is not None:
            watcher.stop()


if __name__ == "__main__":
    sys.exit(main())
