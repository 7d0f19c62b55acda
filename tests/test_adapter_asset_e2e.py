"""A fine-tune's adapter Asset in a real (throwaway) Airflow: the event, its extra, the consumer queued.

A producer DAG fine-tunes with the fake worker (tests/fake_worker.py: the runtime's contract in
seconds) and a fixed ``checkpoint_uri``, so its default outlet is the adapter's location; a
consumer DAG is scheduled on that Asset. One subprocess of the deployment of tests.airflow_env
runs the producer with ``dag.test()`` (which writes both DAGs of the folder to the metadata DB)
and then reads the DB: the asset event and the consumer's queued run (AssetDagRunQueue).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.airflow_env import REPO, AirflowHome, airflow_home  # noqa: F401  (the session fixture)
from tests.operator_scenarios import FAKE_WORKER

PRODUCER, CONSUMER = "spotsched_adapter_producer", "spotsched_adapter_consumer"
SAMPLES = 200  # 20 samples/s on one fake worker: two 5-second slots
RUN_TIMEOUT_S = 600

PRODUCER_DAG = '''
import sys
from datetime import datetime

from airflow.sdk import DAG

from airflow_provider_spotsched.operators.fine_tune import DeadlineSpotFineTuneOperator

with DAG({dag_id!r}, schedule=None, start_date=datetime(2025, 1, 1), catchup=False):
    DeadlineSpotFineTuneOperator(
        task_id="fine_tune",
        pools=["us-east4-a", "europe-west1-c"],
        work={samples},
        deadline=6.0,
        throughput={{"alpha": 100.0}},
        value=100.0,
        command=[sys.executable, {worker!r}, "--config", {config!r}, "--checkpoint-uri", {checkpoint!r}],
        checkpoint_uri={checkpoint!r},
        backend_options={{"seconds_per_slot": 5.0, "market_start": "2025-10-11T03:10:00Z"}},
        policy="uniform-progress",
        forecaster="seasonal-naive",
        poll_interval=0.5,
    )
'''

CONSUMER_DAG = '''
from datetime import datetime

from airflow.sdk import DAG, Asset, task

with DAG({dag_id!r}, schedule=[Asset({uri!r})], start_date=datetime(2025, 1, 1), catchup=False):

    @task
    def evaluate(triggering_asset_events=None):
        return triggering_asset_events[Asset({uri!r})][-1].extra["adapter_uri"]

    evaluate()
'''

RUN_AND_READ = """
import json
from sqlalchemy import select
from airflow.models.asset import AssetDagRunQueue, AssetEvent, AssetModel
from airflow.utils.session import create_session
from tests.operator_scenarios import run_dag

observed = run_dag({producer!r})
with create_session() as session:
    events = session.execute(
        select(AssetModel.uri, AssetEvent.extra, AssetEvent.source_dag_id, AssetEvent.source_task_id)
        .join(AssetModel, AssetModel.id == AssetEvent.asset_id)
        .where(AssetEvent.source_dag_id == {producer!r})
    ).all()
    queued = session.execute(
        select(AssetDagRunQueue.target_dag_id, AssetModel.uri)
        .join(AssetModel, AssetModel.id == AssetDagRunQueue.asset_id)
    ).all()
found = {{"run": observed, "events": [list(e) for e in events], "queued": [list(q) for q in queued]}}
print(json.dumps(found, default=str))
"""


@pytest.fixture(scope="module")
def adapter_run(airflow_home: AirflowHome) -> dict:  # noqa: F811
    dags = airflow_home.home / "dags"
    checkpoint = airflow_home.home / "adapter-checkpoint"
    config = airflow_home.home / "adapter_worker.json"
    config.write_text(json.dumps({"samples": SAMPLES, "step_s": 0.05}))
    uri = (checkpoint / "final").as_uri()
    (dags / f"{PRODUCER}.py").write_text(PRODUCER_DAG.format(
        dag_id=PRODUCER, samples=SAMPLES, worker=str(FAKE_WORKER), config=str(config), checkpoint=str(checkpoint)))
    (dags / f"{CONSUMER}.py").write_text(CONSUMER_DAG.format(dag_id=CONSUMER, uri=uri))
    done = subprocess.run(
        [sys.executable, "-c", RUN_AND_READ.format(producer=PRODUCER)],
        cwd=REPO, env={**airflow_home.env, "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False"},
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    (airflow_home.home / "adapter-run.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-4000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "uri": uri, "checkpoint": checkpoint}


@pytest.mark.e2e
def test_a_successful_fine_tune_emits_the_adapter_asset_event_with_its_extra(adapter_run):
    assert adapter_run["run"]["tasks"]["fine_tune"]["state"] == "success"
    result = adapter_run["run"]["xcom"]["fine_tune.return_value"]
    (event,) = adapter_run["events"]
    uri, extra, dag_id, task_id = event
    assert (uri, dag_id, task_id) == (adapter_run["uri"], PRODUCER, "fine_tune")
    assert extra == {
        "adapter_uri": str(Path(adapter_run["checkpoint"]) / "final"),
        "job_id": result["job_id"],
        "cost": result["cost"],
        "policy": "uniform-progress",
        "deadline_met": result["deadline_met"],
    }
    assert (Path(extra["adapter_uri"]) / "adapter.txt").read_text() == f"{SAMPLES} samples\n"  # the fake adapter


@pytest.mark.e2e
def test_the_dag_scheduled_on_the_adapter_is_queued_to_run(adapter_run):
    assert [CONSUMER, adapter_run["uri"]] in adapter_run["queued"]
