"""The fault suite's two forms and its figures.

``make test`` runs every scenario at its smallest; the cases marked ``chaos`` (more slots, several
seeds, every policy, every kill point) run only when asked for: ``make chaos``, i.e.
``SPOTSCHED_CHAOS=1 pytest -m chaos -n 0 tests/faults``. Each run's figures (leaked instances,
double launches, lost checkpoints, deadlines) go to the session's :class:`Ledger`, printed at the
end and written to ``$SPOTSCHED_FAULTS_REPORT`` (JSON) when that is set.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.faults.support import CHAOS, Figures


class Ledger:
    """Every run's figures, by scenario."""

    def __init__(self) -> None:
        self.runs: list[Figures] = []

    def add(self, figures: Figures) -> Figures:
        self.runs.append(figures)
        return figures

    def table(self) -> list[dict[str, Any]]:
        by: dict[str, list[Figures]] = defaultdict(list)
        for figures in self.runs:
            by[figures.scenario].append(figures)
        return [
            {
                "scenario": scenario,
                "runs": len(runs),
                "leaked_instances": sum(f.leaked_instances for f in runs),
                "double_launches": sum(f.double_launches for f in runs),
                "lost_checkpoints": sum(f.lost_checkpoints for f in runs),
                "deadlines_met": sum(1 for f in runs if f.deadline_met),
                "deadlines_feasible": sum(1 for f in runs if f.deadline_feasible and f.deadline_met is not None),
            }
            for scenario, runs in by.items()
        ]


LEDGER = Ledger()


@pytest.fixture
def ledger() -> Ledger:
    return LEDGER


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``-m chaos`` (or SPOTSCHED_CHAOS=1), the chaos cases are deselected, not skipped."""
    if CHAOS or "chaos" in (config.getoption("markexpr") or ""):
        return
    chaos = [item for item in items if item.get_closest_marker("chaos")]
    if chaos:
        config.hook.pytest_deselected(items=chaos)
        items[:] = [item for item in items if not item.get_closest_marker("chaos")]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    table = LEDGER.table()
    if not table:
        return
    terminalreporter.section("fault suite figures")
    columns = ["scenario", "runs", "leaked_instances", "double_launches", "lost_checkpoints", "deadlines_met"]
    terminalreporter.write_line(" | ".join(columns))
    for row in table:
        cells = [str(row[c]) for c in columns]
        cells[-1] = f"{row['deadlines_met']}/{row['deadlines_feasible']}"
        terminalreporter.write_line(" | ".join(cells))
    report = os.environ.get("SPOTSCHED_FAULTS_REPORT")
    if report:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(json.dumps({"table": table, "runs": [f.to_dict() for f in LEDGER.runs]}, indent=1))
        terminalreporter.write_line(f"figures written to {report}")
