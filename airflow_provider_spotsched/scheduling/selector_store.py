"""Closing a selector round into a shared state document that concurrent runs all update.

The selector's state lives in one stored document (an Airflow Variable in the Airflow layer):
``{"selector": SelectorPolicy.to_state(), "runs": [job ids already learnt from], "history": [...]}``,
where ``history`` keeps each closed round's member weights for its kind of job (the fleet
dashboard draws them over rounds). Stores like
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

A store that does not exist yet starts a fresh selector. A store that exists but holds no valid
document (text that is not JSON, ``null``, ``[]``, a malformed state) is refused, when a run
starts and when it closes, and never written over: starting afresh would silently discard
everything the selector learnt (:func:`read_document`).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from airflow_provider_spotsched.scheduling.online import OnlineRun
from airflow_provider_spotsched.scheduling.selector import SelectorPolicy, SelectorStateError, job_context

KEEP_RUN_IDS = 200
KEEP_HISTORY = 1000  # closed rounds whose weights the document keeps (a few hundred bytes each)
log = logging.getLogger(__name__)


class SelectorStoreError(RuntimeError):
    """The stored document is unusable, or could not be updated without losing a round."""


def read_document(text: str | None, store: str) -> dict[str, Any] | None:
    """The selector document stored as ``text``; ``None`` only when the store does not exist.

    Anything else that is not a valid document raises a :class:`SelectorStoreError` naming
    ``store`` (e.g. ``Variable 'spotsched_selector_state'``) and the fix, so that no caller can
    mistake a damaged store for an empty one and start afresh over what was learnt.
    """
    if text is None:
        return None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _unusable(store, f"its text is not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise _unusable(store, f"it holds {json.dumps(document)[:80]}, not a JSON object")
    try:
        SelectorPolicy.from_state(_state_in(document))
    except (SelectorStoreError, SelectorStateError) as exc:
        raise _unusable(store, str(exc)) from None
    runs = document.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(job_id, str) for job_id in runs):
        raise _unusable(store, f'its "runs" must be a list of job ids, got {runs!r}')
    return document


def starting_state(text: str | None, store: str) -> Mapping[str, Any] | None:
    """The selector state a run starts from (see :func:`read_document`); ``None``: start fresh."""
    document = read_document(text, store)
    if document is None:
        log.info("selector state: %s does not exist yet; the selector starts fresh", store)
        return None
    return selector_state(document)


def selector_state(document: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The selector state inside a stored document (a bare ``to_state()`` document works too)."""
    return None if document is None else _state_in(document)


def close_round(document: Mapping[str, Any] | None, run: OnlineRun, store: str = "the selector store") -> dict[str, Any]:
    """``document`` with ``run``'s round learnt (unchanged when it already holds the round).

    When ``document`` holds another selector than the run started from (the store, named
    ``store`` in the warning, was deleted and recreated by a run with other ``policy_params``
    while this one trained), the round is dropped: its member was drawn from other weights, and
    another pool, algorithm or seed cannot learn it. The document is kept as it is, but for the
    run's job id in ``runs``, so that a retry does not try again; the run's result stands.
    """
    runs = list(document.get("runs", [])) if isinstance(document, Mapping) else []
    job_id = run.config.job_id
    if job_id in runs:
        return dict(document)  # type: ignore[arg-type]
    if run.member is None or run.selector_start is None:
        raise SelectorStoreError(f"run {job_id} was not played by the selector; there is no round to close")
    start = SelectorPolicy.from_state(run.selector_start)
    label = run.member["label"]
    selector = start if document is None else SelectorPolicy.from_state(_state_in(document))
    differ = selector.differences(start, ("stored", "the run's"))
    if document is not None and differ:
        log.warning(
            "selector state: %s holds another selector than run %s started from (%s): the round of its member %r "
            "is dropped, not learnt; the run's result stands", store, job_id, "; ".join(differ), label,
        )
        unchanged = {key: document[key] for key in ("last_round", "history") if key in document}
        return {"selector": dict(_state_in(document)), **unchanged, "runs": (runs + [job_id])[-KEEP_RUN_IDS:]}
    job = run.config.job
    selector.take_warm_up(start, job)  # a kind new to the stored selector keeps the warm-up the run did
    # The run drew its member as the last draw of the document it started on; closing its round
    # moves the next run's draw past it.
    played = selector.recorded_round(label, run.member["probability"], int(run.selector_start["draws"]) - 1)
    result = run.result()
    losses = selector.close_round(played, job, run.realised_market(), {label: result["utility"]}, run.realised_throughput())
    kept = document.get("history") if isinstance(document, Mapping) else None
    history = list(kept) if isinstance(kept, list) else []  # a damaged history restarts; the learner is intact
    history.append({"job_id": job_id, "context": job_context(job), "round": selector.rounds_learnt(job),
                    "member": label, "weights": selector.weights(job)})
    return {
        "selector": selector.to_state(),
        "runs": (runs + [job_id])[-KEEP_RUN_IDS:],
        "last_round": {"job_id": job_id, "member": label, "utility": result["utility"], "losses": losses},
        "history": history[-KEEP_HISTORY:],
    }


def store_round(
    read: Callable[[], str | None],
    write: Callable[[dict[str, Any]], None],
    run: OnlineRun,
    store: str,
    attempts: int = 5,
    pause_seconds: float = 0.2,
) -> dict[str, Any]:
    """Merge ``run``'s round into the stored document, verifying it survived (see module doc).

    :param read: the stored text, ``None`` when the store does not exist.
    :param store: the store's name for errors, e.g. ``Variable 'spotsched_selector_state'``.
    """
    job_id = run.config.job_id
    for attempt in range(1, attempts + 1):
        document = close_round(_read_for_close(read, store, job_id), run, store)
        write(document)
        time.sleep(pause_seconds * random.random())
        stored = _read_for_close(read, store, job_id) or {}
        if job_id in stored.get("runs", []):
            return document
        log.warning("selector state: round of %s was overwritten by a concurrent run; merging again (%d)", job_id, attempt)
    raise SelectorStoreError(f"could not store the selector round of {job_id} in {attempts} attempts")


def _read_for_close(read: Callable[[], str | None], store: str, job_id: str) -> dict[str, Any] | None:
    """The stored document when a run closes; a store damaged since the run started stays as it is."""
    try:
        return read_document(read(), store)
    except SelectorStoreError as exc:
        raise SelectorStoreError(
            f"{exc} The round of run {job_id} was not stored; the finished run and its decision log are "
            "kept: once the store is fixed, retry the task (spotsched run: run the same job again), which "
            "re-attaches to the finished run and closes its round without training again."
        ) from None


def _state_in(document: Any) -> Mapping[str, Any]:
    if not isinstance(document, Mapping):
        raise SelectorStoreError(f"the selector document must be a JSON object, got {type(document).__name__}")
    if "selector" in document:
        state = document["selector"]
        if not isinstance(state, Mapping):
            raise SelectorStoreError(f'the document\'s "selector" must be a selector state object, got {state!r}')
        return state
    if "version" in document:
        return document
    raise SelectorStoreError('the selector document holds neither "selector" nor a selector state')


def _unusable(store: str, reason: str) -> SelectorStoreError:
    return SelectorStoreError(
        f"{store} holds no valid selector state: {reason}. It is not replaced, since that would discard "
        f"what the selector learnt: restore it from a backup, or delete {store} to start learning afresh."
    )
