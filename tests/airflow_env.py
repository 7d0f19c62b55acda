"""A throwaway Airflow deployment for the end-to-end tests, driven only through subprocesses.

Airflow reads its configuration once, at import, and other test modules in the same pytest
process import it with settings of their own; so this process never imports Airflow for these
tests. :func:`airflow_home` builds a temporary ``AIRFLOW_HOME`` (SQLite, no example DAGs, a DAGs
folder with the demo DAG and the test DAGs of :mod:`tests.operator_scenarios`) and runs
``airflow db migrate`` in a subprocess; :meth:`AirflowHome.run_scenarios` then runs the
scenarios with ``dag.test()`` in one more subprocess (one Airflow start-up for all of them) and
returns what each one observed, as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
AIRFLOW = Path(sys.executable).with_name("airflow")


@dataclass(frozen=True)
class AirflowHome:
    """The deployment's directory and the environment that selects it."""

    home: Path
    env: dict[str, str]

    @property
    def workdir(self) -> Path:
        """The local backend's embedded default workdir in this deployment."""
        return self.home / "spotsched"

    def run_scenarios(self, out: Path, timeout_s: float) -> dict[str, Any]:
        """Run every scenario of :mod:`tests.operator_scenarios`; what each observed, by name."""
        done = subprocess.run(
            [sys.executable, "-m", "tests.operator_scenarios", str(out)],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        (self.home / "scenarios.log").write_text(done.stdout + done.stderr)
        assert done.returncode == 0, f"scenarios failed (log: {self.home / 'scenarios.log'}):\n{done.stderr[-4000:]}"
        return json.loads(out.read_text())


def make_airflow_home(home: Path) -> AirflowHome:
    """A migrated SQLite deployment in ``home`` whose DAGs folder holds the demo and test DAGs."""
    dags = home / "dags"
    dags.mkdir(parents=True)
    shutil.copy(REPO / "dags" / "spot_finetune_demo.py", dags)
    from tests.operator_scenarios import write_test_dags

    write_test_dags(dags)
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run([str(AIRFLOW), "db", "migrate"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"airflow db migrate failed:\n{done.stderr[-4000:]}"
    return AirflowHome(home, env)


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> AirflowHome:
    return make_airflow_home(tmp_path_factory.mktemp("airflow-home"))
