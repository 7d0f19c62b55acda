"""Closing a selector round into a shared state document that concurrent runs all update.

The selector's state lives in one stored document (an Airflow Variable in the Airflow layer):
``{"selector": SelectorPolicy.to_state(), "runs": [job ids already learnt from]}``. Stores like
Variables are last-writer-wins, so two runs ending together could each write a state that lacks
the other's round. Two rules keep every round:

- **merge, don't overwrite**: a run re-reads the freshest document just before writing and
  applies its own round to it (rounds are learnt in the order they close, each on the state
  left by the rounds closed before it);
- **verify, then retry**: after writing, the run reads the document back; if its job id is not
  in ``runs`` another writer overwrote it in between, and it merges and writes again.

``runs`` also makes closing idempotent: a retried task that closes the same round twice learns
once. The remaining race (a writer that read before our write and writes after our check) is
closed in the Airflow layer by running the closing step in a one-slot pool; see docs/airflow.md.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from airflow_provider_spotsched.scheduling.online import OnlineRun
from airflow_provider_spotsched.scheduling.selector import SelectorPolicy

KEEP_RUN_IDS = 200
log = logging.getLogger(__name__)


class SelectorStoreError(RuntimeError):
    """The state document could not be updated without losing a round."""


def selector_state(document: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The selector state inside a stored document (a bare ``to_state()`` document works too)."""
    if not document:
        return None
    if not isinstance(document, Mapping):
        raise SelectorStoreError(f"the selector document must be a JSON object, got {type(document).__name__}")
    if "selector" in document:
        return document["selector"]
    if "version" in document:
        return document
    raise SelectorStoreError(
        'the selector document holds neither "selector" nor a selector state; '
        "delete the Variable to start learning afresh"
    )


def close_round(document: Mapping[str, Any] | None, run: OnlineRun) -> dict[str, Any]:
    """``document`` with ``run``'s round learnt (unchanged when it already holds the round)."""
    runs = list(document.get("runs", [])) if isinstance(document, Mapping) else []
    job_id = run.config.job_id
    if job_id in runs:
        return dict(document)  # type: ignore[arg-type]
    if run.member is None or run.selector_start is None:
        raise SelectorStoreError(f"run {job_id} was not played by the selector; there is no round to close")
    selector = SelectorPolicy.from_state(selector_state(document) or run.selector_start)
    label = run.member["label"]
    if label not in selector.labels:
        raise SelectorStoreError(
            f"the stored selector has no member {label!r} (its pool changed during the run); "
            "the round is dropped rather than learnt against a different pool"
        )
    # The run drew its member as the last draw of the document it started on; closing its round
    # moves the next run's draw past it.
    played = selector.recorded_round(label, run.member["probability"], int(run.selector_start["draws"]) - 1)
    result = run.result()
    losses = selector.close_round(played, run.config.job, run.realised_market(), {label: result["utility"]})
    return {
        "selector": selector.to_state(),
        "runs": (runs + [job_id])[-KEEP_RUN_IDS:],
        "last_round": {"job_id": job_id, "member": label, "utility": result["utility"], "losses": losses},
    }


def store_round(
    read: Callable[[], Mapping[str, Any] | None],
    write: Callable[[dict[str, Any]], None],
    run: OnlineRun,
    attempts: int = 5,
    pause_seconds: float = 0.2,
) -> dict[str, Any]:
    """Merge ``run``'s round into the stored document, verifying it survived (see module doc)."""
    for attempt in range(1, attempts + 1):
        document = close_round(read(), run)
        write(document)
        time.sleep(pause_seconds * random.random())
        stored = read() or {}
        if run.config.job_id in stored.get("runs", []):
            return document
        log.warning("selector state: round of %s was overwritten by a concurrent run; merging again (%d)", run.config.job_id, attempt)
    raise SelectorStoreError(f"could not store the selector round of {run.config.job_id} in {attempts} attempts")
