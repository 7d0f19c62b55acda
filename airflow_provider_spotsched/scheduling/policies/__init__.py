"""Every scheduling policy by name, so the CLI, the evaluation and the operator build them alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_provider_spotsched.registry import build, load
from airflow_provider_spotsched.scheduling.policy import Policy

# name -> "module:Class"; modules load on first use so that importing the registry stays cheap.
POLICIES: dict[str, str] = {
    "on-demand": "airflow_provider_spotsched.scheduling.policies.on_demand:OnDemandPolicy",
    "greedy": "airflow_provider_spotsched.scheduling.policies.greedy:GreedyPolicy",
    "uniform-progress": "airflow_provider_spotsched.scheduling.policies.uniform_progress:UniformProgressPolicy",
    "optimal": "airflow_provider_spotsched.scheduling.policies.optimal:OptimalPolicy",
    "chc": "airflow_provider_spotsched.scheduling.policies.chc:CHCPolicy",
    "prediction-free": "airflow_provider_spotsched.scheduling.policies.prediction_free:PredictionFreePolicy",
    "skynomad": "airflow_provider_spotsched.scheduling.policies.skynomad:SkyNomadPolicy",
    "up-s": "airflow_provider_spotsched.scheduling.policies.uniform_progress_multi:UPSPolicy",
    "up-ap": "airflow_provider_spotsched.scheduling.policies.uniform_progress_multi:UPAPPolicy",
    "selector": "airflow_provider_spotsched.scheduling.selector:SelectorPolicy",
}


def policy_class(name: str) -> type[Policy]:
    return load("policy", POLICIES, name)


# The references a cost guard makes no sense on: the robust policy it compares with, the
# hindsight optimum (no online run), and the selector (its members take the guard instead).
UNGUARDED = ("uniform-progress", "optimal", "selector")


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Build policy ``name`` with ``params``, naming any parameter it does not take.

    Every policy but those in :data:`UNGUARDED` also takes ``guard``: a number >= 1 runs it under
    :class:`~airflow_provider_spotsched.scheduling.guard.GuardedPolicy` with that factor, ``None``
    (or leaving it out) runs it alone.
    """
    params = dict(params or {})
    guard = params.pop("guard", None)
    policy = build("policy", POLICIES, name, params)
    if guard is None:
        return policy
    if name in UNGUARDED:
        raise ValueError(f"policy {name!r} takes no guard; drop guard={guard!r} (guard a policy's own choices, e.g. chc)")
    from airflow_provider_spotsched.scheduling.guard import GuardedPolicy

    return GuardedPolicy(policy, guard)
