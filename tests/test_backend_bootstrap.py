"""The instance start-up script, run for real by bash against a fake metadata server on loopback.

The script must wait for its rendezvous, restart the training command when a new generation is
published (SIGTERM, then the new RANK/WORLD_SIZE/MASTER_*), and on exit 0 report ``done`` and
power the instance off. ``gcloud`` and the power-off command are stand-ins that write files.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from airflow_provider_spotsched.backends.base import BackendError, TrainingJob
from airflow_provider_spotsched.backends.bootstrap import startup_script
from tests.loopback_http import QuietHandler, serving

# A training command: logs its rendezvous, exits 75 on SIGTERM, 0 once the "done" file exists.
WORKER = (
    'echo "$RANK/$WORLD_SIZE/${MASTER_ADDR:-}/${MASTER_PORT:-}/$SPOTSCHED_NOTICE" >> "$OUT/ranks"; '
    'trap "exit 75" TERM; while [ ! -f "$OUT/done" ]; do sleep 0.1; done; exit 0'
)


@pytest.fixture
def metadata() -> Iterator[tuple[dict[str, str], str]]:
    """The rendezvous attributes (without their ``spotsched-`` prefix), served as the GCE metadata server does."""
    attributes: dict[str, str] = {}

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            key = self.path.removeprefix("/computeMetadata/v1/instance/")
            values = {"name": "ss-job-g1-p0-0", "zone": "projects/1/zones/us-central1-a"}
            value = values.get(key) or attributes.get(key.removeprefix("attributes/spotsched-"))
            ok = value is not None and self.headers.get("Metadata-Flavor") == "Google"
            self.reply(200 if ok else 404, value or "not found")

    with serving(Handler) as url:
        yield attributes, url


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_the_script_follows_generations_and_reports_done(tmp_path, metadata):
    attributes, url = metadata
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/gcloud\n')
    gcloud.chmod(0o755)
    job = TrainingJob(
        "job-1",
        ("bash", "-c", WORKER),
        str(tmp_path / "ckpt"),
        ("us-central1-a",),
        env={
            "OUT": str(tmp_path),
            "SPOTSCHED_METADATA_URL": url,
            "SPOTSCHED_LOG": str(tmp_path / "train.log"),
            "SPOTSCHED_POWEROFF": f"touch {tmp_path}/powered-off",
            "PATH": f"{bin_dir}:/usr/bin:/bin",
        },
    )
    script = tmp_path / "startup.sh"
    script.write_text(startup_script(job, "gcp", poll_seconds=1))
    process = subprocess.Popen(["bash", str(script)])
    try:
        time.sleep(1.5)  # no rendezvous yet: the command must not start
        assert lines(tmp_path / "ranks") == []
        attributes.update({"generation": "1", "rank": "0", "world-size": "1"})
        wait_for(lambda: len(lines(tmp_path / "ranks")) == 1, "generation 1 to start")
        attributes.update(
            {"generation": "2", "rank": "1", "world-size": "2", "master-addr": "10.0.0.9", "master-port": "29500"}
        )
        wait_for(lambda: len(lines(tmp_path / "ranks")) == 2, "generation 2 to start")
        (tmp_path / "done").touch()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert lines(tmp_path / "ranks") == ["0/1///gcp", "1/2/10.0.0.9/29500/gcp"]
    assert lines(tmp_path / "gcloud") == [
        "compute instances add-labels ss-job-g1-p0-0 --zone us-central1-a --labels spotsched-result=done --quiet"
    ]
    assert (tmp_path / "powered-off").exists()


def test_the_script_is_valid_bash_for_both_clouds_and_quotes_arguments(tmp_path):
    job = TrainingJob("job-1", ("train", "--name", "it's $HOME; rm -rf /"), "ckpt", ("a",), env={"X": "a b"})
    for provider in ("aws", "gcp"):
        script = startup_script(job, provider)  # type: ignore[arg-type]
        path = tmp_path / f"{provider}.sh"
        path.write_text(script)
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
        assert "COMMAND=(train --name 'it'\"'\"'s $HOME; rm -rf /')" in script
        assert "export X='a b'" in script and f"export SPOTSCHED_NOTICE={provider}" in script


def test_bad_environments_are_refused_with_the_fix():
    for env, message in (
        ({"HF_TOKEN": "hf_x"}, "looks like a credential"),
        ({"KEY_FILE": "-----BEGIN RSA PRIVATE KEY-----"}, "service account"),
        ({"bad-name": "1"}, "not a shell variable name"),
        ({"BIG": "x" * 20000}, "over 16384"),
        ({"SPOTSCHED_METADATA_TIMEOUT_S": "10s"}, r"SPOTSCHED_METADATA_TIMEOUT_S.*not a number of seconds > 0"),
        ({"SPOTSCHED_METADATA_TIMEOUT_S": "0"}, "not a number of seconds > 0"),
    ):
        job = TrainingJob("job-1", ("train",), "ckpt", ("a",), env=env)
        with pytest.raises(BackendError, match=message):
            startup_script(job, "aws")
    with pytest.raises(ValueError, match="provider must be"):
        startup_script(TrainingJob("job-1", ("train",), "ckpt", ("a",)), "azure")  # type: ignore[arg-type]


def test_credentials_on_the_command_line_or_in_the_checkpoint_uri_are_refused():
    token = "hf_" + "a1B2c3D4" * 4
    for command, uri, message in (
        (("env", "AWS_SECRET_ACCESS_KEY=abc/def", "python3", "train.py"), "s3://b/run", r"job.command\[1\] looks like a credential"),
        (("env", "AWS_ACCESS_KEY_ID=AKIAABCDEFGHIJKLMNOP", "train"), "s3://b/run", r"job.command\[1\]"),
        (("python3", "train.py", "--hf-token", token), "s3://b/run", r"job.command\[3\].*hf_token_secret"),
        (("train",), "https://user:hunter2@storage.example/run", "checkpoint_uri holds a credential"),
        (("python3", "train.py", "--hub_token=abc123"), "s3://b/run", r"job.command\[2\]"),
        (("python3", "train.py", "--wandb_api_key=0123456789abcdef"), "s3://b/run", r"job.command\[2\]"),
        (("env", "aws_secret_access_key=abc", "train"), "s3://b/run", r"job.command\[1\]"),
        (("sh", "-c", "export AWS_SECRET_ACCESS_KEY=abc; train"), "s3://b/run", r"job.command\[2\]"),
        (("train",), "https://storage.example/run?X-Amz-Signature=abc", "checkpoint_uri holds a credential"),
    ):
        job = TrainingJob("job-1", command, uri, ("a",))
        for provider in ("aws", "gcp"):
            with pytest.raises(BackendError, match=message):
                startup_script(job, provider)  # type: ignore[arg-type]
    harmless = TrainingJob("job-1", ("python3", "train.py", "--max-new-tokens", "256", "MAX_STEPS=10", "--max_tokens=512",
                                     "--pad_token=<pad>", "--tokenizer_name=gpt2"), "gs://b/run?generation=3",
                           ("a",), env={"TOKENIZERS_PARALLELISM": "false", "MONKEY_PATCH": "1"})
    assert "export TOKENIZERS_PARALLELISM=false" in startup_script(harmless, "gcp")


@pytest.mark.parametrize("name", ["WANDB_KEY", "OPENAI_KEY", "APIKEY", "GITHUB_TOKEN", "DB_PASSWD"])
def test_an_env_name_with_key_token_or_password_as_a_word_is_refused(name):
    # docs/backends.md: names with SECRET, TOKEN, PASSWORD, KEY ... never reach the user data
    with pytest.raises(BackendError, match="looks like a credential"):
        startup_script(TrainingJob("job-1", ("train",), "ckpt", ("a",), env={name: "x"}), "aws")


@pytest.mark.parametrize("job_id", ["", "..", ".", "a/b", "job id"])
def test_a_job_id_that_is_no_safe_tag_or_directory_name_is_refused(job_id):
    with pytest.raises(ValueError, match="must be non-empty and use only letters, digits"):
        TrainingJob(job_id, ("train",), "ckpt", ("a",))
    TrainingJob("dag.train__run-1.0", ("train",), "ckpt", ("a",))  # dots among other characters are fine
