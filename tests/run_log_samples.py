"""A realistic decision log and result of one run, in the operator's XCom formats.

The log is built by a small deterministic policy rather than typed in, so its numbers hang
together the way a real run's do: costs are the sum of the applied allocations' bills, the
on-demand line is N_max on-demand instances, a preemption shows as applied < decided, and each
slot's forecast and plan look ahead over the slots that remain.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np

POOLS = ("us-central1-a", "us-central1-b", "europe-west4-c")
SLOTS = 24
MAX_INSTANCES = 4
ON_DEMAND_PRICE = 3.06
WORK_PER_INSTANCE_HOUR = 1.0
PREEMPTED_SLOT = 9
FORECAST_SLOTS = 6
MARKET_START = datetime(2025, 10, 6, tzinfo=timezone.utc)
WALL_START = datetime(2026, 3, 2, 8, 0, tzinfo=timezone.utc)
WALL_SECONDS_PER_SLOT = 10
DEADLINE_HOURS = 24.0
HARD_DEADLINE_HOURS = 30.0
CHARTS = 5  # the report's charts besides the forecast chart of each pool


def _iso(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%SZ")


def _market(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Spot prices around a third of on-demand with a daily swing, and availability 0..4."""
    rng = np.random.default_rng(seed)
    hours = np.arange(SLOTS + FORECAST_SLOTS)[:, None]
    base = np.array([0.92, 1.05, 1.18])
    prices = base * (1 + 0.15 * np.sin(2 * np.pi * hours / 24)) + rng.normal(0, 0.02, (len(hours), len(POOLS)))
    available = rng.integers(0, 4, (len(hours), len(POOLS)))
    return np.round(prices, 4), available


def _allocate(prices: np.ndarray, available: np.ndarray, on_demand: int, fill: bool = True) -> dict[str, Any]:
    """``on_demand`` instances, the cheapest spot pools, then (``fill``) on-demand up to N_max."""
    spot: dict[str, int] = {}
    room = MAX_INSTANCES - on_demand
    for m in np.argsort(prices):
        take = int(min(available[m], room))
        if take:
            spot[POOLS[m]] = take
            room -= take
    return {"spot": spot, "on_demand": on_demand + room if fill else on_demand}


def _count(allocation: dict[str, Any]) -> int:
    return sum(allocation["spot"].values()) + allocation["on_demand"]


def _bill(allocation: dict[str, Any], prices: np.ndarray, hours: float) -> float:
    spot = sum(n * prices[POOLS.index(pool)] for pool, n in allocation["spot"].items())
    return float(hours * (spot + allocation["on_demand"] * ON_DEMAND_PRICE))


def sample_decision_log() -> list[dict[str, Any]]:
    """24 decisions of a finished run on three pools, with one preemption at slot 9."""
    prices, available = _market(seed=7)
    log: list[dict[str, Any]] = []
    work = cost = 0.0
    preemptions = 0
    preempted_by_pool: dict[str, int] = {}
    for t in range(SLOTS):
        on_demand = 1 if t >= 16 else 0  # the policy starts hedging once slack runs low
        allocation = _allocate(prices[t], available[t], on_demand)
        applied = {"spot": dict(allocation["spot"]), "on_demand": allocation["on_demand"]}
        if t == PREEMPTED_SLOT:
            pool = next(iter(applied["spot"]))
            applied["spot"][pool] -= 1
            preemptions += 1
            preempted_by_pool[pool] = preempted_by_pool.get(pool, 0) + 1
        ahead = range(t + 1, min(t + 1 + FORECAST_SLOTS, SLOTS))
        forecast = {
            pool: {
                "spot_price": [round(float(prices[t, m] * (1 + 0.01 * (s - t))), 4) for s in ahead],
                "available": [float(max(available[t, m] - (s - t) % 3, 0)) for s in ahead],
            }
            for m, pool in enumerate(POOLS)
        }
        log.append({
            "slot": t,
            "time": _iso(WALL_START + timedelta(seconds=t * WALL_SECONDS_PER_SLOT)),
            "market_time": _iso(MARKET_START + timedelta(hours=t)),
            "market": {pool: {"spot_price": float(prices[t, m]), "available": int(available[t, m])}
                       for m, pool in enumerate(POOLS)},
            "on_demand_price": ON_DEMAND_PRICE,
            "forecast": forecast if ahead else None,
            # later slots are planned on the forecast's spot capacity, without the on-demand top-up
            "plan": [allocation] + [_allocate(prices[t], np.maximum(available[t] - (s - t) % 3, 0), 1 if s >= 16 else 0,
                                              fill=False) for s in ahead],
            "allocation": allocation,
            "applied": applied,
            "work_done": work,
            "cost_so_far": cost,
            "preemptions": preemptions,
            "preempted_by_pool": dict(preempted_by_pool),
            # the runtime's report: the loss falls, throughput follows the instances that ran before
            "training": None if t == 0 else {
                "loss": round(3.0 * 0.93**t, 4), "samples_per_second": round(0.2 * _count(log[-1]["applied"]), 3),
                "step": 10 * t, "world_size": _count(log[-1]["applied"]),
                "updated": _iso(WALL_START + timedelta(seconds=t * WALL_SECONDS_PER_SLOT - 1)),
            },
            "next_decision": _iso(WALL_START + timedelta(seconds=(t + 1) * WALL_SECONDS_PER_SLOT)),
            "deadline_hours": DEADLINE_HOURS,
            "hard_deadline_hours": HARD_DEADLINE_HOURS,
        })
        work += WORK_PER_INSTANCE_HOUR * _count(applied)
        cost += _bill(applied, prices[t], 1.0)
    # the job finishes half-way through the last slot; N_max on-demand would have needed total / H(N_max)
    total = work - 0.5 * WORK_PER_INSTANCE_HOUR * _count(log[-1]["applied"])
    reference = total / (MAX_INSTANCES * WORK_PER_INSTANCE_HOUR) * MAX_INSTANCES * ON_DEMAND_PRICE
    for entry in log:
        entry["work_total"] = total
        entry["on_demand_cost_so_far"] = min(reference, entry["slot"] * MAX_INSTANCES * ON_DEMAND_PRICE)
    return log


def sample_in_progress_log(slots: int = 10) -> list[dict[str, Any]]:
    """The first ``slots`` decisions, the last one decided but not yet applied by the backend."""
    if not 1 <= slots <= SLOTS:
        raise ValueError(f"slots must be in 1..{SLOTS}, got {slots}")
    log = sample_decision_log()[:slots]
    log[-1]["applied"] = None
    return log


def sample_result(log: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The operator's return value for the finished :func:`sample_decision_log`."""
    log = log if log is not None else sample_decision_log()
    last = log[-1]
    prices = np.array([last["market"][pool]["spot_price"] for pool in POOLS])
    completion = (len(log) - 1) + 0.5
    cost = last["cost_so_far"] + _bill(last["applied"], prices, 0.5)
    on_demand_cost = last["work_total"] * ON_DEMAND_PRICE / WORK_PER_INSTANCE_HOUR
    value = 400.0
    return {
        "cost": cost,
        "on_demand_cost": on_demand_cost,
        "savings": on_demand_cost - cost,
        "savings_fraction": (on_demand_cost - cost) / on_demand_cost,
        "completion_hours": completion,
        "deadline_met": completion <= DEADLINE_HOURS,
        "hard_deadline_met": completion <= HARD_DEADLINE_HOURS,
        "preemptions": last["preemptions"],
        "preemptions_by_pool": dict(last["preempted_by_pool"]),
        "utility": value - cost,
        "value": value,
        "policy": "chc",
        "job_id": "spot-demo-0001",
        "slots": len(log),
        "deadline_hours": DEADLINE_HOURS,
        "hard_deadline_hours": HARD_DEADLINE_HOURS,
        "budget": None,
    }
