"""The package: provider entry point, shipped data, and an Airflow-free core."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import airflow_provider_spotsched as pkg


def test_provider_entry_point_returns_the_distribution_name():
    (entry,) = [e for e in entry_points(group="apache_airflow_provider") if e.value.startswith("airflow_provider_spotsched")]
    info = entry.load()()
    assert info["package-name"] == "airflow-provider-spotsched"
    assert info["versions"] == [pkg.__version__]


def test_traces_ship_with_their_licence_and_notice():
    for name in ("LICENSE-traces.txt", "NOTICE-traces.txt", pkg.AWS_TRACE.name, pkg.GCP_TRACE.name):
        assert (pkg.TRACES_DIR / name).is_file()


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
from airflow_provider_spotsched.simulation.simulator import job_market, simulate
from airflow_provider_spotsched.scheduling.policies import POLICIES, make_policy
from airflow_provider_spotsched.scheduling.model import Job
import airflow_provider_spotsched.cli
import importlib
for target in POLICIES.values():
    importlib.import_module(target.split(":")[0])
job = Job.from_dict({"work": 8, "deadline_hours": 10, "max_instances": 2, "throughput": {"alpha": 1}, "value": 100})
print(simulate(make_policy("on-demand"), job, job_market(load_trace(GCP_TRACE), job)).outcome.cost)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 0
