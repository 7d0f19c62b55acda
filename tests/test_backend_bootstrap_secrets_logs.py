"""The start-up script's secrets and log sections, run by bash against fakes on loopback.

GCP: a fake metadata server (rendezvous, the service account's access token) and a fake Secret
Manager that hands the secret only for that token. AWS: the secret lives in moto's Secrets
Manager; ``aws`` is a stand-in that answers ``secretsmanager get-secret-value`` from moto with
boto3 (as the AWS CLI would with the instance profile) and records every other call. Each test
checks that the token reaches the training command, and nothing else: not the script, not its log.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
import pytest

from airflow_provider_spotsched.backends.base import BackendError, TrainingJob
from airflow_provider_spotsched.backends.bootstrap import EXIT_NO_SECRET, HF_TOKEN_SECRET, METADATA_TIMEOUT_ENV, startup_script
from airflow_provider_spotsched.runtime.contract import RESULT_FILE, log_uri, read_log_tail, read_result
from tests.loopback_http import QuietHandler, serving
from tests.moto_server import FAKE_CREDENTIALS, moto_endpoint  # noqa: F401 (a fixture)
from tests.test_backend_bootstrap import lines, wait_for

TOKEN = "hf_fake0123456789abcdefTOKEN"
GCP_SECRET = "projects/p1/secrets/hf-token/versions/latest"
ACCESS_TOKEN = "ya29.instance-access-token"
INSTANCE = "ss-job-g1-p0-0"

# A training command: keeps the token it got (a file of the test's), writes a log line, exits with $RC.
WORKER = 'echo "${HF_TOKEN:-none}" > "$OUT/got-token"; echo "step 1 loss 2.5"; echo "Traceback: CUDA out of memory" >&2; exit "$RC"'


@pytest.fixture
def gcp() -> Iterator[tuple[dict[str, str], str]]:
    """Metadata (rendezvous and access token) and Secret Manager on one loopback server."""
    attributes: dict[str, str] = {"generation": "1", "rank": "0", "world-size": "1"}

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            status, body = 404, "not found"
            if self.path.startswith("/computeMetadata/v1/instance/") and self.headers.get("Metadata-Flavor") == "Google":
                key = self.path.removeprefix("/computeMetadata/v1/instance/")
                values = {
                    "name": INSTANCE,
                    "zone": "projects/1/zones/us-central1-a",
                    "service-accounts/default/token": json.dumps({"access_token": ACCESS_TOKEN}),
                }
                value = values.get(key) or attributes.get(key.removeprefix("attributes/spotsched-"))
                status, body = (200, value) if value is not None else (404, "not found")
            elif self.path == f"/v1/{GCP_SECRET}:access":
                if self.headers.get("Authorization") == f"Bearer {ACCESS_TOKEN}":
                    status = 200
                    body = json.dumps({"name": GCP_SECRET, "payload": {"data": base64.b64encode(TOKEN.encode()).decode()}})
                else:
                    status, body = 403, "permission denied"
            self.reply(status, body)

    with serving(Handler) as url:
        yield attributes, url


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(body)
    path.chmod(0o755)


def run_script(tmp_path: Path, job: TrainingJob, provider: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "startup.sh"
    script.write_text(startup_script(job, provider, poll_seconds=1))  # type: ignore[arg-type]
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)


def job_env(tmp_path: Path, bin_dir: Path, url: str, rc: int, **extra: str) -> dict[str, str]:
    return {
        "OUT": str(tmp_path),
        "RC": str(rc),
        "SPOTSCHED_METADATA_URL": url,
        "SPOTSCHED_LOG": str(tmp_path / "train.log"),
        "SPOTSCHED_POWEROFF": f"touch {tmp_path}/powered-off",
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        **extra,
    }


def test_gcp_reads_the_token_with_the_service_account_and_uploads_the_log_before_reporting(tmp_path, gcp):
    _, url = gcp
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "gcloud", f'#!/bin/bash\necho "$@" >> {tmp_path}/gcloud\n')
    checkpoint = tmp_path / "ckpt"
    env = job_env(tmp_path, bin_dir, url, 1, SPOTSCHED_SM_ENDPOINT=url, **{HF_TOKEN_SECRET: GCP_SECRET})
    job = TrainingJob("job-1", ("bash", "-c", WORKER), str(checkpoint), ("us-central1-a",), env=env)
    script = startup_script(job, "gcp")
    assert TOKEN not in script and GCP_SECRET in script

    result = run_script(tmp_path, job, "gcp")

    assert result.returncode == 1
    assert lines(tmp_path / "got-token") == [TOKEN]
    assert lines(tmp_path / "gcloud")[-1].endswith("--labels spotsched-result=failed-1 --quiet")
    tail = read_log_tail(str(checkpoint), INSTANCE)
    assert tail is not None and "CUDA out of memory" in tail and "step 1 loss 2.5" in tail
    assert Path(log_uri(str(checkpoint), INSTANCE)).exists()
    assert read_result(str(checkpoint), INSTANCE) == "failed-1"
    for text in (tail, result.stdout, result.stderr):
        assert TOKEN not in text and ACCESS_TOKEN not in text


def test_gcp_a_secret_the_instance_may_not_read_fails_the_command_naming_the_secret(tmp_path, gcp):
    _, url = gcp
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "gcloud", f'#!/bin/bash\necho "$@" >> {tmp_path}/gcloud\n')
    other = "projects/p1/secrets/not-granted/versions/1"
    env = job_env(tmp_path, bin_dir, url, 0, SPOTSCHED_SM_ENDPOINT=url, **{HF_TOKEN_SECRET: other})
    job = TrainingJob("job-1", ("bash", "-c", WORKER), str(tmp_path / "ckpt"), ("us-central1-a",), env=env)

    result = run_script(tmp_path, job, "gcp")

    assert result.returncode == EXIT_NO_SECRET
    assert not (tmp_path / "got-token").exists()  # the command never started
    assert lines(tmp_path / "gcloud")[-1].endswith(f"spotsched-result=failed-{EXIT_NO_SECRET} --quiet")
    tail = read_log_tail(str(tmp_path / "ckpt"), INSTANCE)
    assert tail is not None and f"could not read the Hugging Face token from {other}" in tail


def test_a_vm_that_may_not_label_itself_still_stores_its_result_beside_its_log(tmp_path, gcp):
    """Without compute.instances.setLabels a spot VM that powered off reads as preempted: the run
    driver reads the result the script stored beside the log instead (tests/test_failure_log_tail.py)."""
    _, url = gcp
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "gcloud", f'#!/bin/bash\necho "$@" >> {tmp_path}/gcloud\n[ "$1" != compute ]\n')  # setLabels refused
    checkpoint = str(tmp_path / "ckpt")
    job = TrainingJob("job-1", ("bash", "-c", WORKER), checkpoint, ("us-central1-a",), env=job_env(tmp_path, bin_dir, url, 3))

    result = run_script(tmp_path, job, "gcp")

    assert result.returncode == 3 and (tmp_path / "powered-off").exists()
    assert "could not label the result failed-3" in result.stderr
    assert read_result(checkpoint, INSTANCE) == "failed-3"
    assert Path(log_uri(checkpoint, INSTANCE, RESULT_FILE)).read_text() == "failed-3\n"


def test_the_log_is_uploaded_periodically_and_when_the_script_is_stopped(tmp_path, gcp):
    _, url = gcp
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "gcloud", "#!/bin/bash\n")
    worker = 'trap "echo got-term; exit 75" TERM; echo started; while true; do sleep 0.1; done'
    env = job_env(tmp_path, bin_dir, url, 0, SPOTSCHED_LOG_UPLOAD_SECONDS="1")
    checkpoint = str(tmp_path / "ckpt")
    job = TrainingJob("job-1", ("bash", "-c", worker), checkpoint, ("us-central1-a",), env=env)
    script = tmp_path / "startup.sh"
    script.write_text(startup_script(job, "gcp", poll_seconds=1))
    process = subprocess.Popen(["bash", str(script)])
    try:
        wait_for(lambda: "started" in (read_log_tail(checkpoint, INSTANCE) or ""), "a periodic upload")
        process.terminate()  # a preemption's shutdown: TERM to the script
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "got-term" in (read_log_tail(checkpoint, INSTANCE) or "")  # uploaded after the command stopped


def test_the_uploader_leaves_no_process_behind_when_the_script_ends(tmp_path, gcp):
    _, url = gcp
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "gcloud", "#!/bin/bash\n")
    period = "3517"  # a period no other process sleeps, far longer than the run
    env = job_env(tmp_path, bin_dir, url, 0, SPOTSCHED_LOG_UPLOAD_SECONDS=period)
    job = TrainingJob("job-1", ("bash", "-c", WORKER), str(tmp_path / "ckpt"), ("us-central1-a",), env=env)

    result = run_script(tmp_path, job, "gcp")  # an orphaned sleep would hold its output open past the timeout

    assert result.returncode == 0
    assert (tmp_path / "powered-off").exists()
    left = [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p) == ["sleep", period]]
    assert not left, f"the uploader's sleep outlived the script: {left}"


def _cmdline(process: Path) -> list[str]:
    try:
        return (process / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


AWS_STAND_IN = """#!{python}
import json, sys
import boto3
args = sys.argv[1:]
if args[:2] == ["secretsmanager", "get-secret-value"]:
    get = lambda flag: args[args.index(flag) + 1]
    client = boto3.client("secretsmanager", region_name=get("--region"), endpoint_url="{endpoint}")
    print(client.get_secret_value(SecretId=get("--secret-id"))["SecretString"])
else:
    with open("{calls}", "a") as calls:
        calls.write(" ".join(args) + "\\n")
"""


@pytest.fixture
def aws_secret(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The token in moto's Secrets Manager; returns its ARN."""
    for name, value in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("secretsmanager", endpoint_url=moto_endpoint, region_name="eu-west-1")
    name = f"hf-token-{time.monotonic_ns()}"
    return client.create_secret(Name=name, SecretString=TOKEN)["ARN"]


def test_aws_reads_the_token_from_secrets_manager_in_the_secrets_region(tmp_path, moto_endpoint, aws_secret):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "aws", AWS_STAND_IN.format(python=sys.executable, endpoint=moto_endpoint, calls=tmp_path / "aws"))

    class Imds(QuietHandler):
        def do_PUT(self) -> None:
            self._answer("imds-token")

        def do_GET(self) -> None:
            values = {
                "instance-id": "i-0abc",
                "placement/region": "eu-west-1",
                **{f"tags/instance/spotsched:{k}": v for k, v in (("generation", "1"), ("rank", "0"), ("world-size", "1"))},
            }
            self._answer(values.get(self.path.removeprefix("/latest/meta-data/")))

        def _answer(self, value: str | None) -> None:
            self.reply(200 if value is not None else 404, value or "not found")

    with serving(Imds) as url:
        env = job_env(
            tmp_path,
            bin_dir,
            url,
            0,
            **{HF_TOKEN_SECRET: aws_secret, **{k: v for k, v in FAKE_CREDENTIALS.items() if k == "AWS_DEFAULT_REGION"}},
        )
        job = TrainingJob("job-1", ("bash", "-c", WORKER), "s3://bucket/ckpt", ("eu-west-1a",), env=env)
        assert TOKEN not in startup_script(job, "aws")
        result = run_script(tmp_path, job, "aws")
    assert result.returncode == 0
    assert lines(tmp_path / "got-token") == [TOKEN]
    upload = f"s3 cp --only-show-errors {tmp_path / 'train.log'} s3://bucket/ckpt/logs/i-0abc/train.log"
    calls = lines(tmp_path / "aws")
    # the log before the result is reported, the result beside it and on the instance, the log again as the script exits
    assert calls[0] == upload and calls[-1] == upload
    assert calls[1] == f"s3 cp --only-show-errors {tmp_path / 'train.log.result'} s3://bucket/ckpt/logs/i-0abc/result"
    assert calls[2].startswith("ec2 create-tags --region eu-west-1 --resources i-0abc --tags Key=spotsched:result,Value=done")
    assert TOKEN not in (tmp_path / "train.log").read_text() + result.stdout + result.stderr


def test_a_token_in_place_of_a_secret_reference_is_refused_with_the_fix():
    for provider, value in (("aws", TOKEN), ("gcp", TOKEN), ("aws", GCP_SECRET), ("gcp", "arn:aws:secretsmanager:x")):
        job = TrainingJob("job-1", ("train",), "ckpt", ("a",), env={HF_TOKEN_SECRET: value})
        with pytest.raises(BackendError, match="not a secret reference") as error:
            startup_script(job, provider)  # type: ignore[arg-type]
        assert TOKEN not in str(error.value)
    job = TrainingJob("job-1", ("train",), "ckpt", ("a",), env={HF_TOKEN_SECRET: "AKIAABCDEFGHIJKLMNOP"})
    with pytest.raises(BackendError, match="looks like a credential"):
        startup_script(job, "aws")


# What each cloud's metadata says about the instance being taken back: (status, body) per answer.
RECLAIM_ANSWERS = {
    "aws": {"preempted": (200, '{"action": "terminate", "time": "2024-01-01T00:02:00Z"}'), "not preempted": (404, "not found"),
            "unreadable": (500, "error")},
    "gcp": {"preempted": (200, "TRUE"), "not preempted": (200, "FALSE"), "unreadable": (500, "error")},
}
RENDEZVOUS = {"generation": "1", "rank": "0", "world-size": "1"}


@pytest.mark.parametrize("answer", ["preempted", "not preempted", "unreadable"])
@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_a_command_that_fails_while_the_cloud_takes_the_instance_back_reports_no_failure(tmp_path, provider, answer):
    """torchrun exits 1 on the SIGTERM of a preemption, possibly before the script is stopped: with
    the metadata saying the instance is being taken back, that is a preemption (no result, no power-off)."""
    status, body = RECLAIM_ANSWERS[provider][answer]

    class Metadata(QuietHandler):
        def do_PUT(self) -> None:
            self.reply(200, "imds-token")

        def do_GET(self) -> None:
            values = {
                "/latest/meta-data/instance-id": (200, "i-0abc"),
                "/latest/meta-data/placement/region": (200, "eu-west-1"),
                "/latest/meta-data/spot/instance-action": (status, body),
                "/computeMetadata/v1/instance/name": (200, INSTANCE),
                "/computeMetadata/v1/instance/zone": (200, "projects/1/zones/us-central1-a"),
                "/computeMetadata/v1/instance/preempted": (status, body),
                **{f"/latest/meta-data/tags/instance/spotsched:{k}": (200, v) for k, v in RENDEZVOUS.items()},
                **{f"/computeMetadata/v1/instance/attributes/spotsched-{k}": (200, v) for k, v in RENDEZVOUS.items()},
            }
            self.reply(*values.get(self.path, (404, "not found")))

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli = "aws" if provider == "aws" else "gcloud"
    stand_in(bin_dir, cli, f'#!/bin/bash\necho "$@" >> {tmp_path}/cli\n')
    checkpoint = str(tmp_path / "ckpt")
    with serving(Metadata) as url:
        job = TrainingJob("job-1", ("bash", "-c", WORKER), checkpoint, ("a",), env=job_env(tmp_path, bin_dir, url, 1))
        script = tmp_path / "startup.sh"
        script.write_text(startup_script(job, provider, poll_seconds=1))  # type: ignore[arg-type]
        process = subprocess.Popen(["bash", str(script)])
        name = "i-0abc" if provider == "aws" else INSTANCE
        try:
            if answer == "preempted":
                wait_for(lambda: "a preemption, not a failure" in (read_log_tail(checkpoint, name) or ""), "the uploaded log")
                process.terminate()  # the preemption's shutdown
            returncode = process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()

    if answer == "preempted":
        assert returncode == 0
        assert read_result(checkpoint, name) is None and not (tmp_path / "train.log.result").exists()
        assert lines(tmp_path / "cli") == [] and not (tmp_path / "powered-off").exists()
        assert "spotsched: the command exited 1 while the cloud takes this instance back" in (tmp_path / "train.log").read_text()
    else:  # not preempted, or metadata that cannot be read: the failure, as before
        assert returncode == 1 and (tmp_path / "powered-off").exists()
        assert read_result(checkpoint, name) == "failed-1"
        assert "failed-1" in lines(tmp_path / "cli")[-1]


# A metadata read the test lets hang is answered by nothing until the test ends; the script gives up after this.
LIMIT_S = "0.5"


@contextmanager
def metadata_that_hangs(hangs: Callable[[str], bool]) -> Iterator[str]:
    """Serve both clouds' metadata (an instance, a two-instance rendezvous) on loopback; a request
    whose path ``hangs`` is accepted and never answered. Yields the base URL."""
    rendezvous = {**RENDEZVOUS, "world-size": "2", "master-addr": "10.0.0.2", "master-port": "29500"}
    released = threading.Event()

    class Metadata(QuietHandler):
        def do_PUT(self) -> None:
            if not hangs(self.path):
                self.reply(200, "imds-token")
            else:
                released.wait(30)

        def do_GET(self) -> None:
            values = {
                "/latest/meta-data/instance-id": "i-0abc",
                "/latest/meta-data/placement/region": "eu-west-1",
                "/computeMetadata/v1/instance/name": INSTANCE,
                "/computeMetadata/v1/instance/zone": "projects/1/zones/us-central1-a",
                **{f"/latest/meta-data/tags/instance/spotsched:{k}": v for k, v in rendezvous.items()},
                **{f"/computeMetadata/v1/instance/attributes/spotsched-{k}": v for k, v in rendezvous.items()},
            }
            if not hangs(self.path):
                value = values.get(self.path)
                self.reply(200 if value is not None else 404, value or "not found")
            else:
                released.wait(30)

    with serving(Metadata) as url:
        try:
            yield url
        finally:
            released.set()


def script_functions(tmp_path: Path, provider: str, url: str, **env: str) -> str:
    """The start-up script's settings and metadata helpers, without its log upload and loop."""
    env = {"SPOTSCHED_METADATA_URL": url, METADATA_TIMEOUT_ENV: LIMIT_S, **env}
    job = TrainingJob("job-1", ("true",), str(tmp_path / "ckpt"), ("a",), env=env)
    return startup_script(job, provider).split("\nLOGS_URI=")[0]  # type: ignore[arg-type]


def timed(script: str) -> tuple[int, float]:
    """Run ``script`` with bash: its exit status and the seconds it took."""
    start = time.monotonic()
    returncode = subprocess.run(["bash", "-c", script], capture_output=True, timeout=10).returncode
    return returncode, time.monotonic() - start


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_a_metadata_server_that_never_answers_fails_the_read_within_its_limit(tmp_path, provider):
    """A server that accepts and never answers once held the script (and the billed instance) forever."""
    with metadata_that_hangs(lambda path: True) as url:
        returncode, seconds = timed(script_functions(tmp_path, provider, url) + "\ninstance_name")
        assert returncode != 0 and seconds < 3.0, "gives up after SPOTSCHED_METADATA_TIMEOUT_S (0.5 s)"
        # a caller's own --max-time comes after the default, and curl keeps an option's last value
        helper = "imds" if provider == "aws" else "md"
        patient = script_functions(tmp_path, provider, url, **{METADATA_TIMEOUT_ENV: "60"})
        returncode, seconds = timed(f"{patient}\n{helper} instance-id --max-time 0.3")
        assert returncode != 0 and seconds < 3.0, "the caller's shorter limit applies"


def run_with_one_read_hung(
    tmp_path: Path, provider: str, hangs: Callable[[str], bool], command: tuple[str, ...]
) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """Run the real script against metadata whose first read of a path ``hangs`` matches never answers
    (the script gives up after LIMIT_S); the paths that hung, and the script's outcome."""
    hung: list[str] = []

    def first(path: str) -> bool:
        if hangs(path) and not hung:
            hung.append(path)
            return True
        return False

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in(bin_dir, "aws" if provider == "aws" else "gcloud", f'#!/bin/bash\necho "$@" >> {tmp_path}/cli\n')
    env = job_env(tmp_path, bin_dir, "", 0, **{METADATA_TIMEOUT_ENV: LIMIT_S})
    with metadata_that_hangs(first) as url:
        job = TrainingJob("job-1", command, str(tmp_path / "ckpt"), ("a",), env={**env, "SPOTSCHED_METADATA_URL": url})
        return hung, run_script(tmp_path, job, provider)


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_a_rendezvous_read_that_times_out_is_polled_again_not_started_without_its_master(tmp_path, provider):
    """The first read of the master's address hangs: the script must not start the command with an
    empty MASTER_ADDR (torchrun would fail, and the job with it), but read the rendezvous again."""
    command = ("bash", "-c", 'echo "${MASTER_ADDR:-}:${MASTER_PORT:-}" >> "$OUT/master"')
    hung, result = run_with_one_read_hung(tmp_path, provider, lambda path: path.endswith("master-addr"), command)

    assert hung, "the first read of master-addr hung"
    assert result.returncode == 0 and (tmp_path / "powered-off").exists()
    assert lines(tmp_path / "master") == ["10.0.0.2:29500"], "started once, with its master"
    assert "done" in lines(tmp_path / "cli")[-1]


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_an_instance_name_read_that_times_out_is_tried_again_so_the_result_lands_where_it_is_read(tmp_path, provider):
    """The log and the result go under the instance's name, where the run looks them up: a first read
    that timed out must not leave them under the host name (an EC2 host name is not the instance id)."""
    name_path = "/latest/meta-data/instance-id" if provider == "aws" else "/computeMetadata/v1/instance/name"
    hung, result = run_with_one_read_hung(tmp_path, provider, lambda path: path == name_path, ("bash", "-c", WORKER))

    assert hung, "the first read of the instance's name hung"
    assert result.returncode == 0, result.stderr
    assert read_result(str(tmp_path / "ckpt"), "i-0abc" if provider == "aws" else INSTANCE) == "done"
