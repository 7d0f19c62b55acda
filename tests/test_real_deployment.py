"""The demo DAG under the real components: triggered through the REST API, run by the scheduler's
LocalExecutor, deferring to the triggerer between slots, its report served by the API server.

``dag.test()`` runs tasks and triggers in its own process, where the metadata database is at
hand; a real worker runs the task in a supervised process with the ORM blocked, talks to the API
server's execution API, and hands every deferral to a separate triggerer process. This module
starts those components (:mod:`tests.airflow_deployment`, the way ``make ui`` starts them) and
runs ``spot_finetune_demo`` once, sampling the ``fine_tune`` task instance while it runs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psutil
import pytest

from tests.airflow_deployment import AIRFLOW, COMPONENTS, VENV_BIN, Deployment, airflow_deployment

pytestmark = pytest.mark.deployment

DAG_ID = "spot_finetune_demo"
TASK_ID = "fine_tune"
TRIGGER_CLASSPATH = "airflow_provider_spotsched.triggers.spot_job.SpotJobTrigger"
RUN_TIMEOUT_S = 480.0  # `airflow dags test` takes about 100 s
POLL_S = 1.5
# what the task supervisor raises, or leaves in the log, when task or trigger code opens the ORM
DB_ACCESS_REFUSALS = ("Direct database access", "Database access is disabled", "airflow-db-not-allowed")


@dataclass
class DemoRun:
    """One run of the demo DAG and what was seen of it while it ran."""

    deployment: Deployment
    run_id: str
    state: str
    seconds: float
    samples: list[dict[str, Any]]  # the fine_tune task instance, one REST answer per poll
    live_views: list[dict[str, Any]]  # its report's live view as the page polls it (state, live, slots)
    components: dict[str, dict[str, Any]]  # each component's command line and PATH, read while running

    @property
    def ti_path(self) -> str:
        return f"/dags/{DAG_ID}/dagRuns/{quote(self.run_id, safe='')}/taskInstances/{TASK_ID}"

    def why(self, note: str) -> str:
        """``note``, the run's samples and every component's log tail, for an assertion."""
        seen = [(s.get("state"), s.get("try_number"), (s.get("trigger") or {}).get("created_date")) for s in self.samples]
        return self.deployment.diagnostics(f"{note}\nrun {self.run_id}: {self.state} after {self.seconds:.0f} s; "
                                           f"fine_tune samples (state, try, trigger created): {seen}")


def running_components(deployment: Deployment) -> dict[str, dict[str, Any]]:
    """Each component's command line and the first entry of its PATH, from the process table."""
    seen = {}
    for name, process in deployment.processes.items():
        try:
            info = psutil.Process(process.pid)
            seen[name] = {"cmdline": info.cmdline(), "path_head": info.environ().get("PATH", "").split(os.pathsep)[0]}
        except psutil.Error as error:
            seen[name] = {"error": repr(error)}
    return seen


def run_demo(deployment: Deployment) -> DemoRun:
    """Unpause the demo DAG, trigger it through the REST API and poll it to its end."""
    dag = deployment.api("PATCH", f"/dags/{DAG_ID}", json={"is_paused": False})
    assert dag["is_paused"] is False, dag
    components = running_components(deployment)
    started = time.monotonic()
    run_id = deployment.api("POST", f"/dags/{DAG_ID}/dagRuns", json={"logical_date": None})["dag_run_id"]
    run = DemoRun(deployment, run_id, "queued", 0.0, [], [], components)
    live_path = f"/spotsched/runs/{DAG_ID}/{quote(run_id, safe='')}/{TASK_ID}/live.json"
    while True:
        deployment.assert_running()
        run.state = deployment.api("GET", f"/dags/{DAG_ID}/dagRuns/{quote(run_id, safe='')}")["state"]
        answer = deployment.request("GET", f"/api/v2{run.ti_path}")
        if answer.status_code == 200:
            run.samples.append({"t": time.monotonic() - started, **answer.json()})
            view = deployment.request("GET", live_path, user="viewer")
            if view.status_code == 200:
                run.live_views.append({key: view.json()[key] for key in ("state", "live", "slots", "version")})
        run.seconds = time.monotonic() - started
        if run.state in ("success", "failed") or run.seconds > RUN_TIMEOUT_S:
            return run
        time.sleep(POLL_S)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoRun]:
    home = tmp_path_factory.mktemp("real-deployment")
    with airflow_deployment(home, wait_for_dags=[DAG_ID]) as deployment:
        yield run_demo(deployment)
    left = deployment.leftover_processes()
    assert not left, f"processes of the deployment left after it stopped: {left}"


def test_the_run_succeeds_and_meets_its_deadline_below_on_demand_cost(demo: DemoRun) -> None:
    assert demo.state == "success", demo.why("the demo run did not succeed")
    xcom = demo.deployment.api("GET", f"{demo.ti_path}/xcomEntries/return_value", user="viewer")
    result = xcom["value"] if isinstance(xcom["value"], dict) else json.loads(xcom["value"])
    assert result["deadline_met"] is True, demo.why(f"deadline missed: {result}")
    assert 0 < result["cost"] < result["on_demand_cost"], demo.why(f"cost not below on-demand: {result}")
    assert result["preemptions"] >= 1, demo.why(f"the demo's preemption did not happen: {result}")
    tries = demo.deployment.api("GET", f"{demo.ti_path}/tries", user="viewer")["task_instances"]
    # resuming from a deferral continues the same try: a success on a retry would hide a failure
    assert [(t["try_number"], t["state"]) for t in tries] == [(1, "success")], demo.why(f"tries: {tries}")


def test_the_task_waits_between_slots_in_the_triggerer(demo: DemoRun) -> None:
    """Seen twice over: the task instance's trigger while it runs, and the task's own log."""
    assert demo.state == "success", demo.why("the demo run did not succeed")
    triggerers = demo.deployment.api("GET", "/jobs", params={"job_type": "TriggererJob", "is_alive": "true"})["jobs"]
    assert len(triggerers) == 1, demo.why(f"alive triggerer jobs: {triggerers}")
    triggerer_id = triggerers[0]["id"]
    # SQLite reuses the id of a deleted trigger row: one trigger per deferral is told by its creation
    claimed = {s["trigger"]["created_date"] for s in demo.samples
               if s["state"] == "deferred" and s.get("trigger")
               and s["trigger"]["classpath"] == TRIGGER_CLASSPATH and s["trigger"]["triggerer_id"] == triggerer_id}
    assert len(claimed) >= 2, demo.why(f"fewer than two SpotJobTriggers seen claimed by triggerer job {triggerer_id}")
    assert any(s["state"] == "running" for s in demo.samples), demo.why("the task was never seen running")

    log = demo.deployment.api("GET", f"{demo.ti_path}/logs/1", user="viewer", params={"full_content": "true"})
    events = [entry.get("event", "") if isinstance(entry, dict) else str(entry) for entry in log["content"]]
    deferrals = sum(event.startswith("Pausing task as DEFERRED") for event in events)
    # a wait shorter than [spotsched] min_deferral_seconds (a slow step left the boundary near) is waited in the worker
    in_worker = sum(event.startswith("waiting in the worker: ") for event in events)
    result = demo.deployment.api("GET", f"{demo.ti_path}/xcomEntries/return_value")["value"]
    result = result if isinstance(result, dict) else json.loads(result)
    # every slot decided is followed by a wait; the job ends during the last one, or just before a
    # boundary the wait woke at, and the slots it then ran through unwatched are billed, not decided
    # (the driver logs each as "slot N went by with no step")
    unwatched = sum("went by with no step" in event for event in events)
    assert deferrals >= len(claimed) and deferrals + in_worker >= result["slots"] - unwatched, demo.why(
        f"{deferrals} deferrals, {in_worker} waits in the worker and {unwatched} unwatched slots in the log: {events}")
    # the triggerer writes the trigger's lines into the task's log, in a file of its own
    assert any(event.endswith(f".log.trigger.{triggerer_id}.log") for event in events), demo.why(f"sources: {events}")
    assert "Trigger fired event" in events, demo.why(f"no trigger event in the log: {events}")


def test_task_and_trigger_code_never_open_the_metadata_database(demo: DemoRun) -> None:
    """A worker blocks the ORM; an access the code swallowed would still leave its trace here."""
    assert demo.state == "success", demo.why("the demo run did not succeed")
    for task_id in (TASK_ID, "summary"):
        path = f"/dags/{DAG_ID}/dagRuns/{quote(demo.run_id, safe='')}/taskInstances/{task_id}/logs/1"
        log = demo.deployment.api("GET", path, params={"full_content": "true"})["content"]
        text = json.dumps(log)
        assert not [refusal for refusal in DB_ACCESS_REFUSALS if refusal in text], demo.why(f"{task_id}: {text[-4000:]}")
        errors = [entry for entry in log if isinstance(entry, dict) and entry.get("level") in ("error", "critical")]
        assert not errors, demo.why(f"{task_id} logged errors: {errors}")
    triggerer_log = demo.deployment.logs["triggerer"].read_text(errors="replace")
    assert not [refusal for refusal in DB_ACCESS_REFUSALS if refusal in triggerer_log], demo.why("triggerer")


def test_the_report_link_opens_the_page_for_a_viewer_and_401_without_a_token(demo: DemoRun) -> None:
    assert demo.state == "success", demo.why("the demo run did not succeed")
    links = demo.deployment.api("GET", f"{demo.ti_path}/links", user="viewer")
    path = f"/spotsched/runs/{DAG_ID}/{quote(demo.run_id, safe='')}/{TASK_ID}"
    # computed on the worker when the task finished, on [api] base_url
    assert links["extra_links"].get("Spot run report") == demo.deployment.base_url + path, links
    page = demo.deployment.request("GET", path, user="viewer")
    assert page.status_code == 200, demo.why(f"report page: {page.status_code} {page.text[:500]}")
    assert "text/html" in page.headers["content-type"] and demo.run_id in page.text
    assert "finished, deadline met" in page.text and "<svg" in page.text, demo.why(page.text[:2000])
    anonymous = demo.deployment.request("GET", path, user=None)
    assert anonymous.status_code == 401, f"without a token: {anonymous.status_code} {anonymous.text[:300]}"


def test_the_report_is_live_while_the_task_runs_and_final_after(demo: DemoRun) -> None:
    """The live view the report page polls, as the real operator pushes its log slot by slot."""
    assert demo.state == "success", demo.why("the demo run did not succeed")
    live = [view for view in demo.live_views if view["live"]]
    assert {view["state"] for view in live} >= {"deferred"}, demo.why(f"live views: {demo.live_views}")
    assert len({view["slots"] for view in live}) >= 2 and len({view["version"] for view in live}) >= 2, (
        demo.why(f"the live view did not move between polls: {demo.live_views}"))
    final = demo.deployment.request("GET", f"/spotsched/runs/{DAG_ID}/{quote(demo.run_id, safe='')}/{TASK_ID}/live.json",
                                    user="viewer").json()
    assert final["state"] == "success" and final["live"] is False and "finished, deadline met" in final["html"]


def test_the_components_run_as_make_ui_starts_them(demo: DemoRun) -> None:
    """`airflow <component>` found on PATH with the virtualenv's bin first, as `airflow standalone`
    does under `make ui`: a component that spawns `airflow` gets the one with the provider."""
    assert set(demo.deployment.launched) == set(COMPONENTS)
    for name, launched in demo.deployment.launched.items():
        assert launched["argv"][:2] == ["airflow", name], f"{name}: launched as {launched['argv']}"
        assert launched["PATH"].split(os.pathsep)[0] == str(VENV_BIN), f"{name}: PATH {launched['PATH']}"
    shebang = AIRFLOW.read_text().splitlines()[0].removeprefix("#!").split()[0]
    assert Path(shebang).parent == VENV_BIN, f"{AIRFLOW} runs {shebang}"
    # what the process table shows, where the component has not retitled itself (setproctitle
    # overwrites the memory /proc reads the command line and the environment from)
    readable = {name: seen for name, seen in demo.components.items()
                if "error" not in seen and seen["cmdline"][:1] == [shebang]}
    assert {"scheduler", "dag-processor", "triggerer"} <= set(readable), demo.components
    for name, seen in readable.items():
        # a console script runs as `<its shebang's interpreter> <venv>/bin/airflow <component> ...`
        assert seen["cmdline"][:3] == [shebang, str(AIRFLOW), name], f"{name}: {seen['cmdline']}"
        assert seen["path_head"] == str(VENV_BIN), f"{name}: PATH starts with {seen['path_head']}"
