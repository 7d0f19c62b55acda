"""The package: provider entry point, shipped data, and an Airflow-free core."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points, metadata
from pathlib import Path

import airflow_provider_spotsched as pkg

CORE_MODULES = [
    f"airflow_provider_spotsched.{name}"
    for name in (
        "forecast.auto",
        "forecast.backtest",
        "market.source",
        "market.aws",
        "market.gcp",
        "market.history",
        "market.availability",
        "scheduling.online",
        "scheduling.selector_store",
        "simulation.run_report",
        "backends.local",
        "backends.ec2",
        "backends.gce",
        "runtime.train",
        "runtime.checkpoint",
        "runtime.preemption",
        "config",
        "hooks.local_connection",
        "assets",
    )
]


def test_provider_entry_point_returns_the_distribution_name():
    (entry,) = [e for e in entry_points(group="apache_airflow_provider") if e.value.startswith("airflow_provider_spotsched")]
    info = entry.load()()
    assert info["package-name"] == "airflow-provider-spotsched"
    assert info["versions"] == [pkg.__version__]


def test_traces_ship_with_their_licence_and_notice():
    for name in ("LICENSE-traces.txt", "NOTICE-traces.txt", pkg.AWS_TRACE.name, pkg.GCP_TRACE.name):
        assert (pkg.TRACES_DIR / name).is_file()


def test_the_distribution_carries_the_projects_licence_and_notice():
    # NOTICE holds the Apache-2.0 attribution of the ported SkyNomad policies: a wheel must carry it
    files = set(metadata("airflow-provider-spotsched").get_all("License-File") or [])
    assert {"LICENSE", "NOTICE"} <= files


def test_core_imports_and_runs_without_airflow():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "airflow" or name.startswith("airflow."):
            raise ImportError("airflow is blocked in this test")
sys.meta_path.insert(0, Block())
from airflow_provider_spotsched import GCP_TRACE
from airflow_provider_spotsched.market.trace import load_trace
from airflow_provider_spotsched.scheduling.replay import job_market, simulate
from airflow_provider_spotsched.scheduling.policies import POLICIES, make_policy
from airflow_provider_spotsched.scheduling.model import Job
import airflow_provider_spotsched.cli
import importlib
for target in POLICIES.values():
    importlib.import_module(target.split(":")[0])
for module in CORE_MODULES:
    importlib.import_module(module)
job = Job.from_dict({"work": 8, "deadline_hours": 10, "max_instances": 2, "throughput": {"alpha": 1}, "value": 100})
print(simulate(make_policy("on-demand"), job, job_market(load_trace(GCP_TRACE), job)).outcome.cost)
"""
    code = code.replace("CORE_MODULES", repr(CORE_MODULES))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 0


def _dotted(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_class_and_module_the_provider_lists_imports():
    info = pkg.get_provider_info()
    modules = [m for kind in ("operators", "sensors", "hooks", "triggers") for entry in info[kind] for m in entry["python-modules"]]
    for module in modules:
        importlib.import_module(module)
    for connection in info["connection-types"]:
        hook = _dotted(connection["hook-class-name"])
        assert hook.conn_type == connection["connection-type"]
    for link in info["extra-links"]:
        assert _dotted(link)().name


def test_airflow_lists_the_provider_and_its_connection_type(tmp_path: Path):
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    airflow = str(Path(sys.executable).with_name("airflow"))
    listed = subprocess.run(
        [airflow, "providers", "get", "airflow-provider-spotsched", "-o", "json"], env=env, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr
    (provider,) = json.loads(listed.stdout)
    assert provider == {"Provider": "airflow-provider-spotsched", "Version": pkg.__version__}
    hooks = subprocess.run([airflow, "providers", "hooks", "-o", "json"], env=env, capture_output=True, text=True)
    assert hooks.returncode == 0, hooks.stderr
    assert any(h["connection_type"] == "spotsched_local" for h in json.loads(hooks.stdout))
