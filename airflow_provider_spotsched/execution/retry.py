"""Riding out a brief outage of the store a run keeps its state in: a few tries with backoff.

The run's state store (Airflow's metadata database behind ``task_state_store``, a file for the
command line) is written after every decision, before the backend acts. A write that fails ends
the step, and a failed step releases every instance of the job: right when the store is gone for
good (nothing may run that is not on record), too dear for a database that is back in a second
(the job restarts from its checkpoint and loses the retry delay). :func:`retrying` sits between:
a few tries over a few seconds, then the error as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

ATTEMPTS = 4
FIRST_PAUSE_S = 0.5  # then 1 s, 2 s: 3.5 s in all before the error stands


def retrying(
    call: Callable[[], T],
    what: str,
    attempts: int = ATTEMPTS,
    first_pause_s: float = FIRST_PAUSE_S,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``call()``, tried up to ``attempts`` times with doubling pauses; the last error propagates.

    Any exception counts as transient (database drivers, HTTP clients and the Airflow API raise
    unrelated types); a persistent one costs only the pauses. ``what`` names the call in the log.
    """
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as error:
            if attempt == attempts:
                log.error("%s failed %d times; giving up: %s", what, attempts, error)
                raise
            pause = first_pause_s * 2 ** (attempt - 1)
            log.warning("%s failed (%s: %s); trying again in %.1f s (%d/%d)", what, type(error).__name__, error, pause,
                        attempt, attempts)
            sleep(pause)
    raise AssertionError("unreachable")
