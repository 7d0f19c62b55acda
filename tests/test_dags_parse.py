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


PREPARE_WEEK = """
import json, sys
from datetime import datetime, timedelta, timezone
import importlib.util
from airflow.sdk import ObjectStoragePath

spec = importlib.util.spec_from_file_location("weekly", {path!r})
weekly = importlib.util.module_from_spec(spec)
spec.loader.exec_module(weekly)
root = {root!r}
weekly.ObjectStoragePath = lambda uri, conn_id=None: ObjectStoragePath("file://" + root + "/" + uri.removeprefix("s3://"))
weekly.MIN_TICKETS = 1
raw = ObjectStoragePath("file://" + root + "/acme-ml/support/raw")
raw.mkdir(parents=True, exist_ok=True)
ObjectStoragePath("file://" + root + "/acme-ml/support/retraining/2025-09-12").mkdir(parents=True)  # S3 needs none
run = datetime(2025, 9, 12, 18, tzinfo=timezone.utc)  # a Friday's run
for back in range(10):  # one ticket a day, from ten days before the run to the run's day
    day = run - timedelta(days=back)
    (raw / f"{{day:%Y-%m-%d}}.jsonl").write_text(json.dumps({{"question": f"q{{back}}", "answer": "a"}}) + "\\n")
# Airflow 3's cron schedule gives the run an empty data interval: start == end == the run's time
prepared = weekly.prepare_dataset.function(data_interval_end=run, ds="2025-09-12")
weekly.MIN_TICKETS = 8  # a thin week is skipped, not failed and retried
try:
    weekly.prepare_dataset.function(data_interval_end=run, ds="2025-09-12")
except Exception as thin:
    prepared["thin_week"] = type(thin).__name__
print(json.dumps(prepared))
"""


def test_the_weekly_dag_trains_on_the_week_before_its_run_although_its_data_interval_is_empty(airflow_home, tmp_path):
    """`schedule="0 18 * * 5"` is a CronTriggerTimetable in Airflow 3: data_interval_start equals its end, so
    the week must be counted back from the end (reading from the start read no ticket and failed every week)."""
    code = PREPARE_WEEK.format(path=str(REPO / "dags" / "scheduled_retraining.py"), root=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=airflow_home.env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    prepared = json.loads(done.stdout.strip().splitlines()[-1])
    assert prepared["tickets"] == 7  # 2025-09-05 .. 2025-09-11: the seven days before Friday 18:00
    assert prepared["thin_week"] == "AirflowSkipException"
    train = (tmp_path / "acme-ml/support/retraining/2025-09-12/train.txt").read_text()
    assert "q7" in train and "q1" in train and "q0" not in train and "q8" not in train
