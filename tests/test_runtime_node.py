"""The backends' launch of the default runtime: elastic torchrun per instance (``runtime.node``).

Unit tests check the torchrun arguments a backend's rendezvous turns into. The end-to-end tests
start two "instances" on loopback as the local backend does (``RANK``/``WORLD_SIZE``/``MASTER_*``,
a ``file://`` notice each) and take one away mid-job:

- with a notice: it saves the job's emergency checkpoint and leaves (75), and the other instance
  goes on alone from that checkpoint: no work lost;
- with SIGKILL of the whole instance: the other's worker fails on the lost peer, torchrun restarts
  it, and it resumes alone from the newest periodic checkpoint.

Either way the job ends done on the uninterrupted single-process run's loss curve (the Trainer's
``log_history``, carried through every resume) to ``LOSS_ATOL``: the global batch and the sample
order do not depend on the world size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_spotsched.backends.local_processes import free_port
from airflow_provider_spotsched.runtime.contract import EXIT_DONE, EXIT_PREEMPTED, EXIT_USAGE, runtime_command
from airflow_provider_spotsched.runtime.hf_checkpoints import checkpoints, verify
from airflow_provider_spotsched.runtime.hf_mirror import stored_step
from airflow_provider_spotsched.runtime.node import BACKEND_RENDEZVOUS, NodeError, torchrun_arguments, worker_environment
from tests.runtime_support import kill_tree

ROOT = Path(__file__).resolve().parent.parent
STEPS = 36
CONFIG = {"steps": STEPS, "batch_size": 4, "seq_len": 32, "log_every_steps": 1, "seed": 3,
          "checkpoint": {"keep": 3, "min_interval_s": 1.0, "max_interval_s": 1.0},
          "fault_injection": {"step_sleep_s": 0.4}}
LOSS_ATOL = 1e-4
TIMEOUT_S = 300
LAST_CALL_S = "10"  # the survivor waits this long for the lost instance before going on alone


def test_one_instance_meets_on_loopback_alone() -> None:
    arguments = torchrun_arguments({"RANK": "0", "WORLD_SIZE": "1"}, nproc_per_node=1)
    assert arguments[:2] == ["--standalone", "--nnodes=1"]
    assert "--nproc-per-node=1" in arguments and "--max-restarts=3" in arguments


def test_several_instances_meet_through_c10d_at_the_first_one() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500",
           "SPOTSCHED_JOB_ID": "job-1", "SPOTSCHED_GENERATION": "5", "SPOTSCHED_MAX_RESTARTS": "2"}
    arguments = torchrun_arguments(env, nproc_per_node=8)
    assert arguments == ["--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.7:29500",
                         "--rdzv-id=job-1-5", "--rdzv-conf=is_host=false", "--nproc-per-node=8",
                         "--max-restarts=2", "--monitor-interval=1"]
    first = torchrun_arguments({**env, "RANK": "0", "SPOTSCHED_RDZV_LAST_CALL_S": "7"}, nproc_per_node=8)
    assert "--rdzv-conf=is_host=true,last_call_timeout=7" in first


@pytest.mark.parametrize("env, named", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "$MASTER_ADDR and $MASTER_PORT"),
    ({"WORLD_SIZE": "two"}, "$WORLD_SIZE='two'"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "$RANK=2 is not below"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "0"}, "$MASTER_PORT must be >= 1"),
])
def test_a_bad_rendezvous_names_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(NodeError, match=named.replace("$", r"\$")):
        torchrun_arguments(env, nproc_per_node=1)


def test_workers_get_torchruns_rendezvous_and_leave_the_notice_to_the_launcher() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "1",
           "SPOTSCHED_NOTICE": "aws", "KEEP": "me"}
    worker_environment(env)
    assert env == {"SPOTSCHED_NOTICE": "none", "KEEP": "me"}


def test_the_default_runtime_is_launched_through_the_node_launcher() -> None:
    assert runtime_command("/ck", "python3")[:5] == ("python3", "-m", "airflow_provider_spotsched.runtime.node",
                                                     "-m", "airflow_provider_spotsched.runtime")
    assert runtime_command("/ck", "python3", "loop")[:3] == ("python3", "-m", "airflow_provider_spotsched.runtime")


def test_a_bad_rendezvous_exits_2_before_torchrun_starts(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "RANK": "0"}
    env.pop("MASTER_ADDR", None)
    done = subprocess.run([sys.executable, "-m", "airflow_provider_spotsched.runtime.node", "train.py"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_USAGE and "MASTER_ADDR" in done.stderr, done.stderr


class Instance:
    """One "instance" of a job: the node launcher with the local backend's rendezvous environment."""

    def __init__(self, uri: Path, rank: int, world: int, port: int, notice: Path | None,
                 store: str | None = None, staging: Path | None = None) -> None:
        """``store``: an fsspec URL for the checkpoints instead of ``uri`` (staged in ``staging``)."""
        config = uri.parent / "config.json"
        config.write_text(json.dumps(CONFIG))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPOTSCHED_THREADS": "1",
               "SPOTSCHED_STAGING_DIR": str(staging or uri.parent / "staging"),
               "RANK": str(rank), "WORLD_SIZE": str(world), "SPOTSCHED_JOB_ID": "node-test",
               "SPOTSCHED_GENERATION": "1", "SPOTSCHED_RDZV_LAST_CALL_S": LAST_CALL_S,
               "SPOTSCHED_NOTICE": f"file://{notice}" if notice else "none"}
        if world > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if world == 0:  # the reference: a plain process, as if no backend had launched it
            for name in BACKEND_RENDEZVOUS:
                env.pop(name, None)
        command = ([sys.executable, "-m", "airflow_provider_spotsched.runtime"] if world == 0 else
                   [sys.executable, "-m", "airflow_provider_spotsched.runtime.node", "-m",
                    "airflow_provider_spotsched.runtime"])
        self.log = uri.parent / f"instance-{rank}-{world}-{staging.name if staging else 'staging'}.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([*command, "--config", str(config), "--checkpoint-uri", store or str(uri)],
                                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def wait(self) -> int:
        return self.process.wait(TIMEOUT_S)

    def kill(self) -> None:
        """The instance vanishes: its launcher and every worker."""
        kill_tree(self.process.pid, TIMEOUT_S)

    def output(self) -> str:
        return self.log.read_text()

    def events(self, kind: str) -> list[dict[str, Any]]:
        found = []
        for line in self.output().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict) and event.get("event") == kind:
                found.append(event)
        return found


def loss_curve(uri: Path) -> dict[int, float]:
    """Each step's loss in the final checkpoint's ``log_history``: the job's curve through every resume."""
    (final, *_) = newest_first(uri)
    history = json.loads((final / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run: one plain process, no torchrun."""
    uri = tmp_path_factory.mktemp("reference") / "job"
    uri.parent.mkdir(exist_ok=True)
    alone = Instance(uri, rank=0, world=0, port=0, notice=None)
    assert alone.wait() == EXIT_DONE, alone.output()
    return loss_curve(uri)


@pytest.fixture
def two_instances(tmp_path: Path) -> Iterator[tuple[Path, list[Instance], list[Path]]]:
    """Two instances of one job on loopback; whatever is left of them is killed at the end."""
    uri = tmp_path / "job"
    port = free_port()
    notices = [tmp_path / f"notice-{rank}" for rank in range(2)]
    instances = [Instance(uri, rank, 2, port, notices[rank]) for rank in range(2)]
    yield uri, instances, notices
    for instance in instances:
        if instance.process.poll() is None:
            instance.kill()


def newest_first(uri: Path) -> list[Path]:
    """The checkpoint directories under ``uri`` (``checkpoint-N``, or a store's ``checkpoint-N.<upload id>``), newest
    step first."""
    folder = uri / "checkpoints"
    found = [entry for entry in folder.iterdir() if stored_step(entry.name) is not None] if folder.is_dir() else []
    return sorted(found, key=lambda entry: stored_step(entry.name) or 0, reverse=True)


def wait_for_checkpoint(uri: Path, world_size: int, min_step: int) -> dict[str, Any]:
    """The first complete checkpoint saved at ``world_size`` from ``min_step`` on (the job is running there)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for directory in newest_first(uri):
            try:
                manifest = verify(directory)
            except Exception:
                continue
            if manifest["world_size"] == world_size and manifest["step"] >= min_step:
                return manifest
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at world size {world_size} from step {min_step}")


def assert_on_the_reference_curve(uri: Path, reference: dict[int, float]) -> None:
    got = loss_curve(uri)
    assert sorted(got) == list(range(1, STEPS + 1)) == sorted(reference)
    worst = max(abs(got[step] - reference[step]) for step in reference)
    assert worst <= LOSS_ATOL, (worst, got, reference)


@pytest.mark.e2e
def test_a_notice_takes_one_instance_out_and_the_other_goes_on_alone(
        two_instances: tuple[Path, list[Instance], list[Path]], reference: dict[int, float]) -> None:
    uri, instances, notices = two_instances
    wait_for_checkpoint(uri, world_size=2, min_step=4)
    notices[1].touch()
    assert instances[1].wait() == EXIT_PREEMPTED, instances[1].output()
    emergency = verify(checkpoints(uri / "checkpoints")[0])  # the survivor waits LAST_CALL_S before going on
    assert emergency["kind"] == "emergency" and emergency["world_size"] == 2, emergency
    assert instances[0].wait() == EXIT_DONE, instances[0].output()
    resumed = [event["step"] for event in instances[0].events("resumed") if event["step"]]
    assert resumed == [emergency["step"]], resumed  # work lost per notice: 0 steps
    final = verify(checkpoints(uri / "checkpoints")[0])
    assert final["world_size"] == 1 and final["step"] == STEPS
    assert "stopping this instance's workers" in instances[1].output()
    assert_on_the_reference_curve(uri, reference)


@pytest.mark.e2e
def test_a_killed_instance_leaves_the_other_to_resume_alone(
        two_instances: tuple[Path, list[Instance], list[Path]], reference: dict[int, float]) -> None:
    uri, instances, _ = two_instances
    last = wait_for_checkpoint(uri, world_size=2, min_step=6)
    instances[1].kill()
    instances[1].wait()
    assert instances[0].wait() == EXIT_DONE, instances[0].output()
    resumed = [event["step"] for event in instances[0].events("resumed") if event["step"]]
    assert resumed and resumed[-1] >= last["step"], (resumed, last)
    assert verify(checkpoints(uri / "checkpoints")[0])["world_size"] == 1
    assert_on_the_reference_curve(uri, reference)


@pytest.mark.e2e
def test_an_object_store_job_resumes_on_another_machine_from_the_store(
        tmp_path: Path, reference: dict[int, float]) -> None:
    """Checkpoints under an fsspec URL (``local://`` here, the same calls as ``s3://``/``gs://``): a notice
    stops the first instance; a second one with an empty staging disk (another machine) resumes from the
    store, past a newer checkpoint in the store that is corrupt, and ends on the reference curve."""
    uri = tmp_path / "store"
    store = f"local://{uri}"
    notice = tmp_path / "notice"
    first = Instance(uri, 0, 1, 0, notice, store=store, staging=tmp_path / "machine-a")
    try:
        wait_for_checkpoint(uri, world_size=1, min_step=4)
        notice.touch()
        assert first.wait() == EXIT_PREEMPTED, first.output()
    finally:
        if first.process.poll() is None:
            first.kill()
    newest = newest_first(uri)[0]
    emergency = verify(newest)
    assert emergency["kind"] == "emergency"
    broken = uri / "checkpoints" / f"checkpoint-{STEPS + 100}"
    shutil.copytree(newest, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"truncated")

    notice.unlink()
    second = Instance(uri, 0, 1, 0, notice, store=store, staging=tmp_path / "machine-b")
    assert second.wait() == EXIT_DONE, second.output()
    (resumed,) = [event for event in second.events("resumed")]
    assert resumed["step"] == emergency["step"] and resumed["skipped"][0].startswith(broken.name), resumed
    assert not broken.exists(), "the corrupt checkpoint is removed from the store"
    assert (uri / "final" / "adapter_model.safetensors").is_file()
    assert_on_the_reference_curve(uri, reference)
