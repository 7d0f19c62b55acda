"""EC2: spot instances per pool (one Availability Zone or subnet each) and on-demand ones.

Every instance is launched with ``run_instances`` and tagged at launch (``TagSpecifications``)
with ``spotsched:job-id``, ``spotsched:pool``, ``spotsched:capacity`` (``spot``/``on-demand``)
and ``spotsched:generation``; ``status`` and ``release`` find the job by the job-id tag alone, so
a restarted caller re-attaches instead of launching twice. Spot instances use
``InstanceMarketOptions`` (one-time, terminate on interruption). ``ClientToken`` makes a retried
launch return the first one's instance instead of a new one (one instance per call); it hashes
the job id, the launch generation, the pool, the instance's index and the UTC 10-minute window
(the window keeps a token from matching a launch of the same generation made long ago, whose
instances are gone from ``describe_instances``).

Rendezvous: the user data (:mod:`~airflow_provider_spotsched.backends.bootstrap`) waits for the
tags ``spotsched:generation``, ``spotsched:rank``, ``spotsched:world-size``,
``spotsched:master-addr`` and ``spotsched:master-port``, which it reads through IMDSv2 (instances
are launched with ``InstanceMetadataTags=enabled``). ``reconcile`` writes them with
``create_tags`` once every live instance has a private address: ranks by launch time, the oldest
instance is rank 0 and its private IP the master address. A new generation restarts training on
every instance from the latest checkpoint. EC2 is eventually consistent: an instance launched a
moment ago may lack its address or be unknown to ``create_tags`` for a few seconds, so the
reconcile tries again within about half a minute (:data:`RENDEZVOUS_PAUSES_S`) before it leaves the
rendezvous to the next one (a slot later, while the instances wait for it, billed).

Quota: :meth:`Ec2Backend.instance_limit` divides the account's Service Quotas vCPU limit for
running on-demand instances of the type's family (standard, P, G and VT) by the type's vCPUs
(``describe_instance_types``). ``describe_account_attributes``' ``max-instances`` would be simpler,
but AWS documents it as no longer supported: it does not reflect the vCPU limits.

Results and preemptions: the instance tags itself ``spotsched:result=done`` (or
``failed-<code>``) when the training command ends and shuts down, which terminates it
(``InstanceInitiatedShutdownBehavior=terminate``). Before terminating an instance itself, the
backend tags it ``spotsched:released=true``; a terminated spot instance without that tag and
without a result was taken back by AWS (``Server.SpotInstanceTermination``, or terminated from
outside) and counts as preempted. A terminated on-demand instance without either tag failed.
An interrupted instance (``Server.SpotInstanceTermination``) is preempted even when it tagged
``failed-<code>``: the interruption's shutdown ended a command that does not exit 75 on SIGTERM.
A spot instance read as preempted without that reason is marked ``inferred`` (the run driver
then lets the result stored beside its log decide).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from airflow_provider_spotsched.backends.base import (
    ON_DEMAND,
    BackendError,
    InstanceState,
    InstanceStatus,
    JobStatus,
    TrainingJob,
)
from airflow_provider_spotsched.backends.cloud import DEFAULT_PENDING_TIMEOUT_S, CloudBackend, utc_now
from airflow_provider_spotsched.market.launch import LaunchRecorder
from airflow_provider_spotsched.scheduling.model import Allocation

log = logging.getLogger(__name__)

TAG_JOB = "spotsched:job-id"
TAG_POOL = "spotsched:pool"
TAG_CAPACITY = "spotsched:capacity"
TAG_GENERATION = "spotsched:generation"
TAG_RANK = "spotsched:rank"
TAG_WORLD_SIZE = "spotsched:world-size"
TAG_MASTER_ADDR = "spotsched:master-addr"
TAG_MASTER_PORT = "spotsched:master-port"
TAG_RELEASED = "spotsched:released"
TAG_RESULT = "spotsched:result"

CAPACITY_ERRORS = frozenset(
    {"InsufficientInstanceCapacity", "InsufficientCapacity", "SpotMaxPriceTooLow", "MaxSpotInstanceCountExceeded"}
)
"""run_instances error codes that mean "this pool has no capacity for us now" (not a bug to fix)."""

SPOT_PREEMPTION_REASON = "Server.SpotInstanceTermination"
SELF_SHUTDOWN_REASON = "Client.InstanceInitiatedShutdown"
_GONE = ("shutting-down", "terminated")
_TOKEN_WINDOW_SECONDS = 600
_TERMINATE_BATCH = 1000  # terminate_instances takes at most 1000 ids per call

RENDEZVOUS_PAUSES_S = (1.0, 2.0, 4.0, 8.0, 15.0)
"""Pauses between tries to publish a rendezvous, or tag an instance released, that EC2 does not
show yet (30 s in all): its eventual-consistency delays are seconds, and the next reconcile is a
slot away."""

ON_DEMAND_QUOTAS = {"standard": "L-1216C47A", "p": "L-417A185B", "g": "L-DB2E81BA", "vt": "L-DB2E81BA"}
"""Service Quotas codes of "Running On-Demand <family> instances" (vCPUs), by instance family."""
STANDARD_FAMILIES = frozenset("acdhimrtz")
"""Families under the standard quota: "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances"."""


@dataclass(frozen=True)
class Ec2Placement:
    """Where one pool's instances go: a subnet (which fixes the AZ) or an Availability Zone."""

    subnet_id: str | None = None
    availability_zone: str | None = None

    def __post_init__(self) -> None:
        if not self.subnet_id and not self.availability_zone:
            raise ValueError("an Ec2Placement needs subnet_id or availability_zone (for example 'us-east-1a')")

    @classmethod
    def parse(cls, value: str | Ec2Placement) -> Ec2Placement:
        """``subnet-...`` is a subnet, any other string an Availability Zone."""
        if isinstance(value, Ec2Placement):
            return value
        if not isinstance(value, str) or not value:
            raise ValueError(f"a pool placement must be a subnet id or an Availability Zone name, got {value!r}")
        return cls(subnet_id=value) if value.startswith("subnet-") else cls(availability_zone=value)

    def launch_params(self) -> dict[str, Any]:
        if self.subnet_id:
            return {"SubnetId": self.subnet_id}
        return {"Placement": {"AvailabilityZone": self.availability_zone}}


@dataclass
class _Instance:
    """One EC2 instance of the job, as ``describe_instances`` or ``run_instances`` returned it."""

    instance_id: str
    state: str
    launch_time: datetime
    private_ip: str | None
    state_reason: str
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_api(cls, data: Mapping[str, Any]) -> _Instance:
        return cls(
            instance_id=data["InstanceId"],
            state=data["State"]["Name"],
            launch_time=data["LaunchTime"],
            private_ip=data.get("PrivateIpAddress"),
            state_reason=(data.get("StateReason") or {}).get("Code", ""),
            tags={t["Key"]: t["Value"] for t in data.get("Tags", [])},
        )

    @property
    def pool(self) -> str:
        return self.tags.get(TAG_POOL, ON_DEMAND)

    @property
    def generation(self) -> int:
        return int(self.tags.get(TAG_GENERATION, "0") or 0)


class Ec2Backend(CloudBackend[_Instance, _Instance]):
    """Runs a job on EC2 through a boto3 EC2 client (from the Amazon provider's ``EC2Hook``).

    ``pools`` maps every spot pool name of the job to its placement (a subnet id or an AZ);
    ``on_demand`` places on-demand instances (EC2 picks a subnet of the default VPC when None).
    ``iam_instance_profile`` (a name or an ARN) gives instances their checkpoint-store access and
    the ``ec2:CreateTags`` right on themselves to report a result; no credential ever goes in the
    user data. ``quotas_client`` (a boto3 ``service-quotas`` client) lets :meth:`instance_limit`
    read the account's on-demand quota. ``sleep`` waits between tries of a rendezvous or a release
    tag that EC2 does not show yet (tests pass a recorder). ``pending_timeout_s``: how long an
    instance may stay ``pending`` after its launch before a reconcile terminates it and reports its
    pool short (:mod:`.cloud`); ``clock`` is what that wait is measured against.
    """

    name = "ec2"
    provider = "aws"

    def __init__(
        self,
        client: Any,
        *,
        instance_type: str,
        image_id: str,
        pools: Mapping[str, str | Ec2Placement],
        on_demand: str | Ec2Placement | None = None,
        key_name: str | None = None,
        security_group_ids: Iterable[str] = (),
        iam_instance_profile: str | None = None,
        master_port: int = 29500,
        poll_seconds: int = 10,
        recorder: LaunchRecorder | None = None,
        quotas_client: Any | None = None,
        sleep: Callable[[float], None] = time.sleep,
        pending_timeout_s: float = DEFAULT_PENDING_TIMEOUT_S,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        for name, value in (("instance_type", instance_type), ("image_id", image_id)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not pools:
            raise ValueError("pools is empty: map every spot pool name to a subnet id or an Availability Zone")
        if not 1 <= master_port <= 65535:
            raise ValueError(f"master_port must be a TCP port in [1, 65535], got {master_port}")
        super().__init__(
            poll_seconds=poll_seconds, recorder=recorder, pending_timeout_s=pending_timeout_s, clock=clock
        )
        self.client = client
        self.instance_type, self.image_id = instance_type, image_id
        self.pools = {name: Ec2Placement.parse(value) for name, value in pools.items()}
        self.on_demand = None if on_demand is None else Ec2Placement.parse(on_demand)
        self.key_name = key_name
        self.security_group_ids = tuple(security_group_ids)
        self.iam_instance_profile = iam_instance_profile
        self.master_port = master_port
        self.quotas_client = quotas_client
        self.sleep = sleep

    # -- ComputeBackend -------------------------------------------------------------------------

    def release(self, job: TrainingJob) -> None:
        instances = [i for i in self._list(job) if i.state not in _GONE]
        self._terminate(instances)

    def instance_limit(self) -> int | None:
        """The on-demand vCPU quota of the type's family over the type's vCPUs; ``None`` without a
        quotas client, for a family with no known quota, or when either call is refused."""
        family = re.sub(r"[^a-z].*", "", self.instance_type)  # p3.2xlarge: p
        code = ON_DEMAND_QUOTAS.get("standard" if family in STANDARD_FAMILIES else family)
        if self.quotas_client is None or code is None:
            return None
        try:
            types = self.client.describe_instance_types(InstanceTypes=[self.instance_type])["InstanceTypes"]
            vcpus = int(types[0]["VCpuInfo"]["DefaultVCpus"])
            quota = float(self.quotas_client.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except (ClientError, BotoCoreError, LookupError) as exc:
            log.info("the on-demand quota %s for %s is unknown (%s); max_instances is not checked against it",
                     code, self.instance_type, exc)
            return None
        log.info("on-demand quota %s: %g vCPUs, %d instance(s) of %s", code, quota, quota // vcpus, self.instance_type)
        return int(quota // vcpus)

    # -- CloudBackend primitives ----------------------------------------------------------------

    def _check(self, job: TrainingJob, target: Allocation) -> None:
        if ON_DEMAND in job.pools:
            raise ValueError(f"{ON_DEMAND!r} names the on-demand capacity; rename that spot pool in job.pools")
        missing = [p for p, n in zip(job.pools, target.spot) if n and p not in self.pools]
        if missing:
            raise BackendError(
                f"pools {missing} have no placement; add them to Ec2Backend(pools={{name: subnet or AZ}}) "
                f"(known: {sorted(self.pools)})"
            )

    def _list(self, job: TrainingJob) -> list[_Instance]:
        return self._describe({f"tag:{TAG_JOB}": [job.job_id]})

    def _describe(self, filters: Mapping[str, list[str]]) -> list[_Instance]:
        """Every instance that ``describe_instances`` shows for ``filters`` (name: values), all pages."""
        paginator = self.client.get_paginator("describe_instances")
        pages = paginator.paginate(Filters=[{"Name": name, "Values": values} for name, values in filters.items()])
        return [
            _Instance.from_api(data)
            for page in pages
            for reservation in page.get("Reservations", [])
            for data in reservation.get("Instances", [])
        ]

    def _status(self, job: TrainingJob, instances: list[_Instance]) -> JobStatus:
        statuses = []
        for instance in sorted(instances, key=self._oldest_first):
            state = _state(instance)
            statuses.append(InstanceStatus(instance.instance_id, instance.pool, state, _detail(instance), _inferred(instance, state),
                                           instance.tags.get(TAG_RESULT, "")))
        return JobStatus(job.job_id, tuple(statuses))

    def _live(self, instance: _Instance) -> bool:
        return _state(instance) in (InstanceState.PENDING, InstanceState.RUNNING)

    def _pool_keys(self, job: TrainingJob) -> tuple[str, ...]:
        return (*job.pools, ON_DEMAND)

    def _pool_key(self, instance: _Instance) -> str:
        return instance.pool

    def _oldest_first(self, instance: _Instance) -> tuple[datetime, str]:
        return instance.launch_time, instance.instance_id

    def _pending_since(self, instance: _Instance) -> datetime | None:
        return instance.launch_time if instance.state == "pending" else None

    def _finish_releases(self, instances: list[_Instance]) -> None:
        """Terminate what an earlier call tagged released but did not terminate (it crashed)."""
        pending = [i for i in instances if i.tags.get(TAG_RELEASED) == "true" and i.state not in _GONE]
        if pending:
            self._terminate(pending)

    def _terminate(self, instances: list[_Instance]) -> None:
        """Tag first, then terminate: the tag tells our terminations from preemptions (to the next
        reconcile, and to a retried task re-attaching after a release), and a crash between the two
        leaves a tag that :meth:`_finish_releases` acts on.

        EC2 may not know an instance launched a moment ago yet, and ``InvalidInstanceID.NotFound``
        fails a whole call: the others are tagged and terminated without it at once, and it is
        tried again after each of :data:`RENDEZVOUS_PAUSES_S`. Past them it is terminated untagged
        (its status then reads as ended outside spotsched: preempted, or failed if on demand); one
        that EC2 does not know even for that may still run, and a :class:`BackendError` names it.
        """
        unknown = instances
        for pause in (*RENDEZVOUS_PAUSES_S, None):
            unknown = self._tag_and_terminate(unknown)
            if not unknown or pause is None:
                break
            log.info("EC2 does not know %s yet; tagging it released again in %g s", _ids(unknown), pause)
            self.sleep(pause)
        lost: list[_Instance] = []
        for instance in unknown:  # one call each: an id EC2 does not know fails the whole call
            try:
                self.client.terminate_instances(InstanceIds=[instance.instance_id])
            except ClientError as error:
                if not _not_found(error):
                    raise
                lost.append(instance)
                continue
            instance.state = "shutting-down" if instance.state not in _GONE else instance.state
            log.warning("terminated %s without the %s tag (create_tags did not find it): its status reads "
                        "as ended outside spotsched", instance.instance_id, TAG_RELEASED)
        ended = [i for i in instances if i not in lost]
        if ended:
            log.info("terminated %d instance(s): %s", len(ended), _ids(ended))
        if lost:
            raise BackendError(
                f"could not terminate instance(s) {_ids(lost)}: EC2 still answers InvalidInstanceID.NotFound after "
                f"{sum(RENDEZVOUS_PAUSES_S):g} s, and they may run and bill; release the job again, or terminate them "
                f"by their {TAG_JOB} tag"
            )

    def _tag_and_terminate(self, instances: list[_Instance]) -> list[_Instance]:
        """Tag ``instances`` released and terminate them, in batches; return those EC2 does not know
        yet."""
        unknown: list[_Instance] = []
        for start in range(0, len(instances), _TERMINATE_BATCH):
            batch = instances[start : start + _TERMINATE_BATCH]
            if not self._tag_released(batch):  # find the unknown id(s) by tagging one instance at a time
                unseen = batch if len(batch) == 1 else [i for i in batch if not self._tag_released([i])]
                unknown += unseen
                batch = [i for i in batch if i not in unseen]
            if batch:
                self.client.terminate_instances(InstanceIds=[i.instance_id for i in batch])
            for i in batch:
                i.tags[TAG_RELEASED] = "true"
                i.state = "shutting-down" if i.state not in _GONE else i.state
        return unknown

    def _tag_released(self, instances: list[_Instance]) -> bool:
        """Tag ``instances`` released; False when EC2 does not know one of them yet (none is tagged then)."""
        try:
            self.client.create_tags(
                Resources=[i.instance_id for i in instances], Tags=[{"Key": TAG_RELEASED, "Value": "true"}]
            )
        except ClientError as error:
            if not _not_found(error):
                raise
            return False
        return True

    def _next_generation(self, job: TrainingJob, known: list[_Instance]) -> int:
        return 1 + max((i.generation for i in known), default=0)

    def _launch(
        self, job: TrainingJob, pool: str, count: int, generation: int, user_data: str
    ) -> tuple[list[_Instance], str]:
        new: list[_Instance] = []
        for index in range(count):  # one instance per call: a short pool still gives what it has
            params = self._launch_params(job, pool, index, generation, user_data)
            try:
                response = self.client.run_instances(**params)
            except ClientError as exc:
                error = exc.response.get("Error", {})
                if error.get("Code") not in CAPACITY_ERRORS:
                    raise BackendError(
                        f"run_instances for pool {pool!r} failed: {error.get('Code')}: {error.get('Message', exc)}"
                    ) from exc
                return new, error["Code"]  # the pool is out of capacity: asking again now only repeats the error
            launch_tags = {t["Key"]: t["Value"] for t in params["TagSpecifications"][0]["Tags"]}
            for data in response.get("Instances", []):
                instance = _Instance.from_api(data)
                instance.tags = launch_tags | instance.tags  # in case the response omits them
                new.append(instance)
        return new, ""

    def _with_launched(
        self, job: TrainingJob, instances: list[_Instance], launched: list[_Instance]
    ) -> list[_Instance]:
        return instances + launched  # run_instances answers with the new instances: no list call to wait for

    def _launch_params(
        self, job: TrainingJob, pool: str, index: int, generation: int, user_data: str
    ) -> dict[str, Any]:
        spot = pool != ON_DEMAND
        tags = {
            "Name": f"spotsched-{job.job_id}"[:255],
            TAG_JOB: job.job_id,
            TAG_POOL: pool,
            TAG_CAPACITY: "spot" if spot else "on-demand",
            TAG_GENERATION: str(generation),
        }
        tag_list = [{"Key": k, "Value": v} for k, v in tags.items()]
        window = int(datetime.now(timezone.utc).timestamp()) // _TOKEN_WINDOW_SECONDS
        token = hashlib.sha256(f"{job.job_id}|{generation}|{pool}|{index}|{window}".encode()).hexdigest()[:64]
        params: dict[str, Any] = {
            "ImageId": self.image_id,
            "InstanceType": self.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": token,
            "UserData": user_data,
            "InstanceInitiatedShutdownBehavior": "terminate",
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "InstanceMetadataTags": "enabled"},
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tag_list},
                {"ResourceType": "volume", "Tags": tag_list},
            ],
        }
        placement = self.pools.get(pool) if spot else self.on_demand
        if placement is not None:
            params |= placement.launch_params()
        if spot:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
        if self.key_name:
            params["KeyName"] = self.key_name
        if self.security_group_ids:
            params["SecurityGroupIds"] = list(self.security_group_ids)
        if self.iam_instance_profile:
            key = "Arn" if self.iam_instance_profile.startswith("arn:") else "Name"
            params["IamInstanceProfile"] = {key: self.iam_instance_profile}
        return params

    def _rendezvous(self, live: list[_Instance], known: list[_Instance]) -> None:
        """Publish a new generation when the live set differs from the one the tags describe."""
        if not live:
            return
        ordered = sorted(live, key=self._oldest_first)
        current = [i.tags.get(TAG_RANK) for i in ordered]
        generations = {i.tags.get(TAG_GENERATION) for i in ordered}
        sizes = {i.tags.get(TAG_WORLD_SIZE) for i in ordered}
        in_place = (
            len(generations) == 1
            and sizes == {str(len(ordered))}
            and sorted(current, key=str) == sorted(str(r) for r in range(len(ordered)))
        )
        if in_place:
            return
        generation = str(1 + max(i.generation for i in known))
        for pause in (*RENDEZVOUS_PAUSES_S, None):
            waiting = self._publish(ordered, generation)
            if not waiting:
                log.info("rendezvous generation %s: %d worker(s), master %s", generation, len(ordered),
                         ordered[0].private_ip)
                return
            if pause is None:
                log.info("rendezvous waits for %s; the next reconcile publishes it", waiting)
                return
            log.info("rendezvous waits for %s; trying again in %g s", waiting, pause)
            self.sleep(pause)

    def _publish(self, ordered: list[_Instance], generation: str) -> str:
        """Tag every instance of ``ordered`` with its rank in ``generation``; what EC2 does not show
        yet ("" once all is written). A try after a partial one writes only what is missing."""
        missing = [i for i in ordered if not i.private_ip]
        if missing:
            self._refresh_addresses(missing)
            if any(not i.private_ip for i in missing):
                return "private addresses"
        for rank, instance in enumerate(ordered):
            tags = {
                TAG_GENERATION: generation,
                TAG_RANK: str(rank),
                TAG_WORLD_SIZE: str(len(ordered)),
                TAG_MASTER_ADDR: ordered[0].private_ip or "",
                TAG_MASTER_PORT: str(self.master_port),
            }
            if tags.items() <= instance.tags.items():
                continue  # written by an earlier try
            try:
                self.client.create_tags(
                    Resources=[instance.instance_id], Tags=[{"Key": k, "Value": v} for k, v in tags.items()]
                )
            except ClientError as error:
                if not _not_found(error):
                    raise
                return f"{instance.instance_id} to be visible to EC2"
            instance.tags.update(tags)
        return ""

    def _refresh_addresses(self, instances: list[_Instance]) -> None:
        """Read the private IPs EC2 shows now; a filter, unlike ``InstanceIds``, skips an unknown id
        instead of failing the call."""
        by_id = {i.instance_id: i for i in instances}
        for seen in self._describe({"instance-id": list(by_id)}):
            if seen.instance_id in by_id and seen.private_ip:
                by_id[seen.instance_id].private_ip = seen.private_ip


def _not_found(error: ClientError) -> bool:
    """EC2 does not know an instance of the call: one launched a moment ago may not be visible yet."""
    return bool(error.response.get("Error", {}).get("Code") == "InvalidInstanceID.NotFound")


def _ids(instances: list[_Instance]) -> str:
    return ", ".join(i.instance_id for i in instances)


def _state(instance: _Instance) -> InstanceState:
    """Map an EC2 state, its reason and our tags to the backend's instance state."""
    result = instance.tags.get(TAG_RESULT, "")
    if result == "done":
        return InstanceState.FINISHED
    if result and instance.state_reason == SPOT_PREEMPTION_REASON:
        return InstanceState.PREEMPTED  # the interruption's shutdown ended the command (torchrun exits 1 on SIGTERM)
    if result:
        return InstanceState.FAILED
    if instance.tags.get(TAG_RELEASED) == "true":
        return InstanceState.RELEASED
    if instance.state == "pending":
        return InstanceState.PENDING
    if instance.state == "running":
        return InstanceState.RUNNING
    if instance.state_reason == SELF_SHUTDOWN_REASON:
        return InstanceState.FAILED  # shut itself down without recording a result: see the detail
    if instance.state in _GONE and (instance.pool != ON_DEMAND or instance.state_reason == SPOT_PREEMPTION_REASON):
        return InstanceState.PREEMPTED
    return InstanceState.FAILED  # stopped, or an on-demand instance ended outside spotsched


def _inferred(instance: _Instance, state: InstanceState) -> bool:
    """Whether a preemption is only read from a spot instance gone without a result, rather than
    reported by EC2 (``Server.SpotInstanceTermination``): a command that failed on an instance
    unable to tag itself can look the same (one ``shutting-down`` before its reason shows), so
    the run driver lets its stored result decide."""
    return state is InstanceState.PREEMPTED and instance.state_reason != SPOT_PREEMPTION_REASON


def _detail(instance: _Instance) -> str:
    parts = [instance.state]
    if instance.state_reason:
        parts.append(instance.state_reason)
    if instance.tags.get(TAG_RESULT):
        parts.append(f"result={instance.tags[TAG_RESULT]}")
    if instance.state_reason == SELF_SHUTDOWN_REASON and not instance.tags.get(TAG_RESULT):
        parts.append("no spotsched:result tag: give the instance profile ec2:CreateTags and install the AWS CLI")
    elif instance.state in _GONE and not instance.tags.get(TAG_RELEASED) and not instance.tags.get(TAG_RESULT):
        parts.append("ended outside spotsched")
    return ", ".join(parts)
