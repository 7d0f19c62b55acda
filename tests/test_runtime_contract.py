"""The runtime's contract: progress written whole and read back, "nothing yet" before it, no heavy imports."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timezone

from airflow_provider_spotsched.runtime.contract import (
    PROGRESS_FILE,
    Progress,
    read_finished_at,
    read_progress,
    read_work_done,
    write_progress,
)


def test_progress_round_trips_and_says_when_the_job_finished(tmp_path):
    running = Progress(samples_done=64, samples_total=128, step=4, loss=2.5, world_size=2, status="running",
                       updated="2025-10-14T03:00:00Z")
    write_progress(str(tmp_path), running)
    assert read_progress(str(tmp_path)) == running
    assert read_work_done(str(tmp_path)) == 64.0 and read_finished_at(str(tmp_path)) is None

    write_progress(f"{tmp_path}/", Progress(samples_done=128, status="done", updated="2025-10-14T04:00:00Z"))
    assert read_finished_at(str(tmp_path)) == datetime(2025, 10, 14, 4, tzinfo=timezone.utc)
    assert [p.name for p in tmp_path.iterdir()] == [PROGRESS_FILE]  # no temporary file left behind


def test_a_finish_stamp_without_a_zone_is_utc_and_one_that_is_no_time_is_unknown():
    """A user's command may write its own stamps: the driver compares them with its UTC clock."""
    naive = Progress(samples_done=128, status="done", updated="2025-10-14T04:00:00")
    assert naive.finished_at == datetime(2025, 10, 14, 4, tzinfo=timezone.utc)
    assert Progress(samples_done=128, status="done", updated="yesterday").finished_at is None


def test_a_missing_partial_or_foreign_progress_file_reads_as_nothing_yet(tmp_path):
    assert read_progress(str(tmp_path)) == Progress() and read_work_done(str(tmp_path)) == 0.0
    (tmp_path / PROGRESS_FILE).write_text("{")
    assert read_progress(str(tmp_path)) == Progress()
    (tmp_path / PROGRESS_FILE).write_text("[1, 2]")
    assert read_progress(str(tmp_path)) == Progress()
    (tmp_path / PROGRESS_FILE).write_text('{"samples_done": 7, "written_by": "another command"}')
    assert read_progress(str(tmp_path)) == Progress(samples_done=7)


def test_the_contract_imports_without_torch_transformers_or_airflow():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "peft", "airflow"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
import airflow_provider_spotsched.runtime.contract
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
