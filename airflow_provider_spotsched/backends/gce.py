"""Compute Engine: spot VMs per pool (one zone each) and standard ones, through ``compute_v1``.

Every instance carries the labels ``spotsched-job-id`` (:func:`job_label`: the job id made
label-safe), ``spotsched-pool`` (``p<index>`` of the pool in ``job.pools``, or ``od``),
``spotsched-capacity`` (``spot``/``standard``) and ``spotsched-generation``. Instance names are
deterministic, ``<job prefix>-g<generation>-<pool>-<index>``, so a retried insert answers
409 ALREADY_EXISTS instead of creating a duplicate: on the call, or in its operation's error
(``RESOURCE_ALREADY_EXISTS``, when an earlier try was still running), it counts as launched.
Spot VMs use ``provisioning_model=SPOT`` with ``instance_termination_action=DELETE``: a
preempted VM deletes itself, nothing is left behind.

Rendezvous: the ``startup-script`` metadata (:mod:`~airflow_provider_spotsched.backends.bootstrap`)
waits for the metadata attributes ``spotsched-generation``, ``spotsched-rank``,
``spotsched-world-size``, ``spotsched-master-addr`` and ``spotsched-master-port``, which
``reconcile`` sets (``set_metadata``) once every live VM has an internal IP; the oldest VM is
rank 0 and its IP the master address.

Results and preemptions: the VM labels itself ``spotsched-result=done`` (or ``failed-<code>``)
and powers off when the training command ends. A preemption leaves a zone operation of type
``compute.instances.preempted`` naming the VM, even after the VM deleted itself; ``status`` lists
those, so preemptions stay visible to a restarted caller.
GCE lists a VM it is taking back as ``STOPPING`` before that operation shows: a spot VM
``STOPPING`` or ``TERMINATED`` without a result label, not deleted by this backend, is preempted
already (the same name, so the operation that shows later does not count it twice).
A VM this backend object saw and that vanished without a delete from it counts as preempted
too when it was spot (failed when standard). A VM with a preemption operation is preempted even
when it labelled itself ``failed-<code>``: the preemption's shutdown ended a command that does not
exit 75 on SIGTERM. One read as preempted only for stopping or vanishing without a result is marked
``inferred``: its operation is not listed yet, and a failed command whose VM may not label itself
looks the same (the run driver reads its stored result).

Operations (insert, delete, set_metadata) are awaited through the backend's own
``ZoneOperationsClient``: the one an ``InstancesClient`` polls through otherwise is built for the
default endpoint whatever the client's ``client_options`` say, so a private or regional
``api_endpoint`` (VPC Service Controls, Private Google Access) would not be honoured.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from google.api_core.exceptions import Conflict, GoogleAPICallError
from google.api_core.extended_operation import ExtendedOperation
from google.cloud import compute_v1

from airflow_provider_spotsched.backends.base import (
    ON_DEMAND,
    BackendError,
    InstanceState,
    InstanceStatus,
    JobStatus,
    TrainingJob,
)
from airflow_provider_spotsched.backends.bootstrap import RENDEZVOUS_KEYS
from airflow_provider_spotsched.backends.cloud import DEFAULT_PENDING_TIMEOUT_S, CloudBackend, utc_now
from airflow_provider_spotsched.market.launch import LaunchRecorder
from airflow_provider_spotsched.market.trace import parse_timestamp
from airflow_provider_spotsched.scheduling.model import Allocation

log = logging.getLogger(__name__)

LABEL_JOB = "spotsched-job-id"
LABEL_POOL = "spotsched-pool"
LABEL_CAPACITY = "spotsched-capacity"
LABEL_GENERATION = "spotsched-generation"
LABEL_RESULT = "spotsched-result"
ATTRIBUTE_PREFIX = "spotsched-"

CAPACITY_ERRORS = (
    "ZONE_RESOURCE_POOL_EXHAUSTED",  # also matches ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS
    "QUOTA_EXCEEDED",
    "STOCKOUT",
)
"""Error codes (in an operation's errors or an HTTP error) that mean "no capacity here now"."""

PREEMPTED_OPERATION = "compute.instances.preempted"
_STARTING = ("PROVISIONING", "STAGING")  # created, waiting for a host and its first start
_PENDING = (*_STARTING, "REPAIRING")
_STOPPED = ("STOPPING", "TERMINATED")
_OPERATION_TIMEOUT_S = 600
_ALREADY_EXISTS = "RESOURCE_ALREADY_EXISTS"  # an insert operation's error when a racing try made the VM


def job_label(job_id: str) -> str:
    """The job id as a label value: lowercase, ``[a-z0-9_-]``, at most 63 characters.

    An id that already fits is kept as it is; any other (upper case, dots, too long) becomes its
    sanitised form cut to 54 characters plus ``-`` and 8 hex digits of its SHA-256, so that two
    ids differing only in case or dots never share a label.
    """
    safe = re.sub(r"[^a-z0-9_-]", "-", job_id.lower())
    if safe == job_id and len(safe) <= 63:
        return safe
    return f"{safe[:54]}-{hashlib.sha256(job_id.encode()).hexdigest()[:8]}"


def name_prefix(job_id: str) -> str:
    """The start of every instance name of the job: ``ss-`` + a readable part + a hash (<= 40 chars)."""
    readable = re.sub(r"[^a-z0-9-]", "-", job_id.lower())[:24].strip("-")
    return f"ss-{readable}-{hashlib.sha256(job_id.encode()).hexdigest()[:10]}".replace("--", "-")


@dataclass(frozen=True)
class _Vm:
    """One VM of the job as ``list`` returned it, with the fields the backend reasons on."""

    name: str
    zone: str
    status: str
    labels: Mapping[str, str]
    ip: str | None
    created: str
    started: str  # lastStartTimestamp: "" until the VM first starts
    metadata: compute_v1.Metadata

    @property
    def pool_tag(self) -> str:
        return self.labels.get(LABEL_POOL, "od")

    @property
    def spot(self) -> bool:
        return self.labels.get(LABEL_CAPACITY) == "spot"

    @property
    def generation(self) -> int:
        return int(self.labels.get(LABEL_GENERATION, "0") or 0)

    def attribute(self, key: str) -> str | None:
        for item in self.metadata.items:
            if item.key == ATTRIBUTE_PREFIX + key:
                return item.value
        return None


class _ZoneOperation(ExtendedOperation):
    """A Compute Engine zone operation as a future: ``result`` raises the HTTP error it ended with."""

    @property
    def error_code(self) -> int:
        return self.http_error_status_code

    @property
    def error_message(self) -> str:
        return self.http_error_message


def _cannot_cancel() -> None:
    """What cancelling a zone operation does: nothing (Compute Engine has no cancel for them)."""


class GceBackend(CloudBackend[_Vm, str]):
    """Runs a job on Compute Engine through an ``InstancesClient`` (the Google provider's client).

    ``zones`` maps every spot pool name of the job to its zone; ``on_demand_zone`` places the
    standard VMs. ``accelerators`` is ``{accelerator type: count}`` (for example
    ``{"nvidia-tesla-t4": 1}``); GPU VMs get ``on_host_maintenance=TERMINATE``.
    ``service_account`` is the identity VMs use for the checkpoint store and to label their
    result; no credential goes in the metadata. ``pending_timeout_s``: how long a VM may stay
    ``PROVISIONING`` or ``STAGING`` after its creation before a reconcile deletes it and reports
    its pool short (:mod:`.cloud`); ``clock`` is what that wait is measured against.
    ``zone_operations_client`` must have the credentials and ``client_options`` (endpoint) of
    ``instances_client``: every operation is awaited through it, and it lists preemptions.
    """

    name = "gce"
    provider = "gcp"

    def __init__(
        self,
        instances_client: compute_v1.InstancesClient,
        *,
        project: str,
        zones: Mapping[str, str],
        on_demand_zone: str,
        machine_type: str,
        image: str,
        accelerators: Mapping[str, int] | None = None,
        service_account: str | None = None,
        network: str = "global/networks/default",
        subnetwork: str | None = None,
        external_ip: bool = True,
        disk_size_gb: int = 100,
        master_port: int = 29500,
        poll_seconds: int = 10,
        zone_operations_client: compute_v1.ZoneOperationsClient,
        recorder: LaunchRecorder | None = None,
        pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        required = {"project": project, "on_demand_zone": on_demand_zone, "machine_type": machine_type, "image": image}
        for name, value in required.items():
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not zones:
            raise ValueError("zones is empty: map every spot pool name to its zone, e.g. {'pool-a': 'us-central1-a'}")
        if disk_size_gb < 10:
            raise ValueError(f"disk_size_gb must be >= 10 (the smallest boot disk), got {disk_size_gb}")
        if not 1 <= master_port <= 65535:
            raise ValueError(f"master_port must be a TCP port in [1, 65535], got {master_port}")
        super().__init__(
            poll_seconds=poll_seconds, recorder=recorder, pending_timeout_s=pending_timeout_s, clock=clock
        )
        self.instances = instances_client
        self.operations = zone_operations_client
        self.project, self.zones, self.on_demand_zone = project, dict(zones), on_demand_zone
        self.machine_type, self.image = machine_type, image
        self.accelerators = dict(accelerators or {})
        self.service_account, self.network, self.subnetwork = service_account, network, subnetwork
        self.external_ip, self.disk_size_gb = external_ip, disk_size_gb
        self.master_port = master_port
        self._seen: dict[str, tuple[str, str]] = {}  # name -> (pool tag, capacity) of VMs listed once
        self._deleted: set[str] = set()

    # -- ComputeBackend -------------------------------------------------------------------------

    def release(self, job: TrainingJob) -> None:
        self._terminate([vm for vm in self._list(job) if vm.name not in self._deleted])

    # -- CloudBackend primitives ----------------------------------------------------------------

    def _check(self, job: TrainingJob, target: Allocation) -> None:
        missing = [p for p, n in zip(job.pools, target.spot) if n and p not in self.zones]
        if missing:
            raise BackendError(
                f"pools {missing} have no zone; add them to GceBackend(zones={{pool: zone}}) "
                f"(known: {sorted(self.zones)})"
            )

    def _all_zones(self) -> list[str]:
        return sorted(set(self.zones.values()) | {self.on_demand_zone})

    def _list(self, job: TrainingJob) -> list[_Vm]:
        label = job_label(job.job_id)
        vms = []
        for zone in self._all_zones():
            request = compute_v1.ListInstancesRequest(
                project=self.project, zone=zone, filter=f'labels.{LABEL_JOB} = "{label}"'
            )
            for instance in self.instances.list(request=request):
                interfaces = list(instance.network_interfaces)
                vm = _Vm(
                    name=instance.name,
                    zone=zone,
                    status=instance.status,
                    labels=dict(instance.labels),
                    ip=interfaces[0].network_i_p if interfaces and interfaces[0].network_i_p else None,
                    created=instance.creation_timestamp,
                    started=instance.last_start_timestamp,
                    metadata=instance.metadata,
                )
                vms.append(vm)
                self._seen[vm.name] = (vm.pool_tag, vm.labels.get(LABEL_CAPACITY, ""))
        return vms

    def _preempted(self, job: TrainingJob) -> dict[str, str]:
        """Names of the job's VMs with a preemption operation, and when it happened."""
        prefix = name_prefix(job.job_id) + "-"
        found = {}
        for zone in self._all_zones():
            request = compute_v1.ListZoneOperationsRequest(
                project=self.project, zone=zone, filter=f'operationType = "{PREEMPTED_OPERATION}"'
            )
            for operation in self.operations.list(request=request):
                name = operation.target_link.rsplit("/", 1)[-1]
                if name.startswith(prefix):
                    found[name] = operation.end_time or operation.insert_time
        return found

    def _status(self, job: TrainingJob, vms: list[_Vm]) -> JobStatus:
        preempted = self._preempted(job)
        listed = {vm.name for vm in vms}
        statuses = []
        for vm in sorted(vms, key=self._oldest_first):
            state, detail = self._state(vm, preempted)
            inferred = state is InstanceState.PREEMPTED and vm.name not in preempted  # stopped, no operation yet
            statuses.append(InstanceStatus(vm.name, self._pool(job, vm.pool_tag), state, detail, inferred, vm.labels.get(LABEL_RESULT, "")))
        for name, when in sorted(preempted.items()):
            if name not in listed:
                pool = self._pool(job, _pool_tag_of(name))
                statuses.append(InstanceStatus(name, pool, InstanceState.PREEMPTED, f"preempted at {when}"))
        for name, (tag, capacity) in sorted(self._seen.items()):
            if name in listed or name in preempted or not name.startswith(name_prefix(job.job_id) + "-"):
                continue
            if name in self._deleted:
                statuses.append(InstanceStatus(name, self._pool(job, tag), InstanceState.RELEASED, "deleted"))
            else:
                state = InstanceState.PREEMPTED if capacity == "spot" else InstanceState.FAILED
                detail = "vanished without a delete from spotsched"
                statuses.append(InstanceStatus(name, self._pool(job, tag), state, detail, inferred=capacity == "spot"))
        return JobStatus(job.job_id, tuple(statuses))

    def _live(self, vm: _Vm) -> bool:
        running = vm.status in _PENDING or vm.status == "RUNNING"
        return running and not vm.labels.get(LABEL_RESULT) and vm.name not in self._deleted

    def _pool_keys(self, job: TrainingJob) -> tuple[str, ...]:
        return (*(f"p{m}" for m in range(len(job.pools))), "od")

    def _pool_key(self, vm: _Vm) -> str:
        return vm.pool_tag

    def _oldest_first(self, vm: _Vm) -> tuple[str, str]:
        return vm.created, vm.name

    def _pending_since(self, vm: _Vm) -> datetime | None:
        # Only a VM that never started: one that has (a standard VM restarting after host maintenance
        # passes through PROVISIONING and STAGING again, a REPAIRING one) has run and may run again.
        return parse_timestamp(vm.created) if vm.status in _STARTING and not vm.started else None

    @staticmethod
    def _pool(job: TrainingJob, tag: str) -> str:
        if tag.startswith("p") and tag[1:].isdigit() and int(tag[1:]) < len(job.pools):
            return job.pools[int(tag[1:])]
        return ON_DEMAND

    def _state(self, vm: _Vm, preempted: Mapping[str, str]) -> tuple[InstanceState, str]:
        result = vm.labels.get(LABEL_RESULT, "")
        if result == "done":
            return InstanceState.FINISHED, f"{vm.status}, result=done"
        if result and vm.name in preempted:
            # the preemption's shutdown ended the command (torchrun exits 1 on SIGTERM): the work resumes elsewhere
            return InstanceState.PREEMPTED, f"{vm.status}, preempted at {preempted[vm.name]}, result={result}"
        if result:
            return InstanceState.FAILED, f"{vm.status}, result={result}"
        if vm.name in self._deleted:
            return InstanceState.RELEASED, f"{vm.status}, deleting"
        if vm.status in _PENDING:
            return InstanceState.PENDING, vm.status
        if vm.status == "RUNNING":
            return InstanceState.RUNNING, vm.status
        if vm.name in preempted:
            return InstanceState.PREEMPTED, f"{vm.status}, preempted at {preempted[vm.name]}"
        if vm.spot and vm.status in _STOPPED:
            # GCE lists a spot VM it takes back as STOPPING before its preemption operation shows, and
            # a failed command labels its VM itself: without a result label this is a preemption.
            return InstanceState.PREEMPTED, f"{vm.status} without a result: preempted (its operation is not listed yet)"
        return InstanceState.FAILED, f"{vm.status} without a result: stopped outside spotsched"

    def _terminate(self, vms: list[_Vm]) -> None:
        # A VM counts as deleted only once its delete is done (or it was gone already): one whose
        # delete failed is still billed, so it stays live for reconcile and release tries again.
        # Every delete is asked for and awaited before the first failure is raised.
        pending, failures = [], []
        for vm in vms:
            self._seen.setdefault(vm.name, (vm.pool_tag, vm.labels.get(LABEL_CAPACITY, "")))
            try:
                accepted = self.instances.delete_unary(project=self.project, zone=vm.zone, instance=vm.name)
                pending.append((vm, self._awaitable(vm.zone, accepted)))
            except GoogleAPICallError as exc:
                if getattr(exc, "code", None) == 404:  # already gone is what we wanted
                    self._deleted.add(vm.name)
                else:
                    failures.append(f"{vm.name} in {vm.zone}: {exc}")
        for vm, operation in pending:
            try:
                operation.result(timeout=_OPERATION_TIMEOUT_S)
            except (GoogleAPICallError, TimeoutError) as exc:
                failures.append(f"{vm.name} in {vm.zone}: {type(exc).__name__}: {exc}")
            else:
                self._deleted.add(vm.name)
        done = [vm.name for vm in vms if vm.name in self._deleted]
        if done:
            log.info("deleted %d instance(s): %s", len(done), ", ".join(done))
        if failures:
            raise BackendError(
                f"deleting {len(failures)} instance(s) failed, they may still run and bill: {'; '.join(failures)}; "
                "the next reconcile or release deletes them again"
            )

    def _next_generation(self, job: TrainingJob, known: list[_Vm]) -> int:
        # Names of preempted VMs are free again; a higher generation still keeps their operations apart.
        earlier = [*self._seen, *self._preempted(job)]
        return 1 + max([vm.generation for vm in known] + [_generation_of(n) for n in earlier], default=0)

    def _launch(self, job: TrainingJob, tag: str, count: int, generation: int, script: str) -> tuple[list[str], str]:
        pool = self._pool(job, tag)
        zone = self.on_demand_zone if tag == "od" else self.zones[pool]
        launched: list[str] = []
        pending = []
        reasons: list[str | BackendError] = []
        for name in (f"{name_prefix(job.job_id)}-g{generation}-{tag}-{index}" for index in range(count)):
            body = self._instance(job, name, zone, tag, generation, script)
            try:
                accepted = self.instances.insert_unary(project=self.project, zone=zone, instance_resource=body)
                pending.append((name, self._awaitable(zone, accepted)))
            except Conflict:
                launched.append(name)  # a retried insert: the VM exists already
            except GoogleAPICallError as exc:
                reasons.append(_capacity_reason(exc, name))
                break
        # Every accepted insert is awaited, even after another failed for good: a VM still being
        # created may not be listed yet, and a release that cannot see it would leave it running.
        for name, operation in pending:
            try:
                operation.result(timeout=_OPERATION_TIMEOUT_S)
            except Conflict:
                launched.append(name)  # created by an earlier try of this insert, which raced this one
                continue
            except GoogleAPICallError as exc:
                reasons.append(_capacity_reason(exc, name))
                continue
            except TimeoutError:
                reasons.append(BackendError(
                    f"creating instance {name}: not done after {_OPERATION_TIMEOUT_S} s, it may still start and bill; "
                    "release the job, or reconcile again to count it"
                ))
                continue
            errors = operation.error.errors if operation.error else []
            if errors and not any(e.code == _ALREADY_EXISTS for e in errors):  # an error without an HTTP status
                reasons.append(_capacity_reason(GoogleAPICallError(str(errors)), name))
                continue
            launched.append(name)
        failure = next((r for r in reasons if isinstance(r, BackendError)), None)
        if failure is not None:
            raise failure
        return launched, next((r for r in reversed(reasons) if isinstance(r, str)), "")

    def _awaitable(self, zone: str, operation: compute_v1.Operation) -> _ZoneOperation:
        """``operation`` as a future polled through ``self.operations``, the client with the connection's endpoint."""
        request = compute_v1.GetZoneOperationRequest(project=self.project, zone=zone, operation=operation.name)
        return _ZoneOperation.make(functools.partial(self.operations.get, request), _cannot_cancel, operation)

    def _with_launched(self, job: TrainingJob, vms: list[_Vm], launched: list[str]) -> list[_Vm]:
        return self._list(job) if launched else vms  # the new VMs' addresses and metadata fingerprints

    def _instance(
        self, job: TrainingJob, name: str, zone: str, tag: str, generation: int, script: str
    ) -> compute_v1.Instance:
        spot = tag != "od"
        if spot:
            scheduling = compute_v1.Scheduling(
                provisioning_model="SPOT",
                instance_termination_action="DELETE",
                automatic_restart=False,
                on_host_maintenance="TERMINATE",
            )
        else:
            scheduling = compute_v1.Scheduling(
                provisioning_model="STANDARD",
                automatic_restart=True,
                on_host_maintenance="TERMINATE" if self.accelerators else "MIGRATE",
            )
        interface = compute_v1.NetworkInterface(network=self.network)
        if self.subnetwork:
            interface.subnetwork = self.subnetwork
        if self.external_ip:
            interface.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        instance = compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{self.machine_type}",
            labels={
                LABEL_JOB: job_label(job.job_id),
                LABEL_POOL: tag,
                LABEL_CAPACITY: "spot" if spot else "standard",
                LABEL_GENERATION: str(generation),
            },
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key="startup-script", value=script)]),
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=self.image, disk_size_gb=self.disk_size_gb
                    ),
                )
            ],
            network_interfaces=[interface],
            scheduling=scheduling,
        )
        if self.accelerators:
            instance.guest_accelerators = [
                compute_v1.AcceleratorConfig(
                    accelerator_type=f"zones/{zone}/acceleratorTypes/{kind}", accelerator_count=n
                )
                for kind, n in self.accelerators.items()
            ]
        if self.service_account:
            instance.service_accounts = [
                compute_v1.ServiceAccount(
                    email=self.service_account, scopes=["https://www.googleapis.com/auth/cloud-platform"]
                )
            ]
        return instance

    def _rendezvous(self, live: list[_Vm], known: list[_Vm]) -> None:
        """Publish a new generation when the live set differs from the one the metadata describes."""
        if not live:
            return
        ordered = sorted(live, key=self._oldest_first)
        generations = {vm.attribute("generation") for vm in ordered}
        sizes = {vm.attribute("world-size") for vm in ordered}
        ranks = sorted(str(vm.attribute("rank")) for vm in ordered)
        if len(generations) == 1 and None not in generations and sizes == {str(len(ordered))} and ranks == sorted(
            str(r) for r in range(len(ordered))
        ):
            return
        if any(not vm.ip for vm in ordered):
            log.info("rendezvous waits for internal addresses; the next reconcile publishes it")
            return
        attributes = [int(a) for vm in known for a in [vm.attribute("generation")] if a and a.isdigit()]
        generation = str(1 + max(attributes + [vm.generation for vm in known]))
        operations = []
        for rank, vm in enumerate(ordered):
            fields = (generation, str(rank), str(len(ordered)), ordered[0].ip or "", str(self.master_port))
            values = dict(zip(RENDEZVOUS_KEYS, fields))
            items = [i for i in vm.metadata.items if not i.key.startswith(ATTRIBUTE_PREFIX)]
            items += [compute_v1.Items(key=ATTRIBUTE_PREFIX + k, value=v) for k, v in values.items()]
            metadata = compute_v1.Metadata(fingerprint=vm.metadata.fingerprint, items=items)
            accepted = self.instances.set_metadata_unary(
                project=self.project, zone=vm.zone, instance=vm.name, metadata_resource=metadata
            )
            operations.append(self._awaitable(vm.zone, accepted))
        for operation in operations:
            operation.result(timeout=_OPERATION_TIMEOUT_S)
        log.info("rendezvous generation %s: %d worker(s), master %s", generation, len(ordered), ordered[0].ip)


def _pool_tag_of(name: str) -> str:
    """The pool part of ``<prefix>-g<generation>-<pool>-<index>``."""
    parts = name.rsplit("-", 3)
    return parts[-2] if len(parts) == 4 else "od"


def _generation_of(name: str) -> int:
    parts = name.rsplit("-", 3)
    return int(parts[-3][1:]) if len(parts) == 4 and parts[-3][1:].isdigit() else 0


def _capacity_reason(exc: GoogleAPICallError, name: str) -> str | BackendError:
    """The capacity code in ``exc``; any other error, a :class:`BackendError` naming the VM, for
    the caller to raise once the inserts already accepted are awaited."""
    text = f"{exc} {getattr(exc, 'errors', '')}"
    for code in CAPACITY_ERRORS:
        if code in text:
            return code
    failure = BackendError(f"creating instance {name} failed: {exc}")
    failure.__cause__ = exc
    return failure
