"""What Airflow hands a task and its triggers, faked to drive the operator by hand.

Shared by tests/test_operator.py, tests/test_market_sensor.py and benchmarks/bench_triggers.py:
a ``task_state_store``, a task instance that records XComs and the asset events' accessors
(:class:`TaskContext`), and a trigger rebuilt from its serialised form, as a restarted
triggerer rebuilds it.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from typing import Any

from airflow.sdk.execution_time.context import OutletEventAccessors


class TaskStateStore:
    """``context["task_state_store"]``: JSON values by key, kept across tries of one task."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def get(self, key: str, default: Any = None) -> Any:
        return json.loads(self.values[key]) if key in self.values else default

    def set(self, key: str, value: Any, retention: Any = None) -> None:
        self.values[key] = json.dumps(value)


class TaskInstance:
    """The few task-instance fields the operator reads, and the XComs it pushes."""

    def __init__(self, try_number: int = 1) -> None:
        self.dag_id, self.task_id, self.run_id, self.map_index = "tests", "fine_tune", "manual__1", -1
        self.try_number = try_number
        self.xcoms: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[key] = json.loads(json.dumps(value))


class TaskContext(dict):
    """``ti``, ``task_state_store`` and Airflow's own ``outlet_events`` (the asset events' extras)."""

    def __init__(self, store: TaskStateStore, try_number: int = 1) -> None:
        super().__init__(ti=TaskInstance(try_number), task_state_store=store, outlet_events=OutletEventAccessors())


def rebuilt(trigger: Any) -> Any:
    """The trigger as a restarted triggerer rebuilds it: from its serialised, JSON-stored form."""
    path, kwargs = trigger.serialize()
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs)))


def first_payload(trigger: Any) -> dict[str, Any]:
    """The payload of ``trigger``'s first event, run in an event loop as the triggerer runs it."""

    async def first() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(first())
