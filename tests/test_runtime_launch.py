"""runtime.launch: torchrun whose exit code keeps the spot contract (0 done, 75 preempted, else the failure).

The launches run real torchrun agents on loopback (c10d) with two bash workers each (``--no-python``),
a few seconds apiece, most of it importing torch (the last call for a second node is cut to 1 s);
exit 0 is the acceptance test's (tests/test_hf_elastic.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_provider_spotsched.backends.local_processes import free_port
from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_FAILURE, EXIT_PREEMPTED
from airflow_provider_spotsched.runtime.launch import exit_code

ROOT = Path(__file__).resolve().parent.parent


def launch(worker: str, tmp_path: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "airflow_provider_spotsched.runtime.launch", "--nnodes=1:2",
               "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               "--rdzv-conf=last_call_timeout=1",  # one node is all there is: don't wait 30 s for a second
               "--max-restarts=0", "--no-python", "bash", "-c", worker]
    temporary = tmp_path / "tmp"  # the launcher's temporary directory: it must be left empty
    temporary.mkdir(exist_ok=True)
    return subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(temporary)})


def test_worker_codes_map_to_the_contract() -> None:
    assert exit_code([]) == EXIT_DONE
    assert exit_code([EXIT_PREEMPTED, EXIT_PREEMPTED]) == EXIT_PREEMPTED
    assert exit_code([EXIT_PREEMPTED, 3]) == 3  # one real failure is a failure, whatever the others did
    assert exit_code([-signal.SIGKILL]) == EXIT_FAILURE
    # torchrun SIGTERMs the workers still running once one exits: those are not the job's failures
    assert exit_code([EXIT_PREEMPTED, -signal.SIGTERM]) == EXIT_PREEMPTED
    assert exit_code([-signal.SIGKILL, EXIT_PREEMPTED]) == EXIT_FAILURE  # but a first one killed is


@pytest.mark.e2e
@pytest.mark.parametrize(("worker", "expected"), [
    (f"exit {EXIT_PREEMPTED}", EXIT_PREEMPTED),
    ('[ "$RANK" = 1 ] && exit 3; exit 0', 3),
])
def test_the_launcher_exits_as_its_workers_did(tmp_path: Path, worker: str, expected: int) -> None:
    process = launch(worker, tmp_path)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == expected, stderr
    assert not list((tmp_path / "tmp").iterdir())  # torchrun's log folder went with it


@pytest.mark.e2e
def test_a_sigterm_to_the_launcher_reaches_the_workers_and_ends_in_75(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    worker = f'trap "exit {EXIT_PREEMPTED}" TERM; touch {ready}-$RANK; while true; do sleep 0.1; done'
    process = launch(worker, tmp_path)
    deadline = time.monotonic() + 120
    while not all(Path(f"{ready}-{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline and process.poll() is None, "the workers did not start"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == EXIT_PREEMPTED, stderr
    assert not list((tmp_path / "tmp").iterdir())
