"""How fast the fleet dashboard answers with 10,000 spot runs in the metadata database.

1. A fresh SQLite metadata database in a temporary ``AIRFLOW_HOME``: ``airflow db migrate`` and
   one real ``dag.test()`` run of each of ``--dags`` DAGs (one subprocess), whose task is an
   operator named ``DeadlineSpotFineTuneOperator`` (what ``TaskInstance.operator`` records)
   pushing the sample decision log and a result. Those rows are the templates: each DAG's run is
   cloned with bulk inserts (SQLAlchemy core) into ``--runs`` DAG runs in all, spread over
   ``--days`` days: ``dag_run``, ``task_instance`` and two XComs per run, ``return_value`` (one
   of :func:`tests.fleet_samples.result_variant`'s results) and ``decision_log`` (the 24-slot
   sample log, about 36 KB, so reading the logs would show). ``--in-flight`` of the newest runs
   are left ``running`` with a log and no result. The selector's Variable holds its largest
   history (``KEEP_HISTORY`` rounds over 8 kinds of job of 8 members: the page's 8 weight charts).
2. In this process: Airflow's API server app (``create_app("core")``: the plugin mounted from
   its entry point as in production, SimpleAuthManager), a FastAPI ``TestClient`` and a viewer's
   token.
3. Each measure is the median of ``--repeat`` requests after one warm-up:
   ``GET /spotsched/fleet`` with every chart drawn afresh (the page's chart cache emptied first)
   and again with the charts unchanged (as a reload finds them), ``/spotsched/fleet/data.json``,
   the page for one DAG and for one week (drawn); and in the same run, on the same database, the baselines: the bare query of the runs'
   ``return_value`` XComs with ``XComModel.deserialize_value`` (what any page over the results
   must do at least), Airflow's REST API listing the same XComs (``GET /api/v2/dags/~/dagRuns/~/
   taskInstances/~/xcomEntries?xcom_key=return_value``, every page of 100, which carries no
   values; timed once, it takes tens of seconds), and the same bare query of the decision logs
   (what the page avoids; once).

Plain script (prints a table):

    python benchmarks/bench_fleet.py
    python benchmarks/bench_fleet.py --runs 10000 --dags 5 --repeat 5
    python benchmarks/bench_fleet.py --home /tmp/fleet-bench   # keep the database; a second run reuses it
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's provider (its plugin) and the tests' samples
from tests.fleet_samples import result_variant, selector_document  # noqa: E402
from tests.report_airflow import deployment_env, simple_auth_env  # noqa: E402
from tests.run_log_samples import sample_decision_log  # noqa: E402

AIRFLOW = Path(sys.executable).with_name("airflow")
FIRST_DAY = datetime(2025, 1, 1, tzinfo=timezone.utc)

DAG_FILE = '''
import json
from pathlib import Path

import pendulum
from airflow.sdk import DAG, BaseOperator

DATA = Path({data!r})


class DeadlineSpotFineTuneOperator(BaseOperator):
    """Named like the provider's operator: pushes the sample decision log and a result."""

    def execute(self, context):
        context["ti"].xcom_push(key="decision_log", value=json.loads((DATA / "decision_log.json").read_text()))
        return json.loads((DATA / "result.json").read_text())


for n in range({dags}):
    with DAG(f"spotsched_bench_{{n}}", schedule=None, start_date=pendulum.datetime(2024, 1, 1), catchup=False) as dag:
        DeadlineSpotFineTuneOperator(task_id="fine_tune")
    globals()[dag.dag_id] = dag
'''

DRIVER = '''
import importlib.util, sys
from datetime import datetime, timezone

from airflow.sdk import DAG

spec = importlib.util.spec_from_file_location("spotsched_bench_dags", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
when = datetime(2024, 12, 31, tzinfo=timezone.utc)
for dag in [d for d in vars(module).values() if isinstance(d, DAG)]:
    print(dag.dag_id, dag.test(logical_date=when, run_after=when).state, flush=True)
'''


def environment(home: Path) -> dict[str, str]:
    return {
        **deployment_env(home, home / "dags"),
        **simple_auth_env(home, "fleet-benchmark"),
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "WARNING",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def build_templates(home: Path, dags: int) -> None:
    """Migrate the database and run each DAG once, in subprocesses."""
    (home / "data").mkdir(parents=True)
    (home / "dags").mkdir()
    (home / "data" / "decision_log.json").write_text(json.dumps(sample_decision_log()))
    (home / "data" / "result.json").write_text(json.dumps(result_variant(0)))
    dag_file = home / "dags" / "spotsched_bench_dags.py"
    dag_file.write_text(DAG_FILE.format(data=str(home / "data"), dags=dags))
    env = {**os.environ, **environment(home)}
    for command in ([str(AIRFLOW), "db", "migrate"], [sys.executable, "-c", DRIVER, str(dag_file)]):
        done = subprocess.run(command, env=env, cwd=home, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{command[:2]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def clone_runs(runs: int, dags: int, days: float, in_flight: int) -> dict[str, Any]:
    """Clone each DAG's template run into ``runs`` runs in all (bulk inserts); what was written."""
    from airflow import settings
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from sqlalchemy import func, select

    dag_run, task_instance, xcom = DagRun.__table__, TaskInstance.__table__, XComModel.__table__
    step = timedelta(days=days) / runs
    log = sample_decision_log()
    written = {"dag_runs": 0, "results": 0, "logs": 0}
    with settings.engine.begin() as connection:
        templates = {}
        for n in range(dags):
            dag_id = f"spotsched_bench_{n}"
            templates[dag_id] = (
                dict(connection.execute(select(dag_run).where(dag_run.c.dag_id == dag_id)).mappings().one()),
                dict(connection.execute(select(task_instance).where(task_instance.c.dag_id == dag_id)).mappings().one()),
                {row["key"]: dict(row) for row in connection.execute(select(xcom).where(xcom.c.dag_id == dag_id)).mappings()},
            )
        # the templates count among the runs; the clones interleave the DAGs over the days
        plan = [(i, f"spotsched_bench_{i % dags}", FIRST_DAY + i * step) for i in range(runs - dags)]
        for start in range(0, len(plan), 2000):
            chunk = plan[start:start + 2000]
            run_rows = []
            for _i, dag_id, when in chunk:
                row = {k: v for k, v in templates[dag_id][0].items() if k != "id"}
                row.update(run_id=f"bench__{when.isoformat()}", logical_date=when, run_after=when, queued_at=when,
                           start_date=when, end_date=when + timedelta(hours=20), data_interval_start=when,
                           data_interval_end=when)
                run_rows.append(row)
            connection.execute(dag_run.insert(), run_rows)
            ids = dict(connection.execute(select(dag_run.c.run_id, dag_run.c.id).where(
                dag_run.c.run_id.in_([r["run_id"] for r in run_rows]))).all())
            ti_rows, xcom_rows = [], []
            for (i, dag_id, when), run_row in zip(chunk, run_rows):
                flying = i >= len(plan) - in_flight
                ti = dict(templates[dag_id][1])
                ti.update(id=uuid.uuid4(), run_id=run_row["run_id"], start_date=when + timedelta(minutes=1),
                          end_date=None if flying else when + timedelta(hours=19, minutes=i % 60),
                          state="running" if flying else "success", queued_dttm=when, scheduled_dttm=when)
                ti_rows.append(ti)
                for key, value in (("decision_log", log), ("return_value", None if flying else result_variant(i))):
                    if key == "return_value" and flying:
                        continue
                    entry = dict(templates[dag_id][2][key])
                    entry.update(dag_run_id=ids[run_row["run_id"]], run_id=run_row["run_id"], value=value,
                                 timestamp=ti["end_date"] or when)
                    xcom_rows.append(entry)
                    written["logs" if key == "decision_log" else "results"] += 1
            connection.execute(task_instance.insert(), ti_rows)
            connection.execute(xcom.insert(), xcom_rows)
            written["dag_runs"] += len(run_rows)
        written["dag_runs"] += dags
        written["results"] += dags
        written["logs"] += dags
        written["task_instances"] = connection.execute(select(func.count()).select_from(task_instance)).scalar()
    written["selector_rounds"] = write_selector()
    return written


def write_selector() -> int:
    """The selector's Variable at its largest: KEEP_HISTORY rounds over 8 kinds of job, 8 members each."""
    from airflow.models.variable import Variable

    from airflow_provider_spotsched.scheduling.selector import SelectorPolicy
    from airflow_provider_spotsched.scheduling.selector_store import KEEP_HISTORY

    contexts = tuple(f"n_max={n},slack={slack},overhead=15min,slot=1h" for n in (2, 4, 8, 16) for slack in (1.25, 1.5))
    document = selector_document([f"job-{i}" for i in range(200)], rounds=KEEP_HISTORY // len(contexts),
                                 contexts=contexts, members=SelectorPolicy().labels)
    Variable.set("spotsched_selector_state", json.dumps(document))
    return len(document["history"])


def timed(call: Callable[[], Any], repeat: int, warm_up: bool = True) -> tuple[float, Any]:
    """The median wall time of ``repeat`` calls after one warm-up call, and the last call's value."""
    value = call() if warm_up else None
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        value = call()
        times.append(time.perf_counter() - started)
    return statistics.median(times), value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--dags", type=int, default=5)
    parser.add_argument("--days", type=float, default=180.0, help="the span the runs' dates cover")
    parser.add_argument("--in-flight", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--home", type=Path, help="build the deployment here and keep it; reuse it if it is there")
    args = parser.parse_args()
    if args.home:
        run(args, args.home.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="spotsched-bench-fleet-") as tmp:
            run(args, Path(tmp))


def run(args: argparse.Namespace, home: Path) -> None:
    started = time.perf_counter()
    reuse = (home / "built.json").is_file()
    if not reuse:
        build_templates(home, args.dags)
    os.environ.update(environment(home))  # before this process imports Airflow
    if reuse:
        written = json.loads((home / "built.json").read_text())
    else:
        written = clone_runs(args.runs, args.dags, args.days, args.in_flight)
        (home / "built.json").write_text(json.dumps(written))
    build_s = None if reuse else time.perf_counter() - started
    report(measure(args), written, build_s, home, args)


def measure(args: argparse.Namespace) -> list[tuple[str, float, str]]:
    from airflow.api_fastapi.app import create_app, get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from fastapi.testclient import TestClient
    from sqlalchemy import select

    from airflow_provider_spotsched.simulation.fleet_page import clear_chart_cache

    app = create_app("core")
    client = TestClient(app)
    headers = {"Authorization": f"Bearer {get_auth_manager().generate_jwt(SimpleAuthManagerUser(username='viewer', role='viewer'))}"}

    def get(path: str) -> Any:
        response = client.get(path, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"GET {path}: {response.status_code} {response.text[:500]}")
        return response

    def bare(key: str) -> Callable[[], int]:
        def query() -> int:
            with create_session() as session:
                rows = session.execute(select(XComModel.value).where(XComModel.key == key))
                return len([XComModel.deserialize_value(row) for row in rows])
        return query

    def rest_listing() -> int:
        listed, offset = 0, 0
        while True:
            page = get(f"/api/v2/dags/~/dagRuns/~/taskInstances/~/xcomEntries?xcom_key=return_value&limit=100"
                       f"&offset={offset}").json()
            listed += len(page["xcom_entries"])
            offset += 100
            if offset >= page["total_entries"]:
                return listed

    rows: list[tuple[str, float, str]] = []
    seconds, counted = timed(bare("return_value"), args.repeat)
    rows.append(("baseline: query + deserialise the results", seconds, f"{counted} results"))
    get("/api/v2/dags/~/dagRuns/~/taskInstances/~/xcomEntries?xcom_key=return_value&limit=100")  # its warm-up
    seconds, listed = timed(rest_listing, 1, warm_up=False)  # tens of seconds: once
    rows.append(("baseline: REST API lists the results (once)", seconds, f"{listed} entries, {-(-listed // 100)} pages"))
    seconds, counted = timed(bare("decision_log"), 1, warm_up=False)
    rows.append(("what is avoided: query + deserialise the logs (once)", seconds, f"{counted} decision logs"))
    seconds, response = timed(lambda: (clear_chart_cache(), get("/spotsched/fleet"))[1], args.repeat)
    rows.append(("GET /spotsched/fleet, every chart drawn", seconds, f"{len(response.content) / 1024:.0f} KiB of HTML"))
    seconds, response = timed(lambda: get("/spotsched/fleet"), args.repeat)
    rows.append(("GET /spotsched/fleet again, charts unchanged", seconds, "the drawn charts reused"))
    seconds, response = timed(lambda: get("/spotsched/fleet/data.json"), args.repeat)
    data = response.json()
    totals = data["totals"]
    rows.append(("GET /spotsched/fleet/data.json", seconds,
                 f"{totals['runs']} runs, {totals['finished']} finished, {totals['in_flight']} in flight"))
    seconds, response = timed(lambda: (clear_chart_cache(), get("/spotsched/fleet?dag_id=spotsched_bench_0"))[1],
                              args.repeat)
    rows.append(("GET /spotsched/fleet?dag_id=<one DAG>, drawn", seconds,
                 f"{args.runs // args.dags} runs, {len(response.content) / 1024:.0f} KiB"))
    week = (FIRST_DAY + timedelta(days=30)).date()
    seconds, response = timed(lambda: (clear_chart_cache(), get(f"/spotsched/fleet?since={week}&until={week + timedelta(days=6)}"))[1],
                              args.repeat)
    rows.append(("GET /spotsched/fleet?since=..&until=.. (a week), drawn", seconds,
                 f"{7 * args.runs / args.days:.0f} runs, {len(response.content) / 1024:.0f} KiB"))
    return rows


def report(rows: list[tuple[str, float, str]], written: dict[str, Any], build_s: float | None, home: Path,
           args: argparse.Namespace) -> None:
    size = (home / "airflow.db").stat().st_size / 2**20
    built = "reused" if build_s is None else f"built in {build_s:.0f} s"
    print(f"\n{written['dag_runs']} DAG runs of {args.dags} DAGs over {args.days:g} days, {written['task_instances']} task "
          f"instances, {written['results']} results and {written['logs']} decision logs ({size:.0f} MiB SQLite), "
          f"a selector Variable of {written['selector_rounds']} rounds, {built}; median of {args.repeat} requests "
          "after a warm-up "
          f"({os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f})")
    baseline = rows[0][1]
    print(f"{'measure':<56}{'median s':>10}{'x baseline':>12}  what")
    for name, seconds, what in rows:
        print(f"{name:<56}{seconds:>10.3f}{seconds / baseline:>12.1f}  {what}")


if __name__ == "__main__":
    main()
