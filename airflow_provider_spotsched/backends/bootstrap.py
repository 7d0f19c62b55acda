"""The start-up script every cloud instance runs: wait for a rendezvous, run the training command.

A cloud backend cannot know the master address when it launches an instance (the address exists
only after launch), so the script does not start training at boot. It polls the instance's own
metadata for the rendezvous the backend publishes once every instance of a generation has an
address (EC2: instance tags through IMDSv2; Compute Engine: instance metadata attributes):

``generation``, ``rank``, ``world-size``, ``master-addr``, ``master-port``.

A new ``generation`` stops the running command with SIGTERM (the runtime saves an emergency
checkpoint and exits 75) and starts it again with the new ``RANK``/``WORLD_SIZE``/``MASTER_*`` and
``SPOTSCHED_GENERATION``, resuming from the latest checkpoint (the default runtime's command is
elastic torchrun, :mod:`airflow_provider_spotsched.runtime.node`, which meets the generation's
other instances through c10d at ``MASTER_ADDR:MASTER_PORT``: the instances' security group or
firewall must let them reach each other on TCP). When the command exits 0 the job is done: the script records
``result=done`` on the instance (a tag or label, which the backend's ``status`` reads) and powers
the instance off, so nothing keeps billing after success. Any other exit but 75 records
``result=failed-<code>`` and powers off too, unless the instance's metadata says the cloud is taking
it back (EC2 ``spot/instance-action``, Compute Engine ``instance/preempted``; read with a 3-second
limit): a command that does not exit 75 on SIGTERM (a custom ``torchrun`` exits 1) may end that way
before the shutdown stops the script, and that is a preemption, handled as 75 (a line in the log,
no result). Metadata that cannot be read leaves the failure. Before the tag or label, the result
(the same text) is uploaded beside the log, to ``<checkpoint_uri>/logs/<instance>/result``
(:data:`~airflow_provider_spotsched.runtime.contract.RESULT_FILE`): an instance whose identity may
not tag or label itself still leaves its result, which the run driver reads for an instance that
ended without one (else a failing command on a spot instance would read as preempted, and be
relaunched until the deadline). Exit 75 (preemption notice) waits for the next
generation, which the backend publishes after replacing the lost capacity.

``SPOTSCHED_LOG`` (default ``/var/log/spotsched-train.log``) and ``SPOTSCHED_POWEROFF`` (default
``shutdown -h now``) in ``job.env`` change where the command's output goes and how the instance
powers off; ``SPOTSCHED_METADATA_URL`` changes the metadata server (as for the runtime).

Every metadata read gives up after ``SPOTSCHED_METADATA_TIMEOUT_S`` (:data:`METADATA_TIMEOUT_S`;
curl's ``--max-time``, which a caller's own later ``--max-time`` overrides, as curl keeps an
option's last value): a metadata server that accepts the connection and never answers would
otherwise hold the script, and the instance would sit billed doing nothing. A read that gives up
is a failed read: the loop polls on, and starts a generation only once every field it needs was read.

The script carries no credential: the instance reaches its checkpoint store and reports its
result with the identity the cloud gives it (an instance profile or a service account).

Two sections stand apart from the loop:

- **secrets**: ``SPOTSCHED_HF_TOKEN_SECRET`` in ``job.env`` names a secret (an AWS Secrets Manager
  ARN, or a GCP Secret Manager version ``projects/P/secrets/S/versions/V``), never holds one. The
  script reads it on the instance with the instance's own identity (the AWS CLI through the
  instance profile; Secret Manager's REST API with the metadata server's access token) each time
  it starts the command, and hands it as ``HF_TOKEN`` to that command only: it is never exported
  to the script, written to the log or sent anywhere else. A secret that cannot be read fails the
  command with :data:`EXIT_NO_SECRET` and a line in the log that names the secret, not its value.
- **logs**: the command's log is copied to ``<checkpoint_uri>/logs/<instance>/train.log``
  (:func:`~airflow_provider_spotsched.runtime.contract.log_uri`) every
  ``SPOTSCHED_LOG_UPLOAD_SECONDS`` (default 30), before the result is reported, and when the
  script exits (a TERM at preemption or shutdown included), so a lost instance leaves its log.
  ``s3://`` goes through ``aws s3 cp``, ``gs://`` through ``gcloud storage cp``, a local path
  through ``cp``. ``SPOTSCHED_SM_ENDPOINT`` changes the Secret Manager endpoint (tests; a name the credential check lets through).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Literal

from airflow_provider_spotsched.backends.base import BackendError, TrainingJob
from airflow_provider_spotsched.runtime.contract import EXIT_PREEMPTED, LOG_FILE, LOGS_DIR, RESULT_FILE

Provider = Literal["aws", "gcp"]

RENDEZVOUS_KEYS = ("generation", "rank", "world-size", "master-addr", "master-port")
"""The rendezvous fields, published per instance by the backend and read by the script."""

MAX_SCRIPT_BYTES = 16 * 1024
"""EC2 refuses user data above 16 KiB; Compute Engine allows more, one limit keeps both safe."""

# Names and values that carry secrets; they must reach the instance through its cloud identity.
# A KEY standing as a word of the name (WANDB_KEY, api_key, apikey; not MONKEY or KEYRING) is one.
# No token: TOKENIZERS_PARALLELISM, a count of tokens (max_new_tokens) or a tokenizer's special
# token (pad_token, eos_token ...).
_SECRET_NAME = re.compile(
    r"SECRET|PASSW(?:OR)?D|CREDENTIAL|PRIVATE|(?<![A-Z])(?:ACCESS|API|AUTH)?_?KEY(?![A-Z])"
    r"|(?<!PAD_)(?<!EOS_)(?<!BOS_)(?<!UNK_)(?<!SEP_)(?<!CLS_)(?<!MASK_)TOKEN(?!IZER|S)",
    re.I,
)
_SECRET_VALUE = re.compile(
    r"(AKIA|ASIA)[0-9A-Z]{16}|-----BEGIN [A-Z ]*PRIVATE KEY-----|\"private_key\"|\bhf_[A-Za-z0-9]{30,}"
)
# a NAME=value anywhere in a command argument: `env NAME=value`, `--name=value`, `export NAME=value` in `sh -c`
_ASSIGNMENT = re.compile(r"(?:^|[\s;&|'\"(])-{0,2}([A-Za-z_][A-Za-z0-9_.-]*)=(?=\S)")
_URL_PASSWORD = re.compile(r"://[^/@\s]*:[^/@\s]*@")  # scheme://user:password@host
_URL_SECRET_PARAMETER = re.compile(r"[?&][^=&#]*(?:secret|token|key|sig|credential|password)[^=&#]*=", re.I)  # a signed URL

HF_TOKEN_SECRET = "SPOTSCHED_HF_TOKEN_SECRET"
"""The ``job.env`` name of the Hugging Face token's secret reference (see the module docstring)."""

METADATA_TIMEOUT_ENV = "SPOTSCHED_METADATA_TIMEOUT_S"
"""The ``job.env`` name of the seconds a metadata read may take (tests set it low)."""

METADATA_TIMEOUT_S = 10
"""Metadata servers answer in milliseconds; this is a bound on a hung one, not an expected wait."""

EXIT_NO_SECRET = 78
"""EX_CONFIG: the command did not start because its secret could not be read on the instance."""

SECRET_REFERENCES = {
    "aws": re.compile(r"arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:\d{12}:secret:[A-Za-z0-9/_+=.@!-]+"),
    "gcp": re.compile(r"projects/[^/\s]+/secrets/[A-Za-z0-9_-]+/versions/[A-Za-z0-9_-]+"),
}
"""What a secret reference looks like on each cloud: the only secret-named entry ``job.env`` may hold."""

_METADATA_LIMIT = r"""
# every metadata read gives up after this many seconds (a hung server must not hold the instance, billed)
METADATA_LIMIT=(--max-time "${SPOTSCHED_METADATA_TIMEOUT_S:-__METADATA_TIMEOUT_S__}")
"""

_AWS_FUNCTIONS = r"""
IMDS=${SPOTSCHED_METADATA_URL:-http://169.254.169.254}
# imds PATH [CURL_OPTION...]: each request bounded; a caller's --max-time comes later and wins
imds() {
  local token
  token=$(curl -sf "${METADATA_LIMIT[@]}" "${@:2}" -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 300" "$IMDS/latest/api/token") \
    || return 1
  curl -sf "${METADATA_LIMIT[@]}" "${@:2}" -H "X-aws-ec2-metadata-token: $token" "$IMDS/latest/meta-data/$1"
}
rendezvous() { imds "tags/instance/spotsched:$1"; }
instance_name() { imds instance-id; }
# EC2 has scheduled this spot instance's interruption (404 until the 2-minute notice)
reclaimed() { imds spot/instance-action --max-time 3 >/dev/null; }
tag_result() {
  aws ec2 create-tags --region "$(imds placement/region)" --resources "$(imds instance-id)" \
    --tags "Key=spotsched:result,Value=$1" || echo "spotsched: could not tag the result $1" >&2
}
"""

_GCP_FUNCTIONS = r"""
MD=${SPOTSCHED_METADATA_URL:-http://metadata.google.internal}
# md PATH [CURL_OPTION...]: bounded; a caller's --max-time comes later and wins
md() { curl -sf "${METADATA_LIMIT[@]}" "${@:2}" -H "Metadata-Flavor: Google" "$MD/computeMetadata/v1/instance/$1"; }
rendezvous() { md "attributes/spotsched-$1"; }
instance_name() { md name; }
# Compute Engine is preempting this VM
reclaimed() { [ "$(md preempted --max-time 3)" = TRUE ]; }
tag_result() {
  local zone
  zone=$(md zone) && zone=${zone##*/}
  gcloud compute instances add-labels "$(md name)" --zone "$zone" --labels "spotsched-result=$1" --quiet \
    || echo "spotsched: could not label the result $1" >&2
}
"""

_READ_SECRET = {
    "aws": r"""
read_secret() {
  local region
  region=$(echo "$1" | cut -d: -f4)
  aws secretsmanager get-secret-value --region "$region" --secret-id "$1" --query SecretString --output text
}
""",
    "gcp": r"""
read_secret() {
  local token
  token=$(md service-accounts/default/token | python3 -c 'import json,sys; print(json.load(sys.stdin)["access_token"])') || return 1
  curl -sf --max-time 60 -H "Authorization: Bearer $token" "${SPOTSCHED_SM_ENDPOINT:-https://secretmanager.googleapis.com}/v1/$1:access" \
    | python3 -c 'import base64,json,sys; sys.stdout.write(base64.b64decode(json.load(sys.stdin)["payload"]["data"]).decode())'
}
""",
}
"""``read_secret REFERENCE``: the secret's value on stdout, read with the instance's identity."""

_SECRETS = r"""
# The token goes to the command's environment only; the script never exports or prints it.
with_hf_token() {
  local hf_token
  if ! hf_token=$(read_secret "$SPOTSCHED_HF_TOKEN_SECRET") || [ -z "$hf_token" ]; then
    echo "spotsched: could not read the Hugging Face token from $SPOTSCHED_HF_TOKEN_SECRET with the instance's identity" >&2
    return __EXIT_NO_SECRET__
  fi
  HF_TOKEN=$hf_token "$@"
}
"""

_LOG_UPLOAD = r"""
LOGS_URI=__LOGS_URI__
# The instance's name places its log and result where the backend looks: a read that timed out is tried again.
instance_id() {
  local name _
  for _ in 1 2 3 4 5 6; do
    name=$(instance_name) && [ -n "$name" ] && { echo "$name"; return 0; }
    sleep 1
  done
  hostname
}
INSTANCE_URI="$LOGS_URI/$(instance_id)"
LOG_URI="$INSTANCE_URI/__LOG_FILE__"
# upload FILE URI: copy FILE to the checkpoint store with the instance's identity
upload() {
  case "$2" in
    s3://*) aws s3 cp --only-show-errors "$1" "$2" ;;
    gs://*) gcloud storage cp --quiet "$1" "$2" ;;
    *) mkdir -p "$(dirname "$2")" && cp "$1" "$2.tmp" && mv "$2.tmp" "$2" ;;
  esac >/dev/null 2>&1 || echo "spotsched: could not upload $1 to $2" >&2
}
upload_log() {
  [ -f "${SPOTSCHED_LOG:-/var/log/spotsched-train.log}" ] || return 0
  upload "${SPOTSCHED_LOG:-/var/log/spotsched-train.log}" "$LOG_URI"
}
# The result goes beside the log too: an identity that may not tag its instance still reports it.
report() {
  upload_log
  local result=${SPOTSCHED_LOG:-/var/log/spotsched-train.log}.result
  printf '%s\n' "$1" >"$result" && upload "$result" "$INSTANCE_URI/__RESULT_FILE__"
  tag_result "$1"
}
# The uploader takes its sleep down with it, so that no orphan outlives the script (holding its
# output open for up to a period).
(
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while true; do
    sleep "${SPOTSCHED_LOG_UPLOAD_SECONDS:-30}" & nap=$!
    wait "$nap" || exit 0
    upload_log
  done
) &
uploader=$!
trap 'kill "$uploader" 2>/dev/null; upload_log' EXIT
"""

_LOOP = r"""
LOG=${SPOTSCHED_LOG:-/var/log/spotsched-train.log}
POWEROFF=${SPOTSCHED_POWEROFF:-shutdown -h now}
child=0
generation=""
stop_child() {
  if [ "$child" -ne 0 ] && kill -0 "$child" 2>/dev/null; then kill -TERM "$child"; wait "$child"; fi
  child=0
}
trap 'stop_child; exit 0' TERM INT
while true; do
  seen=$(rendezvous generation || true)
  if [ -n "$seen" ] && [ "$seen" != "$generation" ]; then
    rank=$(rendezvous rank || true); size=$(rendezvous world-size || true)
    addr=$(rendezvous master-addr || true); port=$(rendezvous master-port || true)
    # The tags of one generation are written in one call; a generation that changed while we
    # read them, or a field a read missed (a metadata server that timed out), is read again on the next turn.
    if [ -n "$rank" ] && [ -n "$size" ] && { [ "$size" -le 1 ] || { [ -n "$addr" ] && [ -n "$port" ]; }; } \
      && [ "$(rendezvous generation || true)" = "$seen" ]; then
      stop_child
      generation=$seen
      export RANK=$rank WORLD_SIZE=$size SPOTSCHED_GENERATION=$generation
      if [ "$size" -gt 1 ]; then export MASTER_ADDR=$addr MASTER_PORT=$port; else unset MASTER_ADDR MASTER_PORT; fi
      echo "spotsched: generation $generation rank $RANK of $WORLD_SIZE" >>"$LOG"
      "${COMMAND[@]}" >>"$LOG" 2>&1 &
      child=$!
    fi
  fi
  if [ "$child" -ne 0 ] && ! kill -0 "$child" 2>/dev/null; then
    wait "$child"; rc=$?; child=0
    if [ "$rc" -eq 0 ]; then report done; $POWEROFF; exit 0; fi
    if [ "$rc" -ne __EXIT_PREEMPTED__ ]; then
      # A command that does not exit 75 on SIGTERM (torchrun exits 1) can end with another code as
      # the cloud takes the instance back, before the shutdown stops the script: a preemption too.
      if reclaimed; then
        echo "spotsched: the command exited $rc while the cloud takes this instance back: a preemption, not a failure" >>"$LOG"
        upload_log
      else report "failed-$rc"; $POWEROFF; exit "$rc"; fi
    fi
  fi
  sleep __POLL__
done
"""


def check_secret_reference(provider: Provider, reference: str) -> None:
    """Refuse a Hugging Face token secret that is not a reference to ``provider``'s secret store."""
    if not SECRET_REFERENCES[provider].fullmatch(reference):
        example = ("arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME" if provider == "aws"
                   else "projects/PROJECT/secrets/NAME/versions/latest")
        raise BackendError(
            f"hf_token_secret={reference[:12] + '...'!r} is not a secret reference on {provider}: give the "
            f"secret's name, e.g. {example!r}, never the token itself (start-up scripts are readable metadata)"
        )


def check_no_credentials(env: Mapping[str, str]) -> None:
    """Refuse environment entries that look like credentials: start-up scripts are readable metadata.

    :data:`HF_TOKEN_SECRET` is the one secret-named entry allowed: it names a secret, and
    :func:`startup_script` checks that it is a reference.
    """
    for name, value in env.items():
        if name == HF_TOKEN_SECRET and not _SECRET_VALUE.search(str(value)):
            continue
        if _SECRET_NAME.search(name) or _SECRET_VALUE.search(str(value)):
            raise BackendError(
                f"job.env[{name!r}] looks like a credential; start-up scripts are stored as instance "
                "metadata that anyone with describe access can read. Give the instance its access "
                "through an instance profile (EC2) or a service account (Compute Engine) instead"
            )


def check_command_carries_no_credentials(job: TrainingJob) -> None:
    """Refuse a command argument or checkpoint URI that holds a credential: the command goes into
    the start-up script, readable metadata, as ``job.env`` does."""
    for index, argument in enumerate(job.command):
        names = (match.group(1) for match in _ASSIGNMENT.finditer(argument))
        if _SECRET_VALUE.search(argument) or any(_SECRET_NAME.search(name) for name in names):
            raise BackendError(
                f"job.command[{index}] looks like a credential; start-up scripts are stored as instance "
                "metadata that anyone with describe access can read. Give the instance its access through "
                "an instance profile (EC2) or a service account (Compute Engine), and a Hugging Face token "
                "as a secret reference (hf_token_secret), never on the command line"
            )
    uri = job.checkpoint_uri
    if _SECRET_VALUE.search(uri) or _URL_PASSWORD.search(uri) or _URL_SECRET_PARAMETER.search(uri):
        raise BackendError(
            "checkpoint_uri holds a credential; give the bucket's location only (s3://BUCKET/PREFIX or "
            "gs://BUCKET/PREFIX) and the instance its access through its instance profile or service account"
        )


def startup_script(job: TrainingJob, provider: Provider, *, poll_seconds: int = 10) -> str:
    """The bash script that runs ``job.command`` under the rendezvous of ``provider``'s metadata."""
    if provider not in ("aws", "gcp"):
        raise ValueError(f"provider must be 'aws' or 'gcp', got {provider!r}")
    if poll_seconds < 1:
        raise ValueError(f"poll_seconds must be >= 1, got {poll_seconds}")
    check_no_credentials(job.env)
    check_command_carries_no_credentials(job)
    secret = job.env.get(HF_TOKEN_SECRET)
    if secret is not None:
        check_secret_reference(provider, secret)
    timeout = str(job.env.get(METADATA_TIMEOUT_ENV, METADATA_TIMEOUT_S))
    if not re.fullmatch(r"\d+(\.\d+)?", timeout) or float(timeout) <= 0:
        # curl would refuse every metadata read: the script would poll on and never start the command
        raise BackendError(f"job.env[{METADATA_TIMEOUT_ENV!r}]={timeout!r} is not a number of seconds > 0; give e.g. '10'")
    env = {**job.env, "SPOTSCHED_NOTICE": provider, "SPOTSCHED_JOB_ID": job.job_id}
    for name in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise BackendError(f"job.env name {name!r} is not a shell variable name; use letters, digits and '_'")
    exports = "\n".join(f"export {name}={shlex.quote(str(value))}" for name, value in sorted(env.items()))
    command = " ".join(shlex.quote(arg) for arg in (("with_hf_token",) if secret else ()) + job.command)
    logs_uri = shlex.quote(f"{job.checkpoint_uri.rstrip('/')}/{LOGS_DIR}")
    loop = _LOOP.replace("__EXIT_PREEMPTED__", str(EXIT_PREEMPTED)).replace("__POLL__", str(int(poll_seconds)))
    script = (
        "#!/bin/bash\n"
        f"# spotsched bootstrap for job {job.job_id}: see airflow_provider_spotsched/backends/bootstrap.py\n"
        f"{exports}\n"
        f"COMMAND=({command})\n"
        + _METADATA_LIMIT.replace("__METADATA_TIMEOUT_S__", str(METADATA_TIMEOUT_S))
        + (_AWS_FUNCTIONS if provider == "aws" else _GCP_FUNCTIONS)
        + (_READ_SECRET[provider] + _SECRETS.replace("__EXIT_NO_SECRET__", str(EXIT_NO_SECRET)) if secret else "")
        + _LOG_UPLOAD.replace("__LOGS_URI__", logs_uri).replace("__LOG_FILE__", LOG_FILE)
        .replace("__RESULT_FILE__", RESULT_FILE)
        + loop
    )
    if len(script.encode()) > MAX_SCRIPT_BYTES:
        raise BackendError(
            f"the start-up script is {len(script.encode())} bytes, over {MAX_SCRIPT_BYTES}: shorten "
            "job.command and job.env (put long settings in the CONFIG.json the command reads)"
        )
    return script
