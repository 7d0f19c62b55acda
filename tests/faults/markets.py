"""Synthetic spot traces for the fault suite: a calm market, and one whose every pool goes dark.

The format is the project's trace CSV (``timestamp,market,spot_price,available,on_demand_price``,
see shared/spec/scheduling-model.md and market/trace.py): hourly ticks, so that one tick is one
slot of a 1-hour-slot run. ``HISTORY_HOURS`` of calm market come before ``MARKET_START`` (the
forecasters' and the selector's warm-up read them); slot ``k`` of a run is hour ``k`` after it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

POOLS = ("zone-a", "zone-b", "zone-c")
HISTORY_HOURS = 48
ORIGIN = datetime(2025, 6, 1, tzinfo=timezone.utc)
MARKET_START = ORIGIN + timedelta(hours=HISTORY_HOURS)
ON_DEMAND_PRICE = 4.0
CAPACITY = 4


def write_trace(
    path: Path,
    hours_after_start: int = 48,
    storm: tuple[int, int] | None = None,
    seed: int = 0,
    pools: Sequence[str] = POOLS,
) -> Path:
    """A trace with ``HISTORY_HOURS`` before ``MARKET_START`` and ``hours_after_start`` after it.

    Spot prices wander a little around 1.0-1.6 USD/h (seeded) and every pool offers ``CAPACITY``
    instances, except during ``storm = (first, last)``: every pool's availability is 0 from slot
    ``first`` through slot ``last`` (inclusive) after ``MARKET_START``.
    """
    rng = random.Random(seed)
    base = {pool: 1.0 + 0.2 * m for m, pool in enumerate(pools)}
    lines = ["timestamp,market,spot_price,available,on_demand_price"]
    for hour in range(HISTORY_HOURS + hours_after_start + 1):
        when = (ORIGIN + timedelta(hours=hour)).strftime("%Y-%m-%dT%H:%M:%SZ")
        slot = hour - HISTORY_HOURS
        dark = storm is not None and storm[0] <= slot <= storm[1]
        for pool in pools:
            price = round(base[pool] * (1.0 + 0.1 * rng.uniform(-1.0, 1.0)), 4)
            lines.append(f"{when},{pool},{price},{0 if dark else CAPACITY},{ON_DEMAND_PRICE}")
    path.write_text("\n".join(lines) + "\n")
    return path
