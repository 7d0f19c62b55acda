"""A failed instance's uploaded log and result reach the task: the EC2 backend against moto (or a
recording backend), the real driver.

The instance's start-up script (tests/test_backend_bootstrap_secrets_logs.py runs it) uploads its
log to ``checkpoint_uri/logs/<instance>/train.log`` and tags ``spotsched:result=failed-N``; here
moto holds the instance and its tag, fsspec's ``memory://`` stands in for the object store
holding that log (an EC2 backend refuses a checkpoint URI on the worker's own disk), and the driver
must fail the run with the log's tail, read through the environment's ``locate`` (the connection's
credentials on Airflow), not ambient fsspec.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec import AbstractFileSystem

from airflow_provider_spotsched import AWS_TRACE
from airflow_provider_spotsched.backends.base import InstanceState
from airflow_provider_spotsched.execution.driver import Finished, RunDriver, TrainingFailedError
from airflow_provider_spotsched.execution.environment import SpotEnvironment
from airflow_provider_spotsched.execution.wake import Wait
from airflow_provider_spotsched.market.feed import ReplayedMarket
from airflow_provider_spotsched.market.shipped import cached_trace
from airflow_provider_spotsched.runtime.contract import LOG_FILE, RESULT_FILE, log_uri
from airflow_provider_spotsched.scheduling.model import Allocation, Job, Throughput
from airflow_provider_spotsched.scheduling.online import RunConfig
from tests.moto_server import moto_endpoint  # noqa: F401 (a fixture)
from tests.test_backend_ec2 import client, ec2, make_backend  # noqa: F401 (fixtures)
from tests.test_driver import RecordingBackend

POOLS = ("us-east-1a", "us-east-1c")
LOG = "".join(f"step {i} loss {3.0 - i / 100:.2f}\n" for i in range(400)) + "RuntimeError: CUDA error: out of memory\n"


@pytest.fixture
def store_uri(tmp_path: Path) -> Iterator[str]:
    """A checkpoint URI in an object store the EC2 instances could reach (``memory://``), emptied after the test."""
    uri = f"memory://spotsched-tail/{tmp_path.name}"
    yield uri
    memory = fsspec.filesystem("memory")
    if memory.exists(uri):
        memory.rm(uri, recursive=True)


def test_a_failed_ec2_instance_fails_the_run_with_the_tail_of_its_uploaded_log(client, ec2, tmp_path, store_uri, caplog):
    opened: list[str] = []

    def locate(uri: str) -> tuple[AbstractFileSystem, str]:
        opened.append(uri)
        return fsspec.core.url_to_fs(uri)

    backend = make_backend(client, pools={p: p for p in POOLS}, on_demand="us-east-1d")
    env = SpotEnvironment(backend=backend, market=ReplayedMarket(cached_trace(AWS_TRACE), 1.0, 48), locate=locate)
    job = Job(work=1000, deadline_hours=6.0, max_instances=1, throughput=Throughput(600.0, 0.0), value=100.0)
    config = RunConfig(f"tail-{tmp_path.name[-20:]}", job, POOLS, policy="uniform-progress", forecaster="persistence")
    saved: list[dict[str, Any]] = []
    driver = RunDriver.start(env, config, lambda uri: ["spotsched-train", "--checkpoint-uri", uri], store_uri, saved.append)

    status = backend.reconcile(driver.training, Allocation((1, 0), 0))
    (instance,) = status.instances
    ec2.create_tags(Resources=[instance.instance_id], Tags=[{"Key": "spotsched:result", "Value": "failed-1"}])
    uploaded = log_uri(store_uri, instance.instance_id)
    with fsspec.open(uploaded, "w") as handle:  # what the start-up script's upload leaves
        handle.write(LOG)

    with pytest.raises(TrainingFailedError) as failure:
        driver.step()

    message = str(failure.value)
    assert f"{instance.instance_id} (us-east-1a)" in message and "result=failed-1" in message
    assert message.endswith("RuntimeError: CUDA error: out of memory\n")
    assert "step 399 loss -0.99" in message and "step 0 loss" not in message  # the tail, from a whole line
    assert uploaded in opened  # read through the environment's locate
    assert "CUDA error: out of memory" in caplog.text  # and in the task log
    assert backend.status(driver.training).instances[0].state.value == "failed"


def test_without_an_uploaded_log_the_failure_keeps_the_instance_detail_alone(client, ec2, tmp_path, store_uri):
    backend = make_backend(client, pools={p: p for p in POOLS}, on_demand="us-east-1d")
    env = SpotEnvironment(backend=backend, market=ReplayedMarket(cached_trace(AWS_TRACE), 1.0, 48))
    job = Job(work=1000, deadline_hours=6.0, max_instances=1, throughput=Throughput(600.0, 0.0), value=100.0)
    config = RunConfig(f"nolog-{tmp_path.name[-20:]}", job, POOLS, policy="uniform-progress", forecaster="persistence")
    driver = RunDriver.start(env, config, lambda uri: ["spotsched-train"], store_uri, lambda state: None)
    (instance,) = backend.reconcile(driver.training, Allocation((1, 0), 0)).instances
    ec2.create_tags(Resources=[instance.instance_id], Tags=[{"Key": "spotsched:result", "Value": "failed-78"}])

    with pytest.raises(TrainingFailedError, match=r"result=failed-78$"):
        driver.step()


UNLABELLED = "TERMINATED without a result: preempted (its operation is not listed yet)"  # GCE's reading


def untagged_driver(tmp_path: Path, opened: list[str]) -> tuple[RunDriver, RecordingBackend]:
    """A run whose instances all ended without a result tag or label, once its first step launched them."""

    def locate(uri: str) -> tuple[AbstractFileSystem, str]:
        opened.append(uri)
        return fsspec.core.url_to_fs(uri)

    backend = RecordingBackend()
    env = SpotEnvironment(backend=backend, market=ReplayedMarket(cached_trace(AWS_TRACE), 1.0, 48), locate=locate)
    job = Job(work=1000, deadline_hours=6.0, max_instances=1, throughput=Throughput(600.0, 0.0), value=100.0)
    config = RunConfig("untagged", job, POOLS, policy="uniform-progress", forecaster="persistence")
    driver = RunDriver.start(env, config, lambda uri: ["spotsched-train"], str(tmp_path / "ckpt"), lambda state: None)
    driver.step()
    assert backend.instances, "the first step launches an instance"
    return driver, backend


def store(driver: RunDriver, instance_id: str, name: str, text: str) -> str:
    """Leave a file where the start-up script uploads it beside the log; return its URI."""
    uri = log_uri(driver.training.checkpoint_uri, instance_id, name)
    Path(uri).parent.mkdir(parents=True, exist_ok=True)
    Path(uri).write_text(text)
    return uri


def test_a_spot_instance_that_could_not_label_its_failure_fails_the_run_from_the_result_beside_its_log(tmp_path):
    """GCE reads a spot VM powered off without its label as preempted: without the stored result the
    failing command would be relaunched slot after slot until the deadline."""
    opened: list[str] = []
    driver, backend = untagged_driver(tmp_path, opened)
    (launched,) = backend.instances
    instance = replace(launched, pool=POOLS[0], state=InstanceState.PREEMPTED, detail=UNLABELLED, inferred=True)  # a spot VM
    backend.instances = [instance]
    store(driver, instance.instance_id, LOG_FILE, LOG)
    result = store(driver, instance.instance_id, RESULT_FILE, "failed-1\n")

    with pytest.raises(TrainingFailedError) as failure:
        driver.step()

    message = str(failure.value)
    assert f"{instance.instance_id} ({instance.pool}): {UNLABELLED}, result=failed-1 stored beside its log" in message
    assert "compute.instances.setLabels" in message and "ec2:CreateTags" in message
    assert message.endswith("RuntimeError: CUDA error: out of memory\n")
    assert result in opened  # through the environment's locate
    assert len(backend.targets) == 1, "nothing relaunched"


def test_an_ec2_instance_that_could_not_tag_its_success_finishes_the_run(tmp_path):
    """EC2 reads an instance that shut itself down without its tag as failed, a success included."""
    driver, backend = untagged_driver(tmp_path, [])
    (instance,) = backend.instances
    detail = "terminated, Client.InstanceInitiatedShutdown, no spotsched:result tag: give the instance profile ec2:CreateTags"
    backend.instances = [replace(instance, state=InstanceState.FAILED, detail=detail)]
    store(driver, instance.instance_id, RESULT_FILE, "done\n")

    assert isinstance(driver.step(), Finished)
    assert driver.run.completion_hours is not None


def test_a_preemption_with_no_stored_result_stays_a_preemption_and_its_store_is_read_once(tmp_path):
    opened: list[str] = []
    driver, backend = untagged_driver(tmp_path, opened)
    (launched,) = backend.instances
    instance = replace(launched, pool=POOLS[0], state=InstanceState.PREEMPTED, detail=UNLABELLED, inferred=True)  # a spot VM
    backend.instances = [instance]
    result = log_uri(driver.training.checkpoint_uri, instance.instance_id, RESULT_FILE)

    wait = driver.step()
    assert isinstance(wait, Wait) and wait.known_preemptions == 1 and wait.known_failures == 0
    rebuilt = RunDriver.from_state(driver.env, driver.to_state(), lambda state: None)
    rebuilt.step()

    assert opened.count(result) == 1, "looked up once, the answer kept in the run's state"
    assert rebuilt.stored_results == {instance.instance_id: ""}


def test_an_out_of_memory_kill_on_a_spot_vm_that_could_not_label_it_fails_the_run(tmp_path):
    # the kernel killed the command (137) on a spot VM that may not label itself; GCE reads it as
    # preempted, with no preemption operation (inferred); the script asked the metadata before it
    # stored the code, so it is no shutdown's signal: relaunched, it would be killed again
    driver, backend = untagged_driver(tmp_path, [])
    (launched,) = backend.instances
    instance = replace(launched, pool=POOLS[0], state=InstanceState.PREEMPTED, detail=UNLABELLED, inferred=True)
    backend.instances = [instance]
    store(driver, instance.instance_id, RESULT_FILE, "failed-137\n")

    with pytest.raises(TrainingFailedError, match="result=failed-137 stored beside its log"):
        driver.step()


def step_after_a_reported_preemption(tmp_path, stored: str):
    """The driver's step once the cloud has reported the instance preempted and its script had stored ``stored``."""
    driver, backend = untagged_driver(tmp_path, [])
    (launched,) = backend.instances
    instance = replace(launched, pool=POOLS[0], state=InstanceState.PREEMPTED, detail="preempted at 2026-01-12T03:00:00Z")
    backend.instances = [instance]
    store(driver, instance.instance_id, RESULT_FILE, stored)
    return driver.step()


def test_a_preemption_the_cloud_reported_stays_one_whatever_code_its_command_stored(tmp_path):
    # a custom torchrun command exits 1 on the preemption's SIGTERM and the script stores failed-1
    # before its own stop; GCE lists the preemption's operation: the job resumes elsewhere
    wait = step_after_a_reported_preemption(tmp_path, "failed-1\n")
    assert isinstance(wait, Wait) and wait.known_preemptions == 1 and wait.known_failures == 0


def test_a_preemption_the_cloud_reported_still_finishes_the_run_when_its_command_stored_done(tmp_path):
    # the work is done: a preemption during the exit does not undo it
    assert isinstance(step_after_a_reported_preemption(tmp_path, "done\n"), Finished)


def test_a_tagged_failure_is_reported_as_the_backend_reads_it_without_reading_the_store(tmp_path):
    opened: list[str] = []
    driver, backend = untagged_driver(tmp_path, opened)
    (instance,) = backend.instances
    tagged = replace(instance, state=InstanceState.FAILED, detail="terminated, result=failed-2", tagged_result="failed-2")
    backend.instances = [tagged]
    result = store(driver, instance.instance_id, RESULT_FILE, "failed-2\n")

    with pytest.raises(TrainingFailedError, match=r"\): terminated, result=failed-2$"):
        driver.step()
    assert result not in opened


def test_a_detail_that_happens_to_say_result_does_not_stand_for_a_tag(tmp_path):
    # the detail is free text (a local worker's stderr, a state reason): only the backend's
    # tagged_result says the instance tagged itself, so the result stored beside the log still decides
    opened: list[str] = []
    driver, backend = untagged_driver(tmp_path, opened)
    (instance,) = backend.instances
    detail = "exit code 1: ValueError: bad config line 'result=loss'"
    backend.instances = [replace(instance, state=InstanceState.FAILED, detail=detail)]
    result = store(driver, instance.instance_id, RESULT_FILE, "done\n")

    assert isinstance(driver.step(), Finished)
    assert result in opened
