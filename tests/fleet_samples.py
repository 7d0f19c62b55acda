"""Results of many runs and a selector document with history, for the fleet dashboard's tests.

Each result is :func:`tests.run_log_samples.sample_result` varied the way runs differ: the cost,
the deadline outcome (met, soft miss, hard miss), preemptions spread over GCP and AWS zones,
a budget or none, and every fourth one written by an older operator that lacked the newer keys.
"""

from __future__ import annotations

import math
from typing import Any

from tests.run_log_samples import sample_result

# GCP zones (region us-central1, europe-west4) and AWS availability zones (region us-east-1)
ZONES = ("us-central1-a", "us-central1-b", "europe-west4-c", "us-east-1a", "us-east-1b")
REGION = {"us-central1-a": "us-central1", "us-central1-b": "us-central1", "europe-west4-c": "europe-west4",
          "us-east-1a": "us-east-1", "us-east-1b": "us-east-1"}
# keys an older operator's result did not have
NEWER_KEYS = ("preemptions_by_pool", "hard_deadline_met", "hard_deadline_hours", "budget", "deadline_hours")
KINDS = ("met", "soft_miss", "hard_miss", "old")


def result_variant(i: int) -> dict[str, Any]:
    """The ``i``-th run's result: kind ``KINDS[i % 4]``, cost and preemptions growing with ``i``."""
    result = sample_result()
    kind = KINDS[i % len(KINDS)]
    cost = round(result["cost"] * (0.8 + 0.07 * i), 4)
    on_demand = result["on_demand_cost"]
    preempted = {ZONES[(i + k) % len(ZONES)]: 1 + (i + k) % 2 for k in range(1 + i % 3)}
    result.update(cost=cost, savings=on_demand - cost, savings_fraction=(on_demand - cost) / on_demand,
                  utility=result["value"] - cost, preemptions=sum(preempted.values()), preemptions_by_pool=preempted,
                  job_id=f"fleet-sample-{i:04d}", budget=200.0 if i % 2 == 0 else None,
                  policy="selector" if i % 3 else "chc")
    if kind == "soft_miss":
        result.update(completion_hours=26.0, deadline_met=False, hard_deadline_met=True)
    elif kind == "hard_miss":
        result.update(completion_hours=None, deadline_met=False, hard_deadline_met=False, value=0.0, utility=-cost)
    elif kind == "old":
        for key in NEWER_KEYS:
            result.pop(key)
    return result


MEMBERS = ("chc(window=24,commit=1,forecaster=persistence)", "prediction-free(price_threshold=0.7,safety_slots=1.0)",
           "uniform-progress")
CONTEXTS = ("n_max=4,slack=1.5,overhead=15min,slot=1h", "n_max=8,slack=1.25,overhead=15min,slot=1h")


def selector_document(job_ids: list[str], rounds: int = 6, contexts: tuple[str, ...] = CONTEXTS,
                      members: tuple[str, ...] = MEMBERS) -> dict[str, Any]:
    """A selector Variable's document with ``rounds`` rounds per kind of job, weights by Hedge.

    The rounds' job ids are ``job_ids`` in turn (they name the DAGs the runs ran in, which the
    dashboard must not show); ``selector`` is a stand-in, the dashboard reads only ``history``.
    """
    history = []
    for c, context in enumerate(contexts):
        losses = [0.0] * len(members)
        for r in range(1, rounds + 1):
            for m in range(len(members)):
                losses[m] += ((m + c + r) % 3) / 3
            weights = [math.exp(-0.8 * loss / math.sqrt(r)) for loss in losses]
            total = sum(weights)
            history.append({"job_id": job_ids[(c * rounds + r) % len(job_ids)], "context": context, "round": r,
                            "member": members[(r + c) % len(members)],
                            "weights": {member: w / total for member, w in zip(members, weights)}})
    return {"selector": {"version": 1}, "runs": sorted(set(job_ids)), "history": history,
            "last_round": {"job_id": job_ids[-1], "member": members[0], "utility": 1.0, "losses": {}}}
