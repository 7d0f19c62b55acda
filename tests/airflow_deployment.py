"""A real Airflow deployment for tests: api-server, scheduler, dag-processor and triggerer.

:func:`airflow_deployment` builds a temporary ``AIRFLOW_HOME`` (SQLite, no example DAGs, the
repository's ``dags/`` as DAGs folder, the LocalExecutor, Airflow's SimpleAuthManager with users
and passwords of the test's choosing, a JWT secret, ``[api] base_url`` on a free port of
127.0.0.1), runs ``airflow db migrate``, then starts the four components the way ``make ui``'s
``airflow standalone`` does: each as ``airflow <component>`` found on ``PATH``, with the
virtualenv's bin directory first. It waits until the REST API reports the scheduler, the
triggerer and the DAG processor healthy and every DAG it is asked for parsed, and on exit stops
every process it started (each component in a process group of its own: SIGTERM to the group,
SIGKILL after a grace period), then anything left that carries the deployment's marker in its
environment (the local backend's training supervisor and workers detach into sessions of their
own).

This process never imports Airflow: other test modules in the same pytest worker import it with
a configuration of their own, and Airflow reads its configuration once. The deployment is driven
only through subprocesses and HTTP (httpx against the real API server).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent  # not resolved: the venv's bin, not the base interpreter's
AIRFLOW = VENV_BIN / "airflow"
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
HEALTH_CHECKED = ("scheduler", "triggerer", "dag_processor")
MARKER = "SPOTSCHED_TEST_DEPLOYMENT"  # set to the home in every process of the deployment
SIMPLE_AUTH_MANAGER = "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
DEFAULT_USERS = {"admin": ("admin", "admin"), "viewer": ("viewer", "viewer")}  # name: (role, password)
LOG_TAIL_CHARS = 3000


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The last ``chars`` characters of a log file (empty when there is none)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(handle.tell() - chars, 0))
            return handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


@dataclass
class Deployment:
    """A running deployment: where it lives, how to reach it, its processes and their logs."""

    home: Path
    base_url: str
    env: dict[str, str]
    passwords: dict[str, str]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    launched: dict[str, dict[str, Any]] = field(default_factory=dict)  # per component: argv, PATH
    logs: dict[str, Path] = field(default_factory=dict)
    _tokens: dict[str, str] = field(default_factory=dict)

    # -- diagnostics -------------------------------------------------------------------------

    def diagnostics(self, note: str = "") -> str:
        """``note``, each component's exit status and the tail of its log, for an assertion."""
        parts = [note] if note else []
        for name, log in self.logs.items():
            process = self.processes.get(name)
            status = "not started" if process is None else (
                "running" if process.poll() is None else f"exited {process.returncode}")
            parts.append(f"----- {name} ({status}; {log}) -----\n{tail(log)}")
        return "\n".join(parts)

    def assert_running(self) -> None:
        """Fail, with every log's tail, if a component has exited."""
        dead = {name: p.returncode for name, p in self.processes.items() if p.poll() is not None}
        assert not dead, self.diagnostics(f"components exited: {dead}")

    def leftover_processes(self) -> list[str]:
        """Command lines of whatever of the deployment still runs: processes carrying its marker
        and any process in a component's group (a retitled process hides its environment)."""
        groups = {process.pid for process in self.processes.values()}
        left = {process.pid: process for process in marked_processes(self.home)}
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) in groups:
                    left[process.pid] = process
            except (OSError, psutil.Error):
                continue
        described = []
        for process in left.values():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    described.append(f"{process.pid}: {' '.join(process.cmdline())[:200]}")
            except psutil.Error:
                continue
        return described

    # -- HTTP ----------------------------------------------------------------------------------

    def token(self, username: str = "admin") -> str:
        """A JWT for ``username`` from SimpleAuthManager's ``POST /auth/token`` (cached)."""
        if username not in self._tokens:
            answer = httpx.post(f"{self.base_url}/auth/token",
                                json={"username": username, "password": self.passwords[username]}, timeout=30)
            assert answer.status_code == 201, self.diagnostics(
                f"POST /auth/token for {username!r}: {answer.status_code} {answer.text[:500]}")
            self._tokens[username] = answer.json()["access_token"]
        return self._tokens[username]

    def request(self, method: str, path: str, user: str | None = "admin", **kwargs: Any) -> httpx.Response:
        """``method path`` against the API server, with ``user``'s bearer token (``None``: no token)."""
        headers = dict(kwargs.pop("headers", {}))
        if user is not None:
            headers["Authorization"] = f"Bearer {self.token(user)}"
        return httpx.request(method, f"{self.base_url}{path}", headers=headers, timeout=kwargs.pop("timeout", 60),
                             **kwargs)

    def api(self, method: str, path: str, user: str | None = "admin", expect: int = 200, **kwargs: Any) -> Any:
        """The JSON answer of ``method /api/v2{path}``; fails with the logs unless it is ``expect``."""
        answer = self.request(method, f"/api/v2{path}", user=user, **kwargs)
        assert answer.status_code == expect, self.diagnostics(
            f"{method} /api/v2{path}: {answer.status_code}, wanted {expect}: {answer.text[:1000]}")
        return answer.json()

    # -- start-up ------------------------------------------------------------------------------

    def wait_ready(self, dag_ids: Sequence[str], timeout_s: float) -> dict[str, Any]:
        """Wait until the components report healthy and every DAG of ``dag_ids`` is parsed."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            self.assert_running()
            try:
                health = httpx.get(f"{self.base_url}/api/v2/monitor/health", timeout=10).json()
                unhealthy = [name for name in HEALTH_CHECKED if (health.get(name) or {}).get("status") != "healthy"]
                if unhealthy:
                    last = f"unhealthy: {unhealthy} in {health}"
                else:
                    missing = [dag_id for dag_id in dag_ids
                               if self.request("GET", f"/api/v2/dags/{dag_id}").status_code != 200]
                    if not missing:
                        return health
                    last = f"DAGs not parsed yet: {missing}"
            except (httpx.HTTPError, ValueError) as error:
                last = f"{type(error).__name__}: {error}"
            time.sleep(1.0)
        raise AssertionError(self.diagnostics(f"deployment not ready after {timeout_s:.0f} s: {last}"))


def deployment_env(home: Path, port: int, dags_folder: Path, users: Mapping[str, tuple[str, str]],
                   extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every process of the deployment in ``home``."""
    env = {
        key: value for key, value in os.environ.items()
        if not key.startswith("AIRFLOW") and key not in ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER")
    }
    env.update({
        MARKER: str(home),
        "PATH": os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]),  # as `make ui` does
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(home / "plugins"),
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__AUTH_MANAGER": SIMPLE_AUTH_MANAGER,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{name}:{role}" for name, (role, _) in users.items()),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__API_AUTH__JWT_SECRET": "spotsched-deployment-tests-only-" + "0123456789abcdef" * 4,
        "AIRFLOW__API__SECRET_KEY": "spotsched-deployment-tests-only-api-secret",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__WORKERS": "1",
        # the log servers of the scheduler's executor and of the triggerer, off their fixed ports
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        # the DAG files do not change during a test: parse them once, not every 30 s
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
    })
    env.update(extra or {})
    return env


def _stop(processes: Mapping[str, subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every component's process group, then SIGKILL the groups still there."""
    for process in processes.values():
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes.values():
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    for process in processes.values():  # the group's leader may be gone and its children not
        _signal_group(process.pid, signal.SIGKILL)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            pass


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def marked_processes(home: Path) -> list[psutil.Process]:
    """Every process whose environment names the deployment in ``home`` (this one excepted)."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(MARKER) == str(home):
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def _sweep(home: Path, grace_s: float) -> list[str]:
    """End whatever is left of the deployment; the command lines of what had to be ended."""
    left = marked_processes(home)
    ended = []
    for process in left:
        try:
            ended.append(" ".join(process.cmdline())[:200])
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return ended


@contextmanager
def airflow_deployment(
    home: Path,
    *,
    dags_folder: Path = REPO / "dags",
    users: Mapping[str, tuple[str, str]] = DEFAULT_USERS,
    wait_for_dags: Sequence[str] = (),
    ready_timeout_s: float = 300.0,
    stop_grace_s: float = 30.0,
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[Deployment]:
    """A migrated deployment in ``home`` with its four components running, stopped on exit.

    ``users``: user name to (SimpleAuthManager role, password); the passwords file is written
    before the API server starts, so it prints no generated password. ``wait_for_dags``: DAG ids
    the DAG processor must have parsed before the deployment is handed over.
    """
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = deployment_env(home, port, dags_folder, users, extra_env)
    passwords = {name: password for name, (_, password) in users.items()}
    (home / "passwords.json").write_text(json.dumps(passwords) + "\n")
    logs_dir = home / "component-logs"
    logs_dir.mkdir(exist_ok=True)
    deployment = Deployment(home, env["AIRFLOW__API__BASE_URL"], env, passwords)

    migrate = logs_dir / "db-migrate.log"
    deployment.logs["db-migrate"] = migrate
    with open(migrate, "wb") as log:
        done = subprocess.run([str(AIRFLOW), "db", "migrate"], env=env, cwd=home, stdin=subprocess.DEVNULL,
                              stdout=log, stderr=subprocess.STDOUT, timeout=600)
    assert done.returncode == 0, deployment.diagnostics(f"airflow db migrate exited {done.returncode}")

    airflow_on_path = shutil.which("airflow", path=env["PATH"])
    assert airflow_on_path == str(AIRFLOW), f"`airflow` on the deployment's PATH is {airflow_on_path}, not {AIRFLOW}"
    with ExitStack() as cleanup:
        cleanup.callback(_sweep, home, stop_grace_s)
        cleanup.callback(_stop, deployment.processes, stop_grace_s)
        for component in COMPONENTS:
            log_path = logs_dir / f"{component}.log"
            deployment.logs[component] = log_path
            command = ["airflow", component]
            if component == "api-server":
                command += ["--host", "127.0.0.1", "--port", str(port)]
            deployment.launched[component] = {"argv": command, "PATH": env["PATH"]}
            with open(log_path, "wb") as log:
                # `airflow` as `airflow standalone` starts it: the first one on PATH (the venv's);
                # Popen looks the bare name up on the PATH of ``env``
                deployment.processes[component] = subprocess.Popen(
                    command, env=env, cwd=home, stdin=subprocess.DEVNULL,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deployment.wait_ready(wait_for_dags, ready_timeout_s)
        yield deployment
