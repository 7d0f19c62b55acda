"""Regenerate docs/images/ from the runs of ``make demo`` (``make screenshots`` runs both).

Starts the real ``airflow api-server`` on the demo's AIRFLOW_HOME (a SimpleAuthManager viewer
of its own, so the demo's login is untouched), signs headless Chromium in with the UI's
``_token`` cookie and captures:

- ``run-report.png``: the latest demo run's report page, whole;
- ``run-report-tab.png``: the same report as the task instance's tab in the Airflow UI;
- ``fleet.png``: the fleet dashboard over every demo run.

Each capture is checked not blank (more than a few colours, not one flat page) before it is
written. Usage: ``python scripts/screenshots.py [--home .airflow] [--out docs/images]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sqlite3
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.headless_chromium import BrowserPage, find_chromium  # noqa: E402
from tests.report_airflow import serve_api  # noqa: E402

DAG_ID, TASK_ID = "spot_finetune_demo", "fine_tune"
WIDTH = 1400
IN_FRAME = "(() => { const f = document.querySelector('iframe'); const d = f && f.contentDocument; " \
           "return d && d.readyState === 'complete' && d.getElementById('report') " \
           "&& d.body.innerText.includes('finished') ? 1 : 0; })()"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=REPO / ".airflow", help="the demo's AIRFLOW_HOME")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    args = parser.parse_args()
    chromium = find_chromium()
    if chromium is None:
        sys.exit("Chromium is not installed: run scripts/ensure-chromium")
    run_id = latest_run(args.home)
    with tempfile.TemporaryDirectory() as scratch:
        env = viewer_env(args.home, Path(scratch))
        with serve_api(args.home, env) as api, BrowserPage(chromium, Path(scratch) / "chromium", width=WIDTH) as page:
            cookie = {"_token": api.token}
            run = quote(run_id, safe="")
            page.open(f"{api.url}/spotsched/runs/{DAG_ID}/{run}/{TASK_ID}", cookies=cookie)
            save(page.capture().png, args.out / "run-report.png")
            page.open(f"{api.url}/dags/{DAG_ID}/runs/{run}/tasks/{TASK_ID}/plugin/spot-run-report", cookies=cookie)
            page.wait_until(IN_FRAME, timeout=120, what="the report in its tab")
            save(page.capture_viewport(900), args.out / "run-report-tab.png")
            page.open(f"{api.url}/spotsched/fleet", cookies=cookie)
            save(page.capture().png, args.out / "fleet.png")


def latest_run(home: Path) -> str:
    """The demo DAG's newest successful run in the demo's metadata database."""
    with sqlite3.connect(home / "airflow.db") as connection:
        row = connection.execute("SELECT run_id FROM dag_run WHERE dag_id = ? AND state = 'success' "
                                 "ORDER BY start_date DESC LIMIT 1", (DAG_ID,)).fetchone()
    if row is None:
        sys.exit(f"no finished run of {DAG_ID} in {home}: run `make demo` first")
    return str(row[0])


def viewer_env(home: Path, scratch: Path) -> dict[str, str]:
    """The demo's deployment, with a SimpleAuthManager viewer whose password file is ``scratch``'s."""
    passwords = scratch / "passwords.json"
    passwords.write_text(json.dumps({"viewer": "viewer-" + os.urandom(8).hex()}))
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "viewer:viewer",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        "AIRFLOW__API_AUTH__JWT_SECRET": os.urandom(32).hex(),
    }


def save(png: bytes, path: Path) -> None:
    """Write ``png`` after checking it shows something: many colours, no single colour covering it."""
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    if len(colours) < 16 or counts.max() > 0.995 * len(pixels):
        sys.exit(f"{path.name}: the capture is blank ({len(colours)} colours); not written")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)
    print(f"{path}: {Image.open(io.BytesIO(png)).size[0]}x{Image.open(io.BytesIO(png)).size[1]}, {len(colours)} colours")


if __name__ == "__main__":
    main()
