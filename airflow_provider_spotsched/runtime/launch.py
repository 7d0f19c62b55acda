"""``torchrun`` with the spot exit contract: 75 when the workers stopped for a preemption, not 1.

torchrun exits 1 whenever a worker exits non-zero, so a job whose workers all saved an emergency
checkpoint and exited 75 (:data:`.contract.EXIT_PREEMPTED`) looks failed to whatever launched it:
the local backend, the cloud start-up script, an operator's ``command=``. This entry point takes
torchrun's own arguments, runs torchrun's launcher in-process and maps how it ended:

- every worker exited 0: 0;
- every failed worker exited 75 (a notice, agreed by all ranks): 75. torchrun stops the others
  with SIGTERM as soon as the first one exits, and lists them as failed too: a worker that ended
  by a signal after the first failure is torchrun's doing, not the job's, and does not count;
- torchrun itself got SIGTERM or SIGINT (the instance is being stopped or preempted): it passes
  the signal to the workers and waits up to 30 s for them (their emergency checkpoint), then 75,
  since the job resumes from its newest valid checkpoint on the next launch;
- the rendezvous failed or was lost (its host, the first instance, went away): 75, since the backend
  publishes a new one for the instances that remain;
- otherwise the first failed worker's exit code (1 where it was a signal), and torchrun's failure
  summary on stderr.

    python -m airflow_provider_spotsched.runtime.launch --nnodes=1:2 --nproc-per-node=2 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --max-restarts=0 script.py --its-args
"""

from __future__ import annotations

import signal
import sys
import tempfile
from argparse import Namespace
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.run import parse_args, run

from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_FAILURE, EXIT_PREEMPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(worker_codes: Sequence[int]) -> int:
    """The job's exit code from its failed workers' codes, first failure first (negative: a signal)."""
    if not worker_codes:
        return EXIT_DONE
    first, *later = worker_codes
    own = [first, *(code for code in later if code > 0)]  # later signals: torchrun stopping the rest
    if all(code == EXIT_PREEMPTED for code in own):
        return EXIT_PREEMPTED
    failure = next(code for code in own if code != EXIT_PREEMPTED)
    return failure if failure > 0 else EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun on ``argv`` (default: this process's arguments); the spot contract's exit code."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.log_dir is not None:
        return launch(args)
    # Without --log-dir torchrun makes a torchelastic_* folder in the temporary directory at every
    # launch and leaves it there: one per generation on a host the job keeps coming back to.
    with tempfile.TemporaryDirectory(prefix="spotsched-torchrun-") as logs:
        args.log_dir = logs
        return launch(args)


def launch(args: Namespace) -> int:
    """torchrun's launcher on parsed ``args``, and how it ended as the contract's exit code."""
    try:
        run(args)
    except ChildFailedError as error:
        failures = sorted(error.failures.values(), key=lambda failure: failure.timestamp)
        return exit_code([failure.exitcode for failure in failures])
    except SignalException as error:
        if error.sigval in STOP_SIGNALS:
            return EXIT_PREEMPTED
        raise
    except RendezvousError as error:
        print(f"spotsched-launch: the rendezvous failed ({type(error).__name__}: {error}); waiting for the next "
              "one from the backend", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    return EXIT_DONE


if __name__ == "__main__":
    sys.exit(main())
