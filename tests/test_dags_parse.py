"""Both shipped DAG files parse in a DagBag without import errors, with the tasks the docs name.

The DagBag is filled in a subprocess of the throwaway deployment (tests.airflow_env): Airflow
reads its configuration once per process, and the DAGs folder here is the repository's.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.airflow_env import REPO, AirflowHome, airflow_home  # noqa: F401  (the session fixture)

LIST_DAGS = """
import json
from airflow.dag_processing.dagbag import DagBag

bag = DagBag(dag_folder={folder!r})
print(json.dumps({{
    "errors": {{path: str(error) for path, error in bag.import_errors.items()}},
    "dags": {{
        dag_id: {{
            "tasks": sorted(dag.task_ids),
            "upstream": {{t.task_id: sorted(t.upstream_task_ids) for t in dag.tasks}},
            "operators": {{t.task_id: type(t).__name__ for t in dag.tasks}},
            "schedule": str(dag.schedule),
        }}
        for dag_id, dag in bag.dags.items()
    }},
}}))
"""


def test_the_shipped_dags_parse_with_the_documented_tasks(airflow_home: AirflowHome):
    done = subprocess.run(
        [sys.executable, "-c", LIST_DAGS.format(folder=str(REPO / "dags"))],
        cwd=REPO, env=airflow_home.env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["errors"] == {}
    assert set(found["dags"]) == {"spot_finetune_demo", "scheduled_retraining"}

    demo = found["dags"]["spot_finetune_demo"]  # docs/airflow.md: the operator, then the summary it prints
    assert demo["tasks"] == ["fine_tune", "summary"]
    assert demo["operators"]["fine_tune"] == "DeadlineSpotFineTuneOperator"
    assert demo["upstream"]["summary"] == ["fine_tune"]

    weekly = found["dags"]["scheduled_retraining"]  # prepare -> fine-tune on EC2 -> evaluate -> register
    assert weekly["tasks"] == ["evaluate", "fine_tune", "prepare_dataset", "register"]
    assert weekly["operators"]["fine_tune"] == "DeadlineSpotFineTuneOperator"
    assert weekly["upstream"] == {
        "prepare_dataset": [],
        "fine_tune": ["prepare_dataset"],
        "evaluate": ["fine_tune"],
        "register": ["evaluate", "prepare_dataset"],
    }
    assert weekly["schedule"] == "0 18 * * 5"
