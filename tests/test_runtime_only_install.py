"""The runtime runs on a node without Airflow, statsmodels or matplotlib, on the ``runtime`` extra alone.

The ``runtime`` extra (scripts/runtime_requirements.py, what the Dockerfile installs) is resolved
over this environment; a fresh interpreter then blocks every top-level module that install would
not have (benchmarks/runtime_install.py's blocker: Airflow, statsmodels and matplotlib among them,
and the optional extras libraries import when present) and runs the runtime's entry point on a
tiny job to its end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.runtime_support import TINY_JOB

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = load(ROOT / "benchmarks" / "runtime_install.py")
RUN = """
import json, sys
from airflow_provider_spotsched.runtime.__main__ import main
code = main(["--config", sys.argv[1], "--checkpoint-uri", sys.argv[2]])
print(json.dumps({"exit": code, "airflow": "airflow" in sys.modules, "statsmodels": "statsmodels" in sys.modules}))
"""
INSTALL = BENCH.runtime_install()


def test_the_runtime_extra_names_no_airflow_statsmodels_or_matplotlib():
    names = [r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in BENCH.runtime_requirements()]
    assert names and not [n for n in names if n.startswith("apache-airflow") or n in ("statsmodels", "matplotlib")]
    assert not [n for n in BENCH.closure(BENCH.runtime_requirements()) if n.startswith("apache-airflow")]


def test_the_runtime_trains_to_the_end_with_airflow_statsmodels_and_matplotlib_blocked(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_JOB, "samples": 32}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPOTSCHED_NOTICE": "none", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", BENCH.blocker(INSTALL) + RUN, str(config), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0 and '"exit": 0' in done.stdout, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"exit": 0, "airflow": False, "statsmodels": False} and (tmp_path / "ckpt" / "final").is_dir()


def test_the_blocker_blocks_airflow_statsmodels_and_matplotlib():
    assert not {"airflow", "statsmodels", "matplotlib", "pulp"} & BENCH.top_levels(INSTALL.values())
    for module in ("airflow.sdk", "statsmodels", "matplotlib.pyplot"):
        done = subprocess.run([sys.executable, "-c", BENCH.blocker(INSTALL) + f"import {module}"], capture_output=True, text=True)
        assert done.returncode != 0 and f"No module named '{module.split('.')[0]}'" in done.stderr
