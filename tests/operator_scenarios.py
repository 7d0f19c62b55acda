"""End-to-end scenarios, run with ``dag.test()`` inside the throwaway deployment of tests.airflow_env.

``python -m tests.operator_scenarios OUT.json`` (with that deployment's environment) runs

- ``demo``: the demo DAG as shipped (real runtime, replayed GCP market, the selector);
- ``retry``: a DAG whose operator fails in the middle of its first try (the failure releases
  the instances) and succeeds on its retry, which resumes the saved run;

and writes what each observed (task states and tries, XComs, the selector Variable, the job's
directories) to OUT.json for tests/test_operator_e2e.py to check. Nothing here imports Airflow
at module level: tests.airflow_env imports :func:`write_test_dags` from the pytest process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
FAKE_WORKER = TESTS / "fake_worker.py"
DEMO_DAG_ID = "spot_finetune_demo"
RETRY_DAG_ID = "spotsched_retry_test"
SELECTOR_VARIABLE = "spotsched_selector_state"
RETRY_SAMPLES = 600  # 40 samples/s on two fake workers: about three 5-second slots

RETRY_DAG = '''
import sys
from datetime import datetime, timedelta

from airflow.sdk import DAG

from airflow_provider_spotsched.operators.fine_tune import STATE_KEY, DeadlineSpotFineTuneOperator


class FailOnceOperator(DeadlineSpotFineTuneOperator):
    """Fails its first try once the run has decided two slots: an error in the middle of a run."""

    def execute_slot(self, context, event):
        saved = context["task_state_store"].get(STATE_KEY)
        if context["ti"].try_number == 1 and len(saved["run"]["records"]) >= 2:
            raise RuntimeError("simulated failure in the middle of the run")
        return super().execute_slot(context, event)


with DAG({dag_id!r}, schedule=None, start_date=datetime(2025, 1, 1), catchup=False):
    FailOnceOperator(
        task_id="fine_tune",
        retries=1,
        retry_delay=timedelta(seconds=0),
        pools=["us-east4-a", "europe-west1-c"],
        work=600,
        deadline=8.0,
        hard_deadline_factor=1.5,
        throughput={{"alpha": 60.0}},
        value=100.0,
        max_instances=2,
        reconfig_overhead_hours=0.2,
        command=[sys.executable, {worker!r}, "--config", {config!r}, "--checkpoint-uri", {checkpoint!r}],
        checkpoint_uri={checkpoint!r},
        backend_options={{"seconds_per_slot": 5.0, "market_start": "2025-10-11T03:10:00Z"}},
        policy="uniform-progress",
        forecaster="seasonal-naive",
        poll_interval=0.5,
        deferrable=True,
    )
'''


def write_test_dags(dags: Path) -> None:
    """The retry DAG and its fake worker's config, beside the deployment's DAGs folder."""
    config = dags.parent / "fake_worker.json"
    config.write_text(json.dumps({"samples": RETRY_SAMPLES, "step_s": 0.05}))
    checkpoint = dags.parent / "retry-checkpoint"
    (dags / f"{RETRY_DAG_ID}.py").write_text(
        RETRY_DAG.format(dag_id=RETRY_DAG_ID, worker=str(FAKE_WORKER), config=str(config), checkpoint=str(checkpoint))
    )


def observe(dag_id: str) -> dict[str, Any]:
    """The latest run of ``dag_id``: task states and tries, and every XCom by task and key."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.id.desc())).first()
        tis = session.scalars(select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run.run_id)).all()
        xcoms = session.scalars(select(XComModel).where(XComModel.dag_id == dag_id, XComModel.run_id == run.run_id)).all()
        return {
            "state": str(run.state),
            "tasks": {ti.task_id: {"state": str(ti.state), "try_number": ti.try_number} for ti in tis},
            "xcom": {f"{x.task_id}.{x.key}": XComModel.deserialize_value(x) for x in xcoms},
        }


def run_dag(dag_id: str) -> dict[str, Any]:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk import conf

    bag = DagBag(dag_folder=conf.get("core", "dags_folder"))
    assert not bag.import_errors, bag.import_errors
    bag.get_dag(dag_id).test()
    return observe(dag_id)


def variable(key: str) -> Any:
    from airflow.models.variable import Variable

    return Variable.get(key, default_var=None, deserialize_json=True)


def main(out: str) -> None:
    results = {"demo": run_dag(DEMO_DAG_ID)}
    results["demo"]["variable"] = variable(SELECTOR_VARIABLE)
    results["retry"] = run_dag(RETRY_DAG_ID)
    Path(out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
