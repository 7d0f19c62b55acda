"""The EC2 backend against a moto server on loopback: launch, scale, preempt, re-attach, release.

Every call goes through a real boto3 client and HTTP, so the request parameters checked here are
the ones EC2 would receive. Moto neither runs user data nor produces capacity errors or spot
interruptions: capacity errors are injected as real ``ClientError`` responses, and a preemption is
an instance terminated from outside the backend.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from airflow_provider_spotsched.backends.base import (
    ON_DEMAND,
    BackendError,
    InstanceState,
    InsufficientCapacityError,
    TrainingJob,
)
from airflow_provider_spotsched.backends.bootstrap import HF_TOKEN_SECRET
from airflow_provider_spotsched.backends.ec2 import RENDEZVOUS_PAUSES_S, SPOT_PREEMPTION_REASON, Ec2Backend, Ec2Placement
from airflow_provider_spotsched.market.launch import LaunchOutcome
from airflow_provider_spotsched.scheduling.model import Allocation
from tests.moto_server import FAKE_CREDENTIALS, moto_endpoint  # noqa: F401 (a fixture)

POOLS = ("us-east-1a", "us-east-1b")
IMAGE_ID = "ami-03cf127a"  # one of the images moto ships (listing them all takes seconds)
COMMAND = ("spotsched-train", "--config", "s3://bucket/job/config.json", "--checkpoint-uri", "s3://bucket/job/ckpt")


class RecordingClient:
    """A boto3 EC2 client that records the calls that change things and can refuse launches.

    ``no_capacity`` names AZs whose spot launches fail with a real ``InsufficientInstanceCapacity``
    error response, the way EC2 answers when a pool is short. ``no_address_at_launch`` drops the
    private IPs from ``run_instances``' answer, as EC2 may before it assigns them.
    ``not_yet_visible`` fails the next ``create_tags`` calls whatever they name; ``unknown_to_tags``
    maps an instance id to the ``create_tags`` calls naming it that still fail, and
    ``unknown_to_all`` names ids that ``create_tags`` and ``terminate_instances`` never find; a
    failed call changes nothing, as on EC2. ``stuck_pending`` names instances that
    ``describe_instances`` shows ``pending`` while moto runs them (an AZ that accepted the launch
    but has no host to start it on). ``interrupted`` names instances that ``describe_instances``
    shows with the spot interruption's ``StateReason`` (moto has no interruptions).
    """

    def __init__(
        self, client: Any, no_capacity: tuple[str, ...] = (), error_code: str = "InsufficientInstanceCapacity"
    ) -> None:
        self._client = client
        self.no_capacity = no_capacity
        self.error_code = error_code
        self.launches: list[dict[str, Any]] = []
        self.terminations: list[list[str]] = []
        self.tag_calls: list[dict[str, Any]] = []
        self.not_yet_visible = 0  # the next create_tags calls that find no instance yet
        self.unknown_to_tags: dict[str, int] = {}
        self.unknown_to_all: set[str] = set()
        self.no_address_at_launch = False
        self.stuck_pending: set[str] = set()
        self.interrupted: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def run_instances(self, **params: Any) -> dict[str, Any]:
        self.launches.append(params)
        az = params.get("Placement", {}).get("AvailabilityZone")
        if az in self.no_capacity:
            error = {"Code": self.error_code, "Message": f"We currently do not have sufficient capacity in {az}."}
            raise ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": 500}}, "RunInstances")
        response = self._client.run_instances(**params)
        if self.no_address_at_launch:
            for instance in response["Instances"]:
                instance.pop("PrivateIpAddress", None)
        return response

    def get_paginator(self, name: str) -> Any:
        paginator = self._client.get_paginator(name)
        stuck, interrupted = self.stuck_pending, self.interrupted

        class StuckPending:
            def paginate(self, **params: Any) -> Iterator[dict[str, Any]]:
                for page in paginator.paginate(**params):
                    for reservation in page.get("Reservations", []):
                        for instance in reservation["Instances"]:
                            if instance["InstanceId"] in stuck and instance["State"]["Name"] == "running":
                                instance["State"] = {"Code": 0, "Name": "pending"}
                            if instance["InstanceId"] in interrupted:
                                instance["StateReason"] = {"Code": SPOT_PREEMPTION_REASON, "Message": "Spot interruption"}
                    yield page

        return StuckPending() if name == "describe_instances" else paginator

    def terminate_instances(self, **params: Any) -> dict[str, Any]:
        unknown = [i for i in params["InstanceIds"] if i in self.unknown_to_all]
        if unknown:
            raise not_found(unknown[0], "TerminateInstances")
        self.terminations.append(list(params["InstanceIds"]))
        return self._client.terminate_instances(**params)

    def create_tags(self, **params: Any) -> dict[str, Any]:
        self.tag_calls.append(params)
        if self.not_yet_visible:  # as EC2 answers about an instance launched a moment ago
            self.not_yet_visible -= 1
            raise not_found(params["Resources"][0], "CreateTags")
        unknown = [i for i in params["Resources"] if self.unknown_to_tags.get(i) or i in self.unknown_to_all]
        for instance_id in params["Resources"]:
            if self.unknown_to_tags.get(instance_id):
                self.unknown_to_tags[instance_id] -= 1
        if unknown:
            raise not_found(unknown[0], "CreateTags")
        return self._client.create_tags(**params)


def not_found(instance_id: str, operation: str) -> ClientError:
    error = {"Code": "InvalidInstanceID.NotFound", "Message": f"The instance ID '{instance_id}' does not exist"}
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": 400}}, operation)


@pytest.fixture
def ec2(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An EC2 client on the moto server, with the instance profile the backend names.

    The server is not reset between tests (rebuilding moto's EC2 defaults takes seconds): every
    test runs its own job id, and the backend only ever sees its job's instances.
    """
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    iam = boto3.client("iam", endpoint_url=moto_endpoint, region_name="us-east-1")
    try:
        iam.create_instance_profile(InstanceProfileName="spotsched-trainer")
    except iam.exceptions.EntityAlreadyExistsException:
        pass
    return boto3.client("ec2", endpoint_url=moto_endpoint, region_name="us-east-1")


@pytest.fixture
def job(request: pytest.FixtureRequest) -> TrainingJob:
    """A job whose id is unique to the test, with a dot and an underscore as Airflow ids have."""
    return TrainingJob(
        job_id=f"dag.train__{request.node.name[5:60]}",
        command=COMMAND,
        checkpoint_uri="s3://bucket/job/ckpt",
        pools=POOLS,
        env={"HF_HUB_OFFLINE": "1"},
    )


@pytest.fixture
def client(ec2: Any) -> RecordingClient:
    return RecordingClient(ec2)


def subnet_in(ec2: Any, az: str) -> str:
    subnets = ec2.describe_subnets(Filters=[{"Name": "availability-zone", "Values": [az]}])["Subnets"]
    return subnets[0]["SubnetId"]


def make_backend(client: Any, **overrides: Any) -> Ec2Backend:
    vpc = client.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    groups = client.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]
    params: dict[str, Any] = {
        "instance_type": "p3.2xlarge",
        "image_id": IMAGE_ID,
        "pools": {"us-east-1a": "us-east-1a", "us-east-1b": subnet_in(client, "us-east-1b")},
        "on_demand": "us-east-1c",
        "iam_instance_profile": "spotsched-trainer",
        "security_group_ids": [groups[0]["GroupId"]],
    }
    return Ec2Backend(client, **(params | overrides))


def described(ec2: Any, job: TrainingJob) -> dict[str, dict[str, Any]]:
    """Every instance carrying the job's tag, by id, with its tags as a dict."""
    pages = ec2.get_paginator("describe_instances").paginate(
        Filters=[{"Name": "tag:spotsched:job-id", "Values": [job.job_id]}]
    )
    out = {}
    for page in pages:
        for reservation in page["Reservations"]:
            for inst in reservation["Instances"]:
                inst["TagMap"] = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                out[inst["InstanceId"]] = inst
    return out


def live(ec2: Any, job: TrainingJob) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in described(ec2, job).items() if v["State"]["Name"] in ("pending", "running")}


def user_data_of(ec2: Any, instance_id: str) -> str:
    value = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")["UserData"]["Value"]
    return base64.b64decode(value).decode()


def test_launch_sends_market_options_tags_placement_and_user_data(client, ec2, job):
    backend = make_backend(client)
    status = backend.reconcile(job, Allocation((2, 1), 1))

    assert status.active(POOLS) == Allocation((2, 1), 1)
    assert len(client.launches) == 4 and len({p["ClientToken"] for p in client.launches}) == 4
    by_pool: dict[str, list[dict[str, Any]]] = {}
    for params in client.launches:
        tags = {t["Key"]: t["Value"] for t in params["TagSpecifications"][0]["Tags"]}
        assert tags["spotsched:job-id"] == job.job_id and tags["spotsched:generation"] == "1"
        by_pool.setdefault(tags["spotsched:pool"], []).append(params)
        assert params["MinCount"] == params["MaxCount"] == 1
        assert params["InstanceInitiatedShutdownBehavior"] == "terminate"
        assert params["MetadataOptions"]["InstanceMetadataTags"] == "enabled"
        assert params["IamInstanceProfile"] == {"Name": "spotsched-trainer"}
        if tags["spotsched:pool"] == ON_DEMAND:
            assert "InstanceMarketOptions" not in params and tags["spotsched:capacity"] == "on-demand"
        else:
            assert params["InstanceMarketOptions"] == {
                "MarketType": "spot",
                "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
            }
            assert tags["spotsched:capacity"] == "spot"
    assert {p["Placement"]["AvailabilityZone"] for p in by_pool["us-east-1a"]} == {"us-east-1a"}
    assert {p["SubnetId"] for p in by_pool["us-east-1b"]} == {subnet_in(ec2, "us-east-1b")}
    assert by_pool[ON_DEMAND][0]["Placement"] == {"AvailabilityZone": "us-east-1c"}

    instances = live(ec2, job)
    assert len(instances) == 4
    zones = sorted(i["Placement"]["AvailabilityZone"] for i in instances.values())
    assert zones == ["us-east-1a", "us-east-1a", "us-east-1b", "us-east-1c"]
    assert sum(i.get("InstanceLifecycle") == "spot" for i in instances.values()) == 3
    script = user_data_of(ec2, next(iter(instances)))
    assert script.startswith("#!/bin/bash")
    assert "export SPOTSCHED_NOTICE=aws" in script and "export HF_HUB_OFFLINE=1" in script
    assert f"COMMAND=({' '.join(COMMAND)})" in script
    assert "tags/instance/spotsched:$1" in script  # the rendezvous comes from the instance's own tags


def test_user_data_carries_no_credential(client, ec2, job):
    make_backend(client).reconcile(job, Allocation((1, 0), 0))
    script = user_data_of(ec2, next(iter(live(ec2, job))))
    for name, value in FAKE_CREDENTIALS.items():
        if name != "AWS_DEFAULT_REGION":
            assert name not in script and f"={value}" not in script
    assert not re.search(r"(AKIA|ASIA)[0-9A-Z]{16}|aws_secret|secret_access|session_token|password", script, re.I)
    assert not re.search(r"\bconn(ection)?_id\b|login|extra", script, re.I)


def test_user_data_names_the_hugging_face_token_secret_and_holds_no_credential(client, ec2, job):
    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:hf-token-AbCdEf"
    with_secret = TrainingJob(job.job_id, job.command, job.checkpoint_uri, POOLS, env={HF_TOKEN_SECRET: arn})
    make_backend(client).reconcile(with_secret, Allocation((1, 0), 0))
    script = user_data_of(ec2, next(iter(live(ec2, with_secret))))
    assert f"export {HF_TOKEN_SECRET}={arn}" in script and "COMMAND=(with_hf_token spotsched-train" in script
    assert "LOGS_URI=s3://bucket/job/ckpt/logs" in script
    for name, value in FAKE_CREDENTIALS.items():
        if name != "AWS_DEFAULT_REGION":
            assert name not in script and f"={value}" not in script


def test_a_credential_in_the_job_env_is_refused_before_anything_launches(client, ec2, job):
    leaky = TrainingJob(job.job_id, job.command, job.checkpoint_uri, POOLS, env={"AWS_SECRET_ACCESS_KEY": "x"})
    with pytest.raises(BackendError, match="instance profile"):
        make_backend(client).reconcile(leaky, Allocation((1, 0), 0))
    hidden = TrainingJob(job.job_id, job.command, job.checkpoint_uri, POOLS, env={"S3_KEY": "AKIAABCDEFGHIJKLMNOP"})
    with pytest.raises(BackendError, match="looks like a credential"):
        make_backend(client).reconcile(hidden, Allocation((1, 0), 0))
    assert client.launches == [] and live(ec2, job) == {}


def test_check_job_refuses_what_a_later_launch_would_before_any_call_to_ec2(client, ec2, job):
    """The driver checks a new run with it before storing anything: an unplaced pool that a later
    slot would pick, or a start-up script the first launch would refuse, is an error now."""
    backend = make_backend(client)
    backend.check_job(job)
    unplaced = TrainingJob(job.job_id, job.command, job.checkpoint_uri, (*POOLS, "eu-west-1a"), env=job.env)
    with pytest.raises(BackendError, match=r"pools \['eu-west-1a'\] have no placement"):
        backend.check_job(unplaced)
    not_a_reference = TrainingJob(job.job_id, job.command, job.checkpoint_uri, POOLS,
                                  env={"SPOTSCHED_HF_TOKEN_SECRET": "my-hf-secret"})
    with pytest.raises(BackendError, match="is not a secret reference on aws"):
        backend.check_job(not_a_reference)
    assert client.launches == [] and client.tag_calls == [] and live(ec2, job) == {}


def test_rendezvous_tags_rank_the_instances_oldest_first_with_its_address_as_master(client, ec2, job):
    make_backend(client).reconcile(job, Allocation((2, 0), 1))
    instances = sorted(live(ec2, job).values(), key=lambda i: (i["LaunchTime"], i["InstanceId"]))
    tags = [i["TagMap"] for i in instances]
    assert [t["spotsched:rank"] for t in tags] == ["0", "1", "2"]
    assert {t["spotsched:world-size"] for t in tags} == {"3"}
    assert {t["spotsched:master-addr"] for t in tags} == {instances[0]["PrivateIpAddress"]}
    assert {t["spotsched:master-port"] for t in tags} == {"29500"}
    assert len({t["spotsched:generation"] for t in tags}) == 1 and tags[0]["spotsched:generation"] != "1"


def published(ec2: Any, job: TrainingJob) -> list[dict[str, str]]:
    """The tags of the job's live instances, oldest first, once each carries the full rendezvous."""
    instances = sorted(live(ec2, job).values(), key=lambda i: (i["LaunchTime"], i["InstanceId"]))
    tags = [i["TagMap"] for i in instances]
    assert [t.get("spotsched:rank") for t in tags] == [str(r) for r in range(len(tags))]
    assert {t.get("spotsched:world-size") for t in tags} == {str(len(tags))}
    assert {t.get("spotsched:master-addr") for t in tags} == {instances[0]["PrivateIpAddress"]}
    assert {t.get("spotsched:master-port") for t in tags} == {"29500"}
    assert len({t["spotsched:generation"] for t in tags}) == 1 and tags[0]["spotsched:generation"] != "1"
    return tags


def test_an_instance_briefly_invisible_to_create_tags_gets_its_rendezvous_in_the_same_reconcile(client, ec2, job):
    sleeps: list[float] = []
    backend = make_backend(client, sleep=sleeps.append)
    client.not_yet_visible = 2
    backend.reconcile(job, Allocation((2, 0), 1))
    published(ec2, job)  # not a slot later: the instances would wait for it, billed
    assert sleeps == [1.0, 2.0] and len(client.tag_calls) == 3 + 2
    assert client.terminations == []


def test_instances_launched_without_an_address_get_their_rendezvous_in_the_same_reconcile(client, ec2, job):
    sleeps: list[float] = []
    backend = make_backend(client, sleep=sleeps.append)
    client.no_address_at_launch = True
    backend.reconcile(job, Allocation((2, 0), 1))
    published(ec2, job)  # the addresses come from describe_instances
    assert sleeps == []


def test_an_instance_invisible_past_the_retries_delays_the_rendezvous_and_fails_nothing(client, ec2, job):
    sleeps: list[float] = []
    backend = make_backend(client, sleep=sleeps.append)
    client.not_yet_visible = len(RENDEZVOUS_PAUSES_S) + 1
    status = backend.reconcile(job, Allocation((2, 0), 1))  # no error: the job is not released
    assert len(live(ec2, job)) == 3 and client.terminations == [] and status.active(job.pools) == Allocation((2, 0), 1)
    assert sleeps == list(RENDEZVOUS_PAUSES_S) and 25 <= sum(sleeps) <= 40  # about half a minute, then deferred
    assert not any("spotsched:rank" in i["TagMap"] for i in live(ec2, job).values())
    backend.reconcile(job, Allocation((2, 0), 1))  # the next slot's reconcile publishes it
    published(ec2, job)
    assert len(client.launches) == 3 and len(sleeps) == len(RENDEZVOUS_PAUSES_S)


def test_the_same_reconcile_twice_launches_and_ends_nothing(client, ec2, job):
    backend = make_backend(client)
    first = backend.reconcile(job, Allocation((1, 1), 1))
    launches, tag_calls = len(client.launches), len(client.tag_calls)
    second = backend.reconcile(job, Allocation((1, 1), 1))
    assert len(client.launches) == launches == 3
    assert len(client.tag_calls) == tag_calls  # the rendezvous stands: no new generation
    assert client.terminations == []
    assert {i.instance_id for i in second.instances} == {i.instance_id for i in first.instances}


def test_scale_down_ends_the_newest_of_the_shrunk_pool_and_scale_up_adds_on_demand(client, ec2, job):
    backend = make_backend(client)
    backend.reconcile(job, Allocation((3, 0), 0))
    pool_a = sorted(live(ec2, job).values(), key=lambda i: (i["LaunchTime"], i["InstanceId"]))
    time.sleep(1.1)  # LaunchTime has whole seconds: the on-demand instance must be the younger, not a tie
    status = backend.reconcile(job, Allocation((1, 0), 1))

    ended = {i for call in client.terminations for i in call}
    assert ended == {pool_a[1]["InstanceId"], pool_a[2]["InstanceId"]}
    assert status.active(POOLS) == Allocation((1, 0), 1)
    assert status.count(InstanceState.RELEASED) == 2 and status.preemptions == 0
    instances = described(ec2, job)
    assert all(instances[i]["TagMap"]["spotsched:released"] == "true" for i in ended)
    now = live(ec2, job)
    assert {i["TagMap"]["spotsched:world-size"] for i in now.values()} == {"2"}
    assert now[pool_a[0]["InstanceId"]]["TagMap"]["spotsched:rank"] == "0"  # the oldest stays master


def test_an_instance_terminated_from_outside_is_a_preemption_and_is_replaced(client, ec2, job):
    backend = make_backend(client)
    backend.reconcile(job, Allocation((2, 0), 0))
    victim = sorted(live(ec2, job))[0]
    ec2.terminate_instances(InstanceIds=[victim])  # AWS (or someone) took it back

    status = backend.status(job)
    taken = [i for i in status.instances if i.instance_id == victim][0]
    assert taken.state is InstanceState.PREEMPTED and "ended outside spotsched" in taken.detail
    assert status.active(POOLS) == Allocation((1, 0), 0)

    after = backend.reconcile(job, Allocation((2, 0), 0))
    assert after.active(POOLS) == Allocation((2, 0), 0) and after.preemptions == 1
    assert len(client.launches) == 3
    assert {i["TagMap"]["spotsched:world-size"] for i in live(ec2, job).values()} == {"2"}


def test_an_interrupted_spot_instance_that_tagged_a_failure_is_a_preemption_and_is_replaced(client, ec2, job):
    # a custom torchrun command exits 1 on the interruption's SIGTERM and the script tags failed-1
    backend = make_backend(client)
    backend.reconcile(job, Allocation((2, 0), 0))
    victim = sorted(live(ec2, job))[0]
    ec2.create_tags(Resources=[victim], Tags=[{"Key": "spotsched:result", "Value": "failed-1"}])
    ec2.terminate_instances(InstanceIds=[victim])
    client.interrupted.add(victim)

    taken = [i for i in backend.status(job).instances if i.instance_id == victim][0]
    assert taken.state is InstanceState.PREEMPTED and "result=failed-1" in taken.detail and not taken.inferred
    assert taken.tagged_result == "failed-1"  # the driver trusts this field, not the detail's text
    after = backend.reconcile(job, Allocation((2, 0), 0))
    assert after.active(POOLS) == Allocation((2, 0), 0) and after.preemptions == 1 and not after.failed
    assert len(client.launches) == 3


def test_a_spot_instance_gone_without_a_result_or_the_interruption_reason_is_an_inferred_preemption(client, ec2, job):
    # no spotsched:result tag and no Server.SpotInstanceTermination (terminated from outside, or
    # shutting down before its reason shows): a failed command that could not tag itself looks the
    # same, so the driver lets the result stored beside the log decide
    backend = make_backend(client)
    backend.reconcile(job, Allocation((1, 0), 0))
    (victim,) = live(ec2, job)
    ec2.terminate_instances(InstanceIds=[victim])

    (gone,) = backend.status(job).instances
    assert gone.state is InstanceState.PREEMPTED and gone.inferred


def test_a_terminated_on_demand_instance_failed_and_a_result_tag_finishes_the_job(client, ec2, job):
    backend = make_backend(client)
    backend.reconcile(job, Allocation((1, 0), 1))
    ids = {i.pool: i.instance_id for i in backend.status(job).instances}
    ec2.terminate_instances(InstanceIds=[ids[ON_DEMAND]])
    ec2.create_tags(Resources=[ids["us-east-1a"]], Tags=[{"Key": "spotsched:result", "Value": "done"}])

    status = backend.status(job)
    states = {i.pool: i.state for i in status.instances}
    assert states == {ON_DEMAND: InstanceState.FAILED, "us-east-1a": InstanceState.FINISHED}
    assert status.finished
    launches = len(client.launches)
    backend.reconcile(job, Allocation((1, 0), 1))
    assert len(client.launches) == launches  # the work is done: nothing is relaunched


def test_a_new_backend_reattaches_to_running_instances_instead_of_launching(client, ec2, job):
    make_backend(client).reconcile(job, Allocation((1, 1), 0))
    before = set(live(ec2, job))
    retried = RecordingClient(ec2)  # a retried Airflow task: new client, new backend, same job id
    status = make_backend(retried).reconcile(job, Allocation((1, 1), 0))
    assert retried.launches == [] and retried.terminations == []
    assert {i.instance_id for i in status.instances} == before == set(live(ec2, job))


def test_release_ends_everything_is_safe_to_repeat_and_needs_only_the_job_id(client, ec2, job):
    make_backend(client).reconcile(job, Allocation((2, 1), 1))
    other = TrainingJob(f"{job.job_id}-other", job.command, job.checkpoint_uri, POOLS)
    make_backend(client).reconcile(other, Allocation((1, 0), 0))

    after_crash = make_backend(RecordingClient(ec2))  # the caller that launched is gone
    after_crash.release(job)
    assert live(ec2, job) == {}
    assert len(live(ec2, other)) == 1  # another job's instances are not touched
    status = after_crash.status(job)
    assert {i.state for i in status.instances} == {InstanceState.RELEASED} and len(status.instances) == 4
    after_crash.release(job)
    after_crash.release(TrainingJob(f"{job.job_id}-never", job.command, job.checkpoint_uri, POOLS))
    assert live(ec2, job) == {}


def test_release_ends_every_instance_when_create_tags_does_not_know_a_fresh_one_yet(client, ec2, job):
    sleeps: list[float] = []
    backend = make_backend(client, sleep=sleeps.append)
    backend.reconcile(job, Allocation((2, 0), 1))
    fresh = sorted(live(ec2, job))[-1]  # as if launched a moment ago
    client.unknown_to_tags[fresh] = 3  # the whole batch, then the fresh one alone, then its first retry

    backend.release(job)
    assert live(ec2, job) == {}
    assert fresh not in client.terminations[0] and len(client.terminations[0]) == 2  # the others did not wait for it
    assert client.terminations[1:] == [[fresh]] and sleeps == [1.0, 2.0]
    assert {i["TagMap"].get("spotsched:released") for i in described(ec2, job).values()} == {"true"}
    status = backend.status(job)
    assert {i.state for i in status.instances} == {InstanceState.RELEASED} and status.preemptions == 0


def test_release_ends_what_ec2_knows_and_names_what_it_never_finds(client, ec2, job):
    sleeps: list[float] = []
    backend = make_backend(client, sleep=sleeps.append)
    backend.reconcile(job, Allocation((3, 0), 0))
    known, untaggable, unknown = sorted(live(ec2, job))
    client.unknown_to_tags[untaggable] = 1000  # create_tags never finds it, terminate_instances does
    client.unknown_to_all.add(unknown)

    with pytest.raises(BackendError, match=rf"could not terminate instance\(s\) {unknown}: .*NotFound"):
        backend.release(job)
    assert sleeps == list(RENDEZVOUS_PAUSES_S)
    assert set(live(ec2, job)) == {unknown}  # may still run: the error says so
    tags = {k: v["TagMap"] for k, v in described(ec2, job).items()}
    assert tags[known]["spotsched:released"] == "true"
    assert "spotsched:released" not in tags[untaggable]  # ended all the same, untagged


def test_a_scale_down_interrupted_between_tag_and_terminate_is_finished_by_the_next_reconcile(client, ec2, job):
    backend = make_backend(client)
    backend.reconcile(job, Allocation((2, 0), 0))
    half_done = sorted(live(ec2, job))[0]
    ec2.create_tags(Resources=[half_done], Tags=[{"Key": "spotsched:released", "Value": "true"}])

    status = backend.reconcile(job, Allocation((2, 0), 0))
    assert half_done not in live(ec2, job)
    assert status.active(POOLS) == Allocation((2, 0), 0) and len(live(ec2, job)) == 2


def test_a_pool_out_of_capacity_is_recorded_and_the_rest_is_launched(ec2, job):
    outcomes: list[LaunchOutcome] = []
    client = RecordingClient(ec2, no_capacity=("us-east-1a",))
    status = make_backend(client, recorder=outcomes.append).reconcile(job, Allocation((2, 1), 1))

    assert status.active(POOLS) == Allocation((0, 1), 1)
    recorded = {o.pool: (o.requested, o.launched, o.reason) for o in outcomes}
    assert recorded == {
        "us-east-1a": (2, 0, "InsufficientInstanceCapacity"),
        "us-east-1b": (1, 1, ""),
        ON_DEMAND: (1, 1, ""),
    }
    assert sum(1 for p in client.launches if p.get("Placement", {}).get("AvailabilityZone") == "us-east-1a") == 1


def test_no_capacity_anywhere_raises_and_leaves_nothing_running(ec2, job):
    outcomes: list[LaunchOutcome] = []
    client = RecordingClient(ec2, no_capacity=("us-east-1a",), error_code="SpotMaxPriceTooLow")
    with pytest.raises(InsufficientCapacityError, match=r"us-east-1a.*asked for 2.*got 0.*SpotMaxPriceTooLow"):
        make_backend(client, recorder=outcomes.append).reconcile(job, Allocation((2, 0), 0))
    assert outcomes[0].launched == 0 and outcomes[0].reason == "SpotMaxPriceTooLow"
    assert live(ec2, job) == {}


def test_an_instance_stuck_pending_past_pending_timeout_s_is_terminated_and_its_pool_reported_short(
    client, ec2, job
):
    later = [timedelta(0)]
    outcomes: list[LaunchOutcome] = []
    backend = make_backend(client, recorder=outcomes.append, clock=lambda: datetime.now(timezone.utc) + later[0])
    backend.reconcile(job, Allocation((1, 0), 1))
    stuck = next(i for i, data in live(ec2, job).items() if data["TagMap"]["spotsched:pool"] == "us-east-1a")
    client.stuck_pending.add(stuck)

    later[0] = timedelta(minutes=14)  # within the default 15 minutes: a slow start, left alone
    assert backend.reconcile(job, Allocation((1, 0), 1)).active(POOLS) == Allocation((1, 0), 1)
    assert client.terminations == []

    later[0] = timedelta(minutes=16)
    outcomes.clear()
    status = backend.reconcile(job, Allocation((1, 0), 1))
    assert client.terminations == [[stuck]] and described(ec2, job)[stuck]["TagMap"]["spotsched:released"] == "true"
    states = {i.pool: i.state for i in status.instances}
    assert states == {"us-east-1a": InstanceState.RELEASED, ON_DEMAND: InstanceState.RUNNING}
    assert status.active(POOLS) == Allocation((0, 0), 1) and status.preemptions == 0
    assert [(o.pool, o.requested, o.launched, o.reason) for o in outcomes] == [("us-east-1a", 1, 0, "PendingTimeout")]
    assert len(client.launches) == 2  # the AZ that left it waiting is not asked again in the same call
    assert {i["TagMap"]["spotsched:world-size"] for i in live(ec2, job).values()} == {"1"}
    assert make_backend(client).status(job).preemptions == 0  # no work ran on it: nothing lost

    status = backend.reconcile(job, Allocation((1, 0), 1))  # the next slot may ask the AZ again: once
    assert len(client.launches) == 3 and status.active(POOLS) == Allocation((1, 0), 1)


def test_other_launch_errors_and_unplaced_pools_are_clear_errors(ec2, job):
    class Unauthorized(RecordingClient):
        def run_instances(self, **params: Any) -> dict[str, Any]:
            error = {"Code": "UnauthorizedOperation", "Message": "You are not authorized to perform this operation."}
            raise ClientError({"Error": error}, "RunInstances")

    with pytest.raises(BackendError, match="UnauthorizedOperation: You are not authorized"):
        make_backend(Unauthorized(ec2)).reconcile(job, Allocation((1, 0), 0))
    with pytest.raises(BackendError, match=r"pools \['us-east-1b'\] have no placement"):
        make_backend(RecordingClient(ec2), pools={"us-east-1a": "us-east-1a"}).reconcile(job, Allocation((1, 1), 0))
    with pytest.raises(ValueError, match="needs subnet_id or availability_zone"):
        Ec2Placement()
    with pytest.raises(ValueError, match="master_port"):
        make_backend(RecordingClient(ec2), master_port=0)
    with pytest.raises(ValueError, match=r"pending_timeout_s must be a number of seconds >= 60"):
        make_backend(RecordingClient(ec2), pending_timeout_s=0)
