"""The Compute Engine backend against a fake REST endpoint on loopback serving recorded responses.

A real ``compute_v1.InstancesClient`` (REST transport, anonymous credentials) talks HTTP to a small
server that keeps instances in memory, answers with the Compute Engine JSON of ``tests/data/gce``
and records every request, so the insert bodies checked here are what the API would receive.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from airflow_provider_spotsched.backends.base import (
    ON_DEMAND,
    BackendError,
    InstanceState,
    InsufficientCapacityError,
    TrainingJob,
)
from airflow_provider_spotsched.backends.gce import GceBackend, job_label, name_prefix
from airflow_provider_spotsched.market.launch import LaunchOutcome
from airflow_provider_spotsched.scheduling.model import Allocation, JobError

DATA = Path(__file__).parent / "data" / "gce"
PROJECT = "spotsched-test"
POOLS = ("us-central1-a", "us-central1-b")
BASE = f"/compute/v1/projects/{PROJECT}/zones/"
CREATED = datetime(2025, 10, 14, 3, 12, tzinfo=timezone(timedelta(hours=-7)))
"""When the fake's first VM is created; each request after it adds a second (the launch order)."""
JOB = TrainingJob(
    job_id="dag.Train__run-1",
    command=("spotsched-train", "--config", "gs://bucket/job/config.json", "--checkpoint-uri", "gs://bucket/job/ckpt"),
    checkpoint_uri="gs://bucket/job/ckpt",
    pools=POOLS,
)


def recorded(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


class FakeComputeEngine:
    """Instances per zone behind the REST paths of ``instances`` and ``zoneOperations``.

    Lists come in pages of one (the client must follow ``nextPageToken``); ``exhausted`` zones
    answer inserts with the recorded ZONE_RESOURCE_POOL_EXHAUSTED operation. An insert of a name
    in ``racing`` creates the VM (as an earlier, concurrent try of it would) but answers an
    operation whose error is RESOURCE_ALREADY_EXISTS, with the HTTP status 409 where ``racing``
    maps the name to True. An insert of a name in ``refused`` answers that HTTP error. With
    ``slow_inserts`` an insert answers a RUNNING operation and the VM appears (can be listed) only
    once the operation is polled, as a VM still being created is not listed yet; the operations in
    ``stalled`` never finish. With ``slow_updates`` a delete or setMetadata answers a RUNNING
    operation that is done once polled.
    """

    def __init__(self) -> None:
        self.instances: dict[tuple[str, str], dict[str, Any]] = {}
        self.operations: dict[str, list[dict[str, Any]]] = {}
        self.exhausted: set[str] = set()
        self.failing_deletes: set[str] = set()  # names whose next delete operation ends in an error
        self.racing: dict[str, bool] = {}
        self.refused: dict[str, tuple[int, dict[str, Any]]] = {}
        self.slow_inserts = False
        self.stalled: set[str] = set()  # insert operations (by name) that stay RUNNING however often polled
        self.creating: dict[str, tuple[tuple[str, str], dict[str, Any], dict[str, Any]]] = {}  # operation -> VM
        self.slow_updates = False
        self.updating: dict[str, dict[str, Any]] = {}  # name -> the done operation of a slow delete or setMetadata
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        self.lock = threading.Lock()
        self.addresses = iter(range(2, 250))
        self.pages_followed = 0

    def inserts(self) -> list[dict[str, Any]]:
        return [body for method, path, body in self.requests if method == "POST" and path.endswith("/instances")]

    def calls(self, method: str, suffix: str = "") -> list[str]:
        return [path for m, path, _ in self.requests if m == method and path.endswith(suffix)]

    def preempt(self, zone: str, name: str) -> None:
        """What GCE does to a spot VM with termination action DELETE: delete it, log an operation."""
        del self.instances[(zone, name)]
        operation = recorded("operation_preempted.json")
        operation["targetLink"] = f"https://www.googleapis.com/compute/v1{BASE}{zone}/instances/{name}"
        self.operations.setdefault(zone, []).append(operation)

    def handle(self, method: str, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        parsed = urlparse(url)
        query = parse_qs(parsed.query)
        with self.lock:
            self.requests.append((method, parsed.path, body))
            rest = parsed.path.removeprefix(BASE).split("/")
            zone, kind, target = rest[0], rest[1], rest[2:]
            if kind == "operations" and target and target[0] in self.stalled:  # polled: still being created
                return 200, {**self.creating[target[0]][2], "status": "RUNNING", "progress": 0}
            if kind == "operations" and target and target[0] in self.creating:  # polled: the VM now exists
                key, instance, operation = self.creating.pop(target[0])
                self.instances[key] = instance
                return 200, operation
            if kind == "operations" and target and target[0] in self.updating:
                return 200, self.updating.pop(target[0])
            if kind == "operations":
                wanted = re.search(r'operationType = "([^"]+)"', query.get("filter", [""])[0])
                operations = self.operations.get(zone, [])
                items = [o for o in operations if not wanted or o["operationType"] == wanted.group(1)]
                return 200, {"kind": "compute#operationList", "items": items}
            if method == "GET":
                return 200, self.list(zone, query)
            if method == "POST" and not target:
                return self.insert(zone, body)
            if method == "DELETE":
                if target[0] in self.failing_deletes and (zone, target[0]) in self.instances:
                    self.failing_deletes.discard(target[0])
                    failed = self.operation(zone, target[0], "delete")
                    failed.update(error={"errors": [{"code": "INTERNAL_ERROR", "message": "Internal error."}]},
                                  httpErrorStatusCode=500, httpErrorMessage="INTERNAL SERVER ERROR")
                    return 200, failed  # the VM stays, and bills
                if self.instances.pop((zone, target[0]), None) is None:
                    return 404, recorded("error_not_found.json")
                return 200, self.update(self.operation(zone, target[0], "delete"))
            if method == "POST" and target[1:] == ["setMetadata"]:
                instance = self.instances[(zone, target[0])]
                if body.get("fingerprint") != instance["metadata"]["fingerprint"]:
                    return 412, {"error": {"code": 412, "message": "Supplied fingerprint does not match the metadata."}}
                instance["metadata"] = {**body, "fingerprint": f"fp-{len(self.requests)}", "kind": "compute#metadata"}
                return 200, self.update(self.operation(zone, target[0], "setMetadata"))
        return 400, {"error": {"code": 400, "message": f"unexpected {method} {url}"}}

    def list(self, zone: str, query: dict[str, list[str]]) -> dict[str, Any]:
        wanted = re.fullmatch(r'labels\.([\w-]+) = "([^"]*)"', query.get("filter", [""])[0])
        items = [
            i for (z, _), i in sorted(self.instances.items())
            if z == zone and (not wanted or i.get("labels", {}).get(wanted.group(1)) == wanted.group(2))
        ]
        start = int(query.get("pageToken", ["0"])[0])
        self.pages_followed += start > 0
        page: dict[str, Any] = {"kind": "compute#instanceList", "items": items[start : start + 1]}
        if start + 1 < len(items):
            page["nextPageToken"] = str(start + 1)
        return page

    def insert(self, zone: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        name = body["name"]
        if (zone, name) in self.instances:
            error = recorded("error_already_exists.json")
            error["error"]["message"] = error["error"]["message"].replace("instance-template", name)
            return 409, error
        if zone in self.exhausted:
            return 200, recorded("operation_zone_exhausted.json")
        if name in self.refused:
            return self.refused[name]
        instance = recorded("instance.json")
        instance.update(copy.deepcopy(body))
        instance["status"] = "PROVISIONING"
        del instance["lastStartTimestamp"]  # a new VM has not started yet
        created = CREATED + timedelta(seconds=len(self.requests))
        instance["creationTimestamp"] = created.isoformat(timespec="milliseconds")
        instance["networkInterfaces"][0]["networkIP"] = f"10.128.0.{next(self.addresses)}"
        instance["metadata"] = {**body.get("metadata", {}), "fingerprint": "fp-0", "kind": "compute#metadata"}
        instance["selfLink"] = instance["selfLink"].replace("instance-template", name).replace("us-central1-a", zone)
        operation = self.operation(zone, name, "insert")
        if self.slow_inserts:
            operation["name"] = f"operation-insert-{name}"
            self.creating[operation["name"]] = ((zone, name), instance, operation)
            return 200, {**operation, "status": "RUNNING", "progress": 0}
        self.instances[(zone, name)] = instance
        if name in self.racing:
            message = f"The resource '{instance['selfLink'].split('/v1/')[-1]}' already exists"
            operation["error"] = {"errors": [{"code": "RESOURCE_ALREADY_EXISTS", "message": message}]}
            if self.racing[name]:
                operation.update(httpErrorStatusCode=409, httpErrorMessage="CONFLICT")
        return 200, operation

    def update(self, operation: dict[str, Any]) -> dict[str, Any]:
        """``operation`` as answered: done, or with ``slow_updates`` running until it is polled."""
        if not self.slow_updates:
            return operation
        name = f"operation-{operation['operationType']}-{len(self.requests)}"
        self.updating[name] = {**operation, "name": name}
        return {**operation, "name": name, "status": "RUNNING", "progress": 0}

    @staticmethod
    def operation(zone: str, name: str, kind: str) -> dict[str, Any]:
        operation = recorded("operation_done.json")
        operation["operationType"] = kind
        link = operation["targetLink"].replace("instance-template", name)
        operation["targetLink"] = link.replace("us-central1-a", zone)
        return operation


@pytest.fixture
def gce() -> Iterator[FakeComputeEngine]:
    fake = FakeComputeEngine()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            status, payload = fake.handle(self.command, self.path, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args: Any) -> None:  # keep the test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fake.endpoint = f"http://127.0.0.1:{server.server_port}"  # type: ignore[attr-defined]
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def make_backend(gce: FakeComputeEngine, **overrides: Any) -> GceBackend:
    options = ClientOptions(api_endpoint=gce.endpoint)  # type: ignore[attr-defined]
    params: dict[str, Any] = {
        "project": PROJECT,
        "zones": {"us-central1-a": "us-central1-a", "us-central1-b": "us-central1-b"},
        "on_demand_zone": "us-central1-c",
        "machine_type": "g2-standard-8",
        "image": "projects/deeplearning-platform-release/global/images/family/common-cu124",
        "accelerators": {"nvidia-l4": 1},
        "service_account": "trainer@spotsched-test.iam.gserviceaccount.com",
        "zone_operations_client": compute_v1.ZoneOperationsClient(
            transport="rest", client_options=options, credentials=AnonymousCredentials()
        ),
        "clock": lambda: CREATED + timedelta(minutes=1),  # the fake's VMs stay PROVISIONING: a minute old
    }
    client = compute_v1.InstancesClient(transport="rest", client_options=options, credentials=AnonymousCredentials())
    return GceBackend(client, **(params | overrides))


def metadata_of(instance: dict[str, Any]) -> dict[str, str]:
    return {item["key"]: item["value"] for item in instance["metadata"].get("items", [])}


def test_job_label_and_name_prefix_are_safe_for_compute_engine():
    assert job_label("simple-job_1") == "simple-job_1"
    label = job_label(JOB.job_id)
    assert re.fullmatch(r"[a-z0-9_-]{1,63}", label) and label.startswith("dag-train__run-1-")
    assert job_label("Job") != job_label("job")  # case differences do not merge two jobs
    assert len(job_label("x" * 200)) == 63
    prefix = name_prefix("A.very.long_job.id" * 5)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", prefix) and len(prefix) <= 40


def test_insert_bodies_ask_for_spot_with_delete_labels_and_a_startup_script(gce):
    status = make_backend(gce).reconcile(JOB, Allocation((2, 1), 1))

    assert status.active(POOLS) == Allocation((2, 1), 1)
    bodies = {body["name"]: body for body in gce.inserts()}
    assert len(bodies) == 4
    for name, body in bodies.items():
        assert name.startswith(name_prefix(JOB.job_id) + "-g1-")
        assert body["labels"]["spotsched-job-id"] == job_label(JOB.job_id)
        assert body["guestAccelerators"][0]["acceleratorCount"] == 1
        assert body["serviceAccounts"][0]["email"] == "trainer@spotsched-test.iam.gserviceaccount.com"
        assert body["disks"][0]["autoDelete"] is True
        script = metadata_of(body)["startup-script"]
        assert "export SPOTSCHED_NOTICE=gcp" in script and "attributes/spotsched-$1" in script
        assert "COMMAND=(spotsched-train --config gs://bucket/job/config.json" in script
        assert not re.search(r"private_key|BEGIN .*PRIVATE|client_secret|access_token|password", script, re.I)
        if body["labels"]["spotsched-pool"] == "od":
            assert body["scheduling"]["provisioningModel"] == "STANDARD"
            assert body["scheduling"]["onHostMaintenance"] == "TERMINATE"  # GPUs cannot live-migrate
            assert "instanceTerminationAction" not in body["scheduling"]
            assert body["machineType"] == "zones/us-central1-c/machineTypes/g2-standard-8"
        else:
            assert body["scheduling"]["provisioningModel"] == "SPOT"
            assert body["scheduling"]["instanceTerminationAction"] == "DELETE"
            assert body["labels"]["spotsched-capacity"] == "spot"
    zones = sorted(zone for zone, _ in gce.instances)
    assert zones == ["us-central1-a", "us-central1-a", "us-central1-b", "us-central1-c"]
    assert gce.pages_followed > 0  # the two VMs of us-central1-a came on two pages


def test_the_rendezvous_is_published_in_metadata_and_the_same_reconcile_twice_does_nothing(gce):
    backend = make_backend(gce)
    backend.reconcile(JOB, Allocation((2, 0), 1))
    instances = sorted(gce.instances.values(), key=lambda i: (i["creationTimestamp"], i["name"]))
    attributes = [metadata_of(i) for i in instances]
    assert [a["spotsched-rank"] for a in attributes] == ["0", "1", "2"]
    assert {a["spotsched-world-size"] for a in attributes} == {"3"}
    assert {a["spotsched-master-addr"] for a in attributes} == {instances[0]["networkInterfaces"][0]["networkIP"]}
    assert all("startup-script" in a for a in attributes)  # set_metadata kept the script

    requests = len(gce.requests)
    backend.reconcile(JOB, Allocation((2, 0), 1))
    changes = [r for r in gce.requests[requests:] if r[0] != "GET"]
    assert changes == []


def test_a_retried_insert_that_finds_its_instance_counts_it_as_launched(gce):
    backend = make_backend(gce)
    name = f"{name_prefix(JOB.job_id)}-g1-p0-0"
    gce.instances[("us-central1-a", name)] = {
        **recorded("instance.json"),
        "name": name,
        "labels": {"spotsched-job-id": "someone-else"},  # invisible to the job's list, like a lagging list
    }
    outcomes: list[LaunchOutcome] = []
    backend.recorder = outcomes.append
    backend.reconcile(JOB, Allocation((1, 0), 0))
    assert outcomes[0].launched == 1 and outcomes[0].reason == ""
    assert len([k for k in gce.instances if k[1] == name]) == 1


@pytest.mark.parametrize("http_status", [True, False], ids=["409", "no-http-status"])
def test_an_insert_whose_operation_says_already_exists_counts_as_launched(gce, http_status):
    name = f"{name_prefix(JOB.job_id)}-g1-p0-0"
    gce.racing[name] = http_status
    outcomes: list[LaunchOutcome] = []
    status = make_backend(gce, recorder=outcomes.append).reconcile(JOB, Allocation((1, 0), 0))
    assert [(o.launched, o.reason) for o in outcomes] == [(1, "")]
    assert [i.instance_id for i in status.instances] == [name] and status.active(POOLS) == Allocation((1, 0), 0)
    assert [n for _, n in gce.instances] == [name]


def test_an_insert_refused_for_good_raises_only_after_the_accepted_ones_exist_so_release_ends_them(gce):
    # the first insert is accepted (its VM not listed until the operation is done), the second is
    # refused for a reason that is not capacity: the error must wait for the first VM, which a
    # release that follows the failed launch then finds and deletes
    gce.slow_inserts = True
    refused = f"{name_prefix(JOB.job_id)}-g1-p0-1"
    gce.refused[refused] = (403, {"error": {"code": 403, "message": "Required 'compute.instances.create' permission"}})
    backend = make_backend(gce)
    with pytest.raises(BackendError, match=rf"creating instance {refused} failed: .*compute.instances.create"):
        backend.reconcile(JOB, Allocation((2, 0), 0))
    assert [n for _, n in gce.instances] == [f"{name_prefix(JOB.job_id)}-g1-p0-0"] and not gce.creating
    backend.release(JOB)
    assert gce.instances == {}


def test_every_operation_is_awaited_at_the_endpoint_of_the_client_options(gce):
    # an InstancesClient awaits its operations through a zone-operations client of its own, built for
    # the default endpoint whatever its client options say; a private endpoint (VPC Service Controls,
    # Private Google Access) must be where every insert, setMetadata and delete is awaited
    gce.slow_inserts = gce.slow_updates = True
    backend = make_backend(gce)
    backend.reconcile(JOB, Allocation((2, 0), 0))
    backend.release(JOB)
    polled = [path.rsplit("/", 1)[-1].split("-")[1] for path in gce.calls("GET") if "/operations/" in path]
    assert sorted(polled) == ["delete", "delete", "insert", "insert", "setMetadata", "setMetadata"]  # all at the fake
    assert gce.instances == {} and not gce.creating and not gce.updating


def test_an_insert_not_done_in_time_is_a_clear_error_after_the_others_are_awaited(gce, monkeypatch):
    from airflow_provider_spotsched.backends import gce as gce_module

    monkeypatch.setattr(gce_module, "_OPERATION_TIMEOUT_S", 0.5)
    gce.slow_inserts = True
    stalled = f"{name_prefix(JOB.job_id)}-g1-p0-0"
    gce.stalled.add(f"operation-insert-{stalled}")
    backend = make_backend(gce)
    with pytest.raises(BackendError, match=rf"creating instance {stalled}: not done after 0.5 s, it may still start"):
        backend.reconcile(JOB, Allocation((2, 0), 0))
    assert [n for _, n in gce.instances] == [f"{name_prefix(JOB.job_id)}-g1-p0-1"]  # the other was awaited


def test_scale_down_deletes_the_newest_of_the_shrunk_pool(gce):
    backend = make_backend(gce)
    backend.reconcile(JOB, Allocation((3, 0), 0))
    oldest = min(gce.instances.values(), key=lambda i: (i["creationTimestamp"], i["name"]))["name"]
    status = backend.reconcile(JOB, Allocation((1, 1), 0))

    deleted = {path.rsplit("/", 1)[-1] for path in gce.calls("DELETE")}
    assert len(deleted) == 2 and oldest not in deleted
    assert status.active(POOLS) == Allocation((1, 1), 0)
    assert status.count(InstanceState.RELEASED) == 2
    assert {metadata_of(i)["spotsched-world-size"] for i in gce.instances.values()} == {"2"}
    assert metadata_of(gce.instances[("us-central1-a", oldest)])["spotsched-rank"] == "0"


def test_a_vm_whose_delete_failed_stays_live_and_the_next_release_deletes_it(gce):
    backend = make_backend(gce)
    backend.reconcile(JOB, Allocation((2, 0), 0))
    newest = max(gce.instances.values(), key=lambda i: (i["creationTimestamp"], i["name"]))["name"]
    gce.failing_deletes.add(newest)
    with pytest.raises(BackendError, match=rf"deleting 1 instance\(s\) failed, they may still run and bill: {newest}"):
        backend.reconcile(JOB, Allocation((1, 0), 0))
    states = {i.instance_id: i.state for i in backend.status(JOB).instances}
    assert states[newest] is not InstanceState.RELEASED  # still billed: not reported as released

    backend.release(JOB)  # what the driver does after a failed step
    assert [i for i in gce.instances.values() if i["labels"]["spotsched-job-id"] == job_label(JOB.job_id)] == []
    assert sum(path.endswith(newest) for path in gce.calls("DELETE")) == 2


def test_a_preempted_spot_vm_is_reported_from_its_operation_even_to_a_new_backend(gce):
    make_backend(gce).reconcile(JOB, Allocation((2, 0), 0))
    victim = sorted(name for zone, name in gce.instances)[0]
    gce.preempt("us-central1-a", victim)

    restarted = make_backend(gce)  # the caller restarted: only the operation log remembers
    status = restarted.status(JOB)
    taken = [i for i in status.instances if i.instance_id == victim]
    assert taken[0].state is InstanceState.PREEMPTED and taken[0].pool == "us-central1-a"
    assert "preempted at" in taken[0].detail
    after = restarted.reconcile(JOB, Allocation((2, 0), 0))
    assert after.active(POOLS) == Allocation((2, 0), 0) and after.preemptions == 1
    assert len(gce.inserts()) == 3 and gce.inserts()[-1]["name"] != victim


def test_a_spot_vm_stopping_before_its_preemption_operation_is_listed_is_preempted_once(gce):
    backend = make_backend(gce)
    backend.reconcile(JOB, Allocation((2, 0), 0))
    victim = sorted(name for zone, name in gce.instances)[0]
    gce.instances[("us-central1-a", victim)]["status"] = "STOPPING"  # GCE is taking it back: no operation yet

    status = backend.reconcile(JOB, Allocation((2, 0), 0))
    taken = [i for i in status.instances if i.instance_id == victim]
    assert taken[0].state is InstanceState.PREEMPTED and "not listed yet" in taken[0].detail and taken[0].inferred
    assert not status.failed and status.preemptions == 1
    assert status.active(POOLS) == Allocation((2, 0), 0) and len(gce.inserts()) == 3  # replaced

    gce.preempt("us-central1-a", victim)  # the VM deleted itself and its operation shows
    after = backend.status(JOB)
    assert [(i.state, i.inferred) for i in after.instances if i.instance_id == victim] == [(InstanceState.PREEMPTED, False)]
    assert after.preemptions == 1 and not after.failed


def test_a_preempted_spot_vm_that_labelled_a_failure_is_a_preemption_but_one_without_its_operation_failed(gce):
    # a custom torchrun command exits 1 on the preemption's SIGTERM and the script labels failed-1;
    # a VM without a preemption operation labelled its own failure
    backend = make_backend(gce)
    backend.reconcile(JOB, Allocation((2, 0), 0))
    victim, failing = sorted(name for zone, name in gce.instances)
    for name in (victim, failing):
        vm = gce.instances[("us-central1-a", name)]
        vm.update(status="STOPPING", labels={**vm["labels"], "spotsched-result": "failed-1"})
    stopping = gce.instances[("us-central1-a", victim)]
    gce.preempt("us-central1-a", victim)
    gce.instances[("us-central1-a", victim)] = stopping  # still listed while its operation shows

    status = backend.status(JOB)
    states = {i.instance_id: (i.state, i.inferred) for i in status.instances}
    assert states == {victim: (InstanceState.PREEMPTED, False), failing: (InstanceState.FAILED, False)}
    taken = [i for i in status.instances if i.instance_id == victim][0]
    assert "preempted at" in taken.detail and "result=failed-1" in taken.detail
    assert {i.tagged_result for i in status.instances} == {"failed-1"}  # the driver trusts this field, not the detail's text
    assert status.preemptions == 1


def test_a_spot_vm_terminated_without_a_result_is_preempted_and_release_still_deletes_it(gce):
    make_backend(gce).reconcile(JOB, Allocation((2, 0), 1))
    spot = sorted(name for zone, name in gce.instances if zone == "us-central1-a")
    standard = next(name for zone, name in gce.instances if zone == "us-central1-c")
    gce.instances[("us-central1-a", spot[0])]["status"] = "TERMINATED"
    gce.instances[("us-central1-a", spot[1])].update(status="TERMINATED", labels={
        **gce.instances[("us-central1-a", spot[1])]["labels"], "spotsched-result": "failed-1"})
    gce.instances[("us-central1-c", standard)]["status"] = "STOPPING"

    restarted = make_backend(gce)  # nothing in memory: the state comes from the listing alone
    states = {i.instance_id: i.state for i in restarted.status(JOB).instances}
    assert states == {
        spot[0]: InstanceState.PREEMPTED,  # ended by GCE, not by the runtime nor by us
        spot[1]: InstanceState.FAILED,  # the runtime labelled its failure
        standard: InstanceState.FAILED,  # a standard VM is not preempted: stopped outside spotsched
    }
    restarted.release(JOB)
    assert gce.instances == {}


def test_a_new_backend_reattaches_and_release_deletes_every_labelled_vm(gce):
    make_backend(gce).reconcile(JOB, Allocation((1, 1), 1))
    other = TrainingJob("other-job", JOB.command, JOB.checkpoint_uri, POOLS)
    make_backend(gce).reconcile(other, Allocation((1, 0), 0))
    inserts = len(gce.inserts())

    retried = make_backend(gce)
    status = retried.reconcile(JOB, Allocation((1, 1), 1))
    assert len(gce.inserts()) == inserts and status.active(POOLS) == Allocation((1, 1), 1)

    make_backend(gce).release(JOB)  # after a crash: a fresh backend, only the label
    left = [i["labels"]["spotsched-job-id"] for i in gce.instances.values()]
    assert left == ["other-job"]
    again = make_backend(gce)
    again.release(JOB)
    again.release(TrainingJob("never-launched", JOB.command, JOB.checkpoint_uri, POOLS))
    assert again.status(JOB).instances == ()


def test_an_exhausted_zone_is_recorded_and_the_rest_is_launched(gce):
    gce.exhausted.add("us-central1-a")
    outcomes: list[LaunchOutcome] = []
    status = make_backend(gce, recorder=outcomes.append).reconcile(JOB, Allocation((2, 1), 1))
    assert status.active(POOLS) == Allocation((0, 1), 1)
    recorded_outcomes = {o.pool: (o.requested, o.launched, o.reason) for o in outcomes}
    assert recorded_outcomes == {
        "us-central1-a": (2, 0, "ZONE_RESOURCE_POOL_EXHAUSTED"),
        "us-central1-b": (1, 1, ""),
        ON_DEMAND: (1, 1, ""),
    }

    gce.exhausted.add("us-central1-b")
    with pytest.raises(InsufficientCapacityError, match="ZONE_RESOURCE_POOL_EXHAUSTED"):
        make_backend(gce).reconcile(TrainingJob("stuck", JOB.command, JOB.checkpoint_uri, POOLS), Allocation((1, 1), 0))


def test_a_vm_stuck_provisioning_past_pending_timeout_s_is_deleted_and_its_zone_reported_short(gce):
    now = [CREATED + timedelta(minutes=1)]
    outcomes: list[LaunchOutcome] = []
    backend = make_backend(gce, recorder=outcomes.append, clock=lambda: now[0])
    backend.reconcile(JOB, Allocation((1, 1), 0))
    (zone_a, stuck), (zone_b, started) = sorted(gce.instances)
    gce.instances[(zone_b, started)]["status"] = "RUNNING"  # zone a accepted its insert, has no host for it

    now[0] += timedelta(minutes=14)  # within the default 15 minutes: a slow start, left alone
    assert backend.reconcile(JOB, Allocation((1, 1), 0)).active(POOLS) == Allocation((1, 1), 0)
    assert gce.calls("DELETE") == []

    now[0] += timedelta(minutes=2)
    outcomes.clear()
    status = backend.reconcile(JOB, Allocation((1, 1), 0))
    assert gce.calls("DELETE") == [f"{BASE}{zone_a}/instances/{stuck}"] and (zone_a, stuck) not in gce.instances
    states = {i.instance_id: i.state for i in status.instances}
    assert states == {stuck: InstanceState.RELEASED, started: InstanceState.RUNNING}
    assert status.active(POOLS) == Allocation((0, 1), 0)  # what the driver applies and bills
    assert [(o.pool, o.requested, o.launched, o.reason) for o in outcomes] == [("us-central1-a", 1, 0, "PendingTimeout")]
    assert len(gce.inserts()) == 2  # the zone that left it waiting is not asked again in the same call
    assert metadata_of(gce.instances[(zone_b, started)])["spotsched-world-size"] == "1"
    assert make_backend(gce).status(JOB).preemptions == 0  # no work ran on it: nothing lost

    status = backend.reconcile(JOB, Allocation((1, 1), 0))  # the next slot may ask the zone again: once
    assert len(gce.inserts()) == 3 and status.active(POOLS) == Allocation((1, 1), 0)


def test_a_standard_vm_restarting_after_it_ran_is_not_taken_for_one_stuck_pending(gce):
    # automatic_restart after a host-maintenance stop: a VM created hours ago is STAGING again
    now = [CREATED + timedelta(minutes=1)]
    backend = make_backend(gce, clock=lambda: now[0])
    backend.reconcile(JOB, Allocation((0, 0), 1))
    ((zone, name),) = gce.instances
    gce.instances[(zone, name)].update(status="RUNNING", lastStartTimestamp=now[0].isoformat())
    now[0] += timedelta(hours=3)
    gce.instances[(zone, name)]["status"] = "STAGING"
    status = backend.reconcile(JOB, Allocation((0, 0), 1))
    assert gce.calls("DELETE") == [] and status.active(POOLS) == Allocation((0, 0), 1)


def test_a_lone_vm_stuck_provisioning_is_deleted_and_the_launch_reported_as_no_capacity(gce):
    now = [CREATED + timedelta(minutes=1)]
    job = TrainingJob("stuck-alone", JOB.command, JOB.checkpoint_uri, POOLS)
    backend = make_backend(gce, clock=lambda: now[0], pending_timeout_s=300)
    backend.reconcile(job, Allocation((1, 0), 0))
    now[0] += timedelta(minutes=6)
    with pytest.raises(InsufficientCapacityError, match=r"us-central1-a.*asked for 1.*got 0.*PendingTimeout"):
        backend.reconcile(job, Allocation((1, 0), 0))
    assert gce.instances == {} and len(gce.inserts()) == 1
    assert backend.status(job).active(POOLS) == Allocation((0, 0), 0)


def test_a_result_label_finishes_the_job_and_stops_relaunching(gce):
    backend = make_backend(gce)
    backend.reconcile(JOB, Allocation((1, 0), 0))
    instance = next(iter(gce.instances.values()))
    instance["labels"]["spotsched-result"] = "done"
    instance["status"] = "TERMINATED"  # the VM labelled itself and powered off
    status = backend.reconcile(JOB, Allocation((1, 0), 0))
    assert status.finished and len(gce.inserts()) == 1


def test_bad_configuration_is_a_clear_error(gce):
    with pytest.raises(BackendError, match=r"pools \['us-central1-b'\] have no zone"):
        make_backend(gce, zones={"us-central1-a": "us-central1-a"}).reconcile(JOB, Allocation((1, 1), 0))
    with pytest.raises(ValueError, match="disk_size_gb"):
        make_backend(gce, disk_size_gb=1)
    for timeout in (30, "900", True, float("inf")):
        with pytest.raises(ValueError, match=r"pending_timeout_s must be a number of seconds >= 60 .*default 900"):
            make_backend(gce, pending_timeout_s=timeout)
    leaky = TrainingJob(JOB.job_id, JOB.command, JOB.checkpoint_uri, POOLS, env={"GITHUB_TOKEN": "x"})
    with pytest.raises(BackendError, match="service account"):
        make_backend(gce).reconcile(leaky, Allocation((1, 0), 0))
    assert gce.inserts() == []


@pytest.mark.parametrize("uri", ["/tmp/ckpt", "ckpt", "~/ckpt", "file:///tmp/ckpt", "local:///tmp/ckpt", "simplecache::file:///tmp/ckpt"])
def test_a_checkpoint_uri_on_the_workers_own_disk_is_refused_before_any_call_to_compute_engine(gce, uri):
    """The VMs cannot reach it: each would train from scratch and a preemption would lose the work."""
    local = TrainingJob(JOB.job_id, JOB.command, uri, POOLS)
    with pytest.raises(JobError, match=rf"^checkpoint_uri='{re.escape(uri)}': a path on this machine, which the gce "
                                       r"instances cannot reach .* \(s3://BUCKET/PREFIX or gs://BUCKET/PREFIX\), or use backend='local'$"):
        make_backend(gce).check_job(local)
    make_backend(gce).check_job(JOB)  # gs://
    assert gce.requests == []


@pytest.mark.parametrize("uri", ["FILE:///tmp/ckpt", "GS://bucket/ckpt", "simplecache::S3://bucket/ckpt"])
def test_a_checkpoint_uri_with_its_scheme_in_capitals_is_refused_before_any_call_to_compute_engine(gce, uri):
    """Airflow's storage reads ``GS://``, the instances' fsspec and start-up script do not."""
    shouting = TrainingJob(JOB.job_id, JOB.command, uri, POOLS)
    with pytest.raises(JobError, match=r"in capitals, which the gce instances' tools do not read; write it in lower case"):
        make_backend(gce).check_job(shouting)
    assert gce.requests == []
