"""A throwaway Airflow deployment holding one run whose tasks pushed the sample XComs.

The metadata database is built the supported way, in subprocesses: ``airflow db migrate``, then
``airflow dags test`` on a tiny DAG whose tasks push :mod:`tests.run_log_samples`'s log and
result. :func:`serve_reports` then points this process's Airflow at that database and mounts
the plugin's app on a host app the way the API server does (plugin app under its prefix, the
auth manager initialised), restoring the previous configuration afterwards: other test modules
in the same worker may have imported Airflow with a configuration of their own.
:func:`serve_api` instead starts the real ``airflow api-server`` on the database, in a
subprocess, for tests that need the UI itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from filelock import FileLock

from tests.run_log_samples import sample_decision_log, sample_in_progress_log, sample_result

DAG_ID = "spotsched_report_test"
LOGICAL_DATE = "2025-10-06T00:00:00+00:00"
FINISHED_TASK = "finetune"
IN_PROGRESS_TASK = "finetune_in_progress"
SILENT_TASK = "prepare"  # a task of the run that pushed no decision log
OTHER_TASK = "count_rows"  # a task of another operator that returned a value of its own
IN_PROGRESS_SLOTS = 10
AIRFLOW = Path(sys.executable).with_name("airflow")

DAG_FILE = '''
import json
from pathlib import Path

import pendulum
from airflow.sdk import DAG, BaseOperator, task

from airflow_provider_spotsched.links.report import SpotRunReportLink

DATA = Path({data!r})


class LoggingOperator(BaseOperator):
    """Pushes the sample log and result the way the fine-tuning operator does, with its link."""

    operator_extra_links = (SpotRunReportLink(),)

    def execute(self, context):
        context["ti"].xcom_push(key="decision_log", value=json.loads((DATA / "decision_log.json").read_text()))
        return json.loads((DATA / "result.json").read_text())

with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2025, 1, 1), catchup=False):

    @task(task_id={silent!r})
    def prepare():
        return None

    @task(task_id={other!r})
    def count_rows():
        return {{"rows": 3}}

    @task(task_id={in_progress!r})
    def finetune_in_progress(ti=None):
        ti.xcom_push(key="decision_log", value=json.loads((DATA / "in_progress_log.json").read_text()))

    prepare() >> [LoggingOperator(task_id={finished!r}), finetune_in_progress(), count_rows()]
'''


@dataclass(frozen=True)
class ReportDb:
    """The deployment's files, the environment that selects it and the id of its one run."""

    home: Path
    env: dict[str, str]
    run_id: str


SIMPLE_AUTH_MANAGER = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"


def deployment_env(home: Path, dags: Path) -> dict[str, str]:
    """A throwaway deployment in ``home``: SQLite, no example DAGs, DAGs from ``dags``."""
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
    }


def simple_auth_env(home: Path, purpose: str, users: str = "viewer:viewer",
                    auth_manager: str = SIMPLE_AUTH_MANAGER) -> dict[str, str]:
    """SimpleAuthManager (or a subclass) with ``users``, passwords in ``home``, a JWT secret for ``purpose``."""
    return {
        "AIRFLOW__CORE__AUTH_MANAGER": auth_manager,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": users,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API_AUTH__JWT_SECRET": f"spotsched-{purpose}-only-" + "0123456789abcdef" * 4,
    }


def build_report_db(home: Path) -> ReportDb:
    """Migrate a SQLite metadata database in ``home`` and run the test DAG once into it."""
    data, dags = home / "data", home / "dags"
    data.mkdir(parents=True)
    dags.mkdir()
    (data / "decision_log.json").write_text(json.dumps(sample_decision_log()))
    (data / "result.json").write_text(json.dumps(sample_result()))
    (data / "in_progress_log.json").write_text(json.dumps(sample_in_progress_log(IN_PROGRESS_SLOTS)))
    (dags / f"{DAG_ID}.py").write_text(DAG_FILE.format(
        data=str(data), dag_id=DAG_ID, silent=SILENT_TASK, other=OTHER_TASK, finished=FINISHED_TASK,
        in_progress=IN_PROGRESS_TASK))
    env = {**deployment_env(home, dags), **simple_auth_env(home, "report-tests")}
    for command in (["db", "migrate"], ["dags", "test", DAG_ID, LOGICAL_DATE]):
        done = subprocess.run([str(AIRFLOW), *command], env={**os.environ, **env}, cwd=home,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (
            f"airflow {' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    # `dags test` names the run after the moment it ran; read the name back
    with sqlite3.connect(home / "airflow.db") as connection:
        (run_id,) = connection.execute("SELECT run_id FROM dag_run WHERE dag_id = ?", (DAG_ID,)).fetchone()
    return ReportDb(home, env, run_id)


def shared_report_db(tmp_path_factory: pytest.TempPathFactory) -> ReportDb:
    """The report deployment, built once per test session (:func:`shared_build`)."""
    data = shared_build(tmp_path_factory, "spotsched_report_db", lambda home: asdict(build_report_db(home)))
    return ReportDb(Path(data["home"]), data["env"], data["run_id"])


def shared_build(tmp_path_factory: pytest.TempPathFactory, name: str,
                 build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """What ``build`` returned for a deployment in ``name``, built by the first xdist worker asking.

    A deployment takes tens of seconds to build and the tests only read it, so the tests of a
    session share it even when xdist runs them in different workers.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, common to its workers
    built = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not built.is_file():
            built.write_text(json.dumps(build(root / name), default=str))
        return json.loads(built.read_text())


@contextmanager
def serve_reports(db: ReportDb) -> Iterator[object]:
    """A host FastAPI app with the plugin mounted, on ``db``'s database and auth manager."""
    from airflow import settings
    from airflow.api_fastapi import app as api_app
    from fastapi import FastAPI

    from airflow_provider_spotsched.plugins.report import SpotschedPlugin

    patch = pytest.MonkeyPatch()
    previous_auth_manager = api_app._AuthManagerState.instance
    for name, value in db.env.items():
        patch.setenv(name, value)
    settings.configure_vars()
    settings.reconfigure_orm()
    try:
        host = FastAPI()
        for plugin_app in SpotschedPlugin.fastapi_apps:
            host.mount(plugin_app["url_prefix"], plugin_app["app"])
        api_app._AuthManagerState.instance = None
        api_app.init_auth_manager(host)
        yield host
    finally:
        api_app._AuthManagerState.instance = previous_auth_manager
        patch.undo()
        settings.configure_vars()
        settings.reconfigure_orm()


def token(role: str | None, username: str = "viewer") -> str:
    """A JWT the deployment's auth manager accepts, for a user of ``role`` (``None``: no role)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=username, role=role))


@contextmanager
def serve_over_http(host: object) -> Iterator[str]:
    """``host`` (an ASGI app) behind uvicorn on a free local port; yields its base URL."""
    import uvicorn

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(host, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                pytest.fail("uvicorn stopped before it started serving")
            thread.join(0.05)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()


API_START_SECONDS = 180


@dataclass(frozen=True)
class ServedApi:
    """A real ``airflow api-server`` on ``url``, and a viewer's token it accepts."""

    url: str
    token: str

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {self.token}"}, timeout=60)


@contextmanager
def serve_api(home: Path, env: dict[str, str], user: str = "viewer") -> Iterator[ServedApi]:
    """Airflow's API server (UI, REST API, plugins) on the deployment ``env`` selects, on a free
    local port, stopped after; ``user``'s password is in the SimpleAuthManager's passwords file."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **env, "PATH": f"{AIRFLOW.parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "AIRFLOW__API__BASE_URL": url}
    log_path = home / f"api-server-{port}.log"
    with log_path.open("w") as log:
        server = subprocess.Popen([str(AIRFLOW), "api-server", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + API_START_SECONDS
        while not _answers(url + "/api/v2/monitor/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"airflow api-server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        password = json.loads(Path(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]).read_text())[user]
        reply = httpx.post(url + "/auth/token", json={"username": user, "password": password}, timeout=60)
        assert reply.status_code in (200, 201), reply.text
        yield ServedApi(url, reply.json()["access_token"])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
