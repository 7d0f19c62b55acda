"""The bill rebuilt from a decision log, for tests that check a run's cost against its slots."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def billed(log: list[dict], result: Mapping[str, Any]) -> float:
    """Each slot's applied allocation at its prices: every slot whole, the last up to completion."""
    total = 0.0
    for record in log:
        applied = record["applied"] or {"spot": {}, "on_demand": 0}
        hourly = sum(n * record["market"][p]["spot_price"] for p, n in applied["spot"].items())
        hourly += applied["on_demand"] * record["on_demand_price"]
        last = record is log[-1]
        total += hourly * ((result["completion_hours"] - record["slot"]) if last else 1.0)
    return total
