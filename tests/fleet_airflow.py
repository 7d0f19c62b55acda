"""A throwaway Airflow deployment holding many spot runs of two DAGs, for the fleet dashboard.

Built the supported way, in subprocesses: ``airflow db migrate``, then one Python process that
runs ``dag.test()`` once per DAG run (one Airflow start-up for all of them; ``airflow dags test``
is ``dag.test()`` behind a CLI). The DAG file defines an operator *named*
``DeadlineSpotFineTuneOperator``, which is what ``TaskInstance.operator`` records (the class
name), pushing a sample decision log and one of :func:`tests.fleet_samples.result_variant`'s
results per task instance:

- ``spotsched_fleet_a``: runs on 1-3 October 2025, each with a ``fine_tune`` task and a ``sweep``
  task mapped over two indexes (9 finished spot task instances);
- ``spotsched_fleet_b``: runs on 11-14 October, each with a ``prepare`` task of another operator
  that returns a result-like dict (which must not count), then ``fine_tune``: two finish, one
  fails after logging decisions (no result), and the last is left *in flight*: it logs ten
  slots and returns nothing, then its state is set back to ``running`` (a run cannot be caught
  mid-flight by ``dag.test()``, which waits for every task).

The DAG runs' ``run_after`` is their logical date, the dashboard's time axis. The selector
Variable holds :func:`tests.fleet_samples.selector_document` with job ids of both DAGs. The
environment that serves it selects :class:`tests.fleet_auth.PerDagAuthManager` with users
``viewer`` (every DAG), ``alice`` (DAG A only), ``carol`` (both DAGs, the XComs of A only) and
``nobody`` (no DAG).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fleet_samples import result_variant, selector_document
from tests.report_airflow import deployment_env, shared_build, simple_auth_env
from tests.run_log_samples import sample_decision_log, sample_in_progress_log

REPO = Path(__file__).resolve().parent.parent
AIRFLOW = Path(sys.executable).with_name("airflow")
DAG_A, DAG_B = "spotsched_fleet_a", "spotsched_fleet_b"
DATES = {DAG_A: ("2025-10-01", "2025-10-02", "2025-10-03"),
         DAG_B: ("2025-10-11", "2025-10-12", "2025-10-13", "2025-10-14")}
FAILED_DATE, IN_FLIGHT_DATE = "2025-10-13", "2025-10-14"
IN_FLIGHT_SLOTS = 10
SWEEP = 2  # mapped indexes of DAG A's sweep task
SELECTOR_VARIABLE = "spotsched_selector_state"
OPERATOR = "DeadlineSpotFineTuneOperator"
FERNET_KEY = "UHKwTEg-bsdn7K_4Y3At-Yd8XGAIfplYAD1lz5qEniM="  # for these tests only
ACCESS = {"alice": {"dags": [DAG_A]}, "carol": {"dags": [DAG_A, DAG_B], "xcom": [DAG_A]}, "nobody": {"dags": []}}

DAG_FILE = '''
import json
from pathlib import Path

import pendulum
from airflow.sdk import DAG, BaseOperator, task

DATA = Path({data!r})


class DeadlineSpotFineTuneOperator(BaseOperator):
    """Named like the provider's operator, which is what TaskInstance.operator records: pushes a
    sample decision log and the result chosen for its DAG, task, map index and logical date."""

    def __init__(self, *, variant=None, **kwargs):
        super().__init__(**kwargs)
        self.variant = variant

    def execute(self, context):
        ti = context["ti"]
        sample = json.loads((DATA / "samples.json").read_text())[
            f"{{ti.dag_id}}/{{ti.task_id}}/{{ti.map_index}}/{{context['logical_date']:%Y-%m-%d}}"]
        ti.xcom_push(key="decision_log", value=json.loads((DATA / sample["log"]).read_text()))
        if sample.get("fail"):
            raise RuntimeError("the sample run fails after logging its decisions")
        return sample.get("result")


with DAG({dag_a!r}, schedule=None, start_date=pendulum.datetime(2025, 1, 1), catchup=False) as dag_a:
    DeadlineSpotFineTuneOperator(task_id="fine_tune")
    DeadlineSpotFineTuneOperator.partial(task_id="sweep").expand(variant=list(range({sweep})))

with DAG({dag_b!r}, schedule=None, start_date=pendulum.datetime(2025, 1, 1), catchup=False) as dag_b:

    @task(task_id="prepare")
    def prepare():
        return {{"cost": 1e6, "on_demand_cost": 1e6, "savings": 1e6, "preemptions": 1000, "deadline_met": False}}

    prepare() >> DeadlineSpotFineTuneOperator(task_id="fine_tune", retries=0)
'''

DRIVER = '''
import importlib.util, json, sys
from datetime import datetime, timezone

from airflow.models.variable import Variable
from airflow.sdk import DAG

plan = json.loads(sys.argv[2])
spec = importlib.util.spec_from_file_location("spotsched_fleet_dags", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
dags = {dag.dag_id: dag for dag in vars(module).values() if isinstance(dag, DAG)}
for dag_id, day in plan["runs"]:
    when = datetime.fromisoformat(day).replace(tzinfo=timezone.utc)
    run = dags[dag_id].test(logical_date=when, run_after=when)
    print(dag_id, day, run.run_id, run.state, flush=True)
Variable.set(plan["variable"], json.dumps(plan["selector"]))
'''


@dataclass(frozen=True)
class FleetDb:
    """The deployment's files and the environment that serves it (``serve_reports`` reads ``env``)."""

    home: Path
    env: dict[str, str]

    @property
    def database(self) -> Path:
        return self.home / "airflow.db"


def samples() -> dict[str, dict[str, Any]]:
    """What each spot task instance pushes, by ``dag/task/map_index/date``."""
    plan: dict[str, dict[str, Any]] = {}
    i = 0
    for dag_id, days in DATES.items():
        tasks = [("fine_tune", -1)] + ([("sweep", m) for m in range(SWEEP)] if dag_id == DAG_A else [])
        for day in days:
            for task_id, map_index in tasks:
                key = f"{dag_id}/{task_id}/{map_index}/{day}"
                if dag_id == DAG_B and day == FAILED_DATE:
                    plan[key] = {"log": "decision_log.json", "fail": True}
                elif dag_id == DAG_B and day == IN_FLIGHT_DATE:
                    plan[key] = {"log": "in_progress_log.json"}
                else:
                    plan[key] = {"log": "decision_log.json", "result": result_variant(i)}
                    i += 1
    return plan


def job_ids() -> list[str]:
    """Job ids as the operator makes them (``job_id_for``, a fixed nonce: the same on every call): they embed the DAG id."""
    from airflow_provider_spotsched.operators.fine_tune import job_id_for

    return [job_id_for(dag_id, "fine_tune", f"manual__{day}T00:00:00+00:00", nonce="0") for dag_id, days in DATES.items()
            for day in days]


def build_fleet_db(home: Path) -> FleetDb:
    """Migrate a SQLite metadata database in ``home`` and run both DAGs into it."""
    data, dags = home / "data", home / "dags"
    data.mkdir(parents=True)
    dags.mkdir()
    (data / "decision_log.json").write_text(json.dumps(sample_decision_log()))
    (data / "in_progress_log.json").write_text(json.dumps(sample_in_progress_log(IN_FLIGHT_SLOTS)))
    (data / "samples.json").write_text(json.dumps(samples()))
    dag_file = dags / "spotsched_fleet_dags.py"
    dag_file.write_text(DAG_FILE.format(data=str(data), dag_a=DAG_A, dag_b=DAG_B, sweep=SWEEP))
    # the Variable is encrypted; the serving process must decrypt it
    build_env = {**deployment_env(home, dags), "AIRFLOW__CORE__FERNET_KEY": FERNET_KEY}
    plan = {"runs": [[dag_id, day] for dag_id, days in DATES.items() for day in days],
            "variable": SELECTOR_VARIABLE, "selector": selector_document(job_ids())}
    for command in ([str(AIRFLOW), "db", "migrate"],
                    [sys.executable, "-c", DRIVER, str(dag_file), json.dumps(plan)]):
        done = subprocess.run(command, env={**os.environ, **build_env}, cwd=home, capture_output=True, text=True,
                              timeout=900)
        with (home / "build.log").open("a") as log:
            log.write(done.stdout + done.stderr)
        assert done.returncode == 0, f"{command[:2]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    with sqlite3.connect(home / "airflow.db") as connection:
        # the last run of DAG B is put back in flight: running, no end, no result (it returned none)
        changed = connection.execute(
            "UPDATE task_instance SET state = 'running', end_date = NULL WHERE dag_id = ? AND task_id = 'fine_tune' "
            "AND run_id IN (SELECT run_id FROM dag_run WHERE dag_id = ? AND run_after LIKE ?)",
            (DAG_B, DAG_B, f"{IN_FLIGHT_DATE}%")).rowcount
        assert changed == 1, changed
    env = {
        **build_env,
        **simple_auth_env(home, "fleet-tests", users="viewer:viewer,alice:viewer,carol:viewer,nobody:viewer",
                          auth_manager="tests.fleet_auth.PerDagAuthManager"),
        "SPOTSCHED_TEST_DAG_ACCESS": json.dumps(ACCESS),
    }
    return FleetDb(home, env)


def shared_fleet_db(tmp_path_factory: pytest.TempPathFactory) -> FleetDb:
    """The fleet deployment, built once per test session (:func:`~tests.report_airflow.shared_build`)."""
    data = shared_build(tmp_path_factory, "spotsched_fleet_db", lambda home: asdict(build_fleet_db(home)))
    return FleetDb(Path(data["home"]), data["env"])
