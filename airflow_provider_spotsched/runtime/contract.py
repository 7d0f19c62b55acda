"""What the runtime promises whoever runs it: its exit codes and the files under the checkpoint URI.

The backends (the local supervisor, the cloud start-up script) and the operator hold the runtime
to this contract, not to its code: any command that keeps it can be the training command. This
module imports only the standard library and fsspec, so that they can read it without torch,
transformers or Airflow installed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from typing import Any

import fsspec
from fsspec import AbstractFileSystem

from airflow_provider_spotsched.runtime.atomic import write_atomic

EXIT_DONE = 0  # the job's work is done; the final adapter is under URI/final/
EXIT_FAILURE = 1  # training failed (message on stderr)
EXIT_USAGE = 2  # bad arguments or config (message on stderr names the field)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM or a notice after an emergency checkpoint; resumable

PROGRESS_FILE = "progress.json"
"""Under the checkpoint URI: the runtime's :class:`Progress`, replaced whole at every write."""

CONFIG_FILE = "config.json"
"""Under the checkpoint URI: the training config the operator writes for ``--config``."""

GENERATION_ENV = "SPOTSCHED_GENERATION"
"""The backend's instance-set generation, in the environment of every process it launches (the
rendezvous id; :mod:`.node`); checkpoints record it."""

LOGS_DIR = "logs"
LOG_FILE = "train.log"
"""Under the checkpoint URI: ``logs/<instance>/train.log``, each cloud instance's command output."""
RESULT_FILE = "result"
"""Beside the log: ``logs/<instance>/result``, the result the instance also tags itself with
(``done`` or ``failed-<code>``), readable when the instance's identity may not tag itself."""

Locate = Callable[[str], tuple[AbstractFileSystem, str]]
"""A URI to the filesystem and path that reach it. The default, :func:`fsspec.core.url_to_fs`,
uses ambient credentials; the Airflow side passes one built on a connection
(:mod:`airflow_provider_spotsched.hooks.object_storage`)."""


@dataclass(frozen=True)
class Progress:
    """What rank 0 last reported: the work that survives a preemption, and where the job stands.

    ``samples_done`` is the checkpointed work in the scheduling model's units (training samples);
    ``status`` is ``running``, ``preempted`` or ``done`` (empty before the first write, or when
    the command does not say); ``updated`` is the UTC time of the write (ISO-8601, ``Z``);
    ``eval_loss`` is the latest loss on the job's eval split (None without one, and in files
    written before it existed).

    Three stamps let the scheduler measure the throughput in every slot, one that moved the job
    included (empty when the command does not write them: the scheduler then skips such slots
    and times the others by ``updated``): ``checkpointed``, when ``samples_done`` was stored (or
    restored); ``resumed`` and ``resumed_samples``, when this process began computing from its
    restored work and how much that was. A restart's set-up (instances, image, model load) then
    falls outside the measured span instead of being read as a slow throughput.
    """

    samples_done: float = 0
    samples_total: int = 0
    step: int = 0
    loss: float | None = None
    samples_per_second: float = 0.0
    world_size: int = 0
    checkpoint: str | None = None
    status: str = ""
    updated: str = ""
    eval_loss: float | None = None
    checkpointed: str = ""
    resumed: str = ""
    resumed_samples: float = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def training_report(self) -> dict[str, Any] | None:
        """What the UI shows of training (loss, eval loss if any, measured samples/s, step, world size)
        and the stamps the scheduler times the work by; ``None`` before any."""
        if not self.updated:
            return None
        report = {"loss": self.loss, "samples_per_second": self.samples_per_second, "step": self.step,
                  "world_size": self.world_size, "updated": self.updated}
        if self.eval_loss is not None:
            report["eval_loss"] = self.eval_loss
        if self.checkpointed:
            report["checkpointed"] = self.checkpointed
        if self.resumed:
            report.update(resumed=self.resumed, resumed_samples=self.resumed_samples)
        return report

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Progress:
        """The known fields of ``data``; a missing one keeps its default (a command may write fewer)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    @property
    def finished_at(self) -> datetime | None:
        """When the runtime reported the job done, if it did (UTC when the stamp names no zone; None
        when it is no time at all, so the caller falls back to the moment it saw the report)."""
        if self.status != "done" or not self.updated:
            return None
        try:
            stamp = datetime.fromisoformat(str(self.updated).replace("Z", "+00:00"))
        except ValueError:
            return None
        return stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=timezone.utc)


def _progress_path(checkpoint_uri: str) -> str:
    return f"{checkpoint_uri.rstrip('/')}/{PROGRESS_FILE}"


def log_uri(checkpoint_uri: str, instance_id: str, name: str = LOG_FILE) -> str:
    """Where the start-up script uploads ``instance_id``'s log, or its file ``name`` beside it
    (:data:`RESULT_FILE`; see :mod:`~.backends.bootstrap`)."""
    return f"{checkpoint_uri.rstrip('/')}/{LOGS_DIR}/{instance_id}/{name}"


def read_result(checkpoint_uri: str, instance_id: str, locate: Locate = fsspec.core.url_to_fs) -> str | None:
    """The result ``instance_id`` stored beside its log (``done``, ``failed-<code>``; ``None``: none stored)."""
    fs, path = locate(log_uri(checkpoint_uri, instance_id, RESULT_FILE))
    try:
        return fs.cat_file(path).decode("utf-8", errors="replace").strip() or None
    except FileNotFoundError:
        return None


def read_log_tail(checkpoint_uri: str, instance_id: str, max_bytes: int = 4000,
                  locate: Locate = fsspec.core.url_to_fs) -> str | None:
    """The last ``max_bytes`` of an instance's uploaded log (``None``: none uploaded)."""
    fs, path = locate(log_uri(checkpoint_uri, instance_id))
    try:
        size = fs.size(path)
        data = fs.cat_file(path, start=max(0, size - max_bytes))
    except FileNotFoundError:
        return None
    text = data.decode("utf-8", errors="replace")
    return text if size <= max_bytes else text.split("\n", 1)[-1]  # from the first whole line


def write_progress(checkpoint_uri: str, progress: Progress) -> None:
    """Replace the job's progress file in one step: a reader sees the old progress or the new."""
    fs, path = fsspec.core.url_to_fs(_progress_path(checkpoint_uri))
    write_atomic(fs, path, (json.dumps(progress.to_dict(), indent=1, sort_keys=True) + "\n").encode())


def read_progress(checkpoint_uri: str, locate: Locate = fsspec.core.url_to_fs) -> Progress:
    """The job's progress; an empty one before the first write or when the file is not progress JSON."""
    fs, path = locate(_progress_path(checkpoint_uri))
    try:
        data = json.loads(fs.cat_file(path))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return Progress()
    return Progress.from_dict(data) if isinstance(data, dict) else Progress()


def read_work_done(checkpoint_uri: str, locate: Locate = fsspec.core.url_to_fs) -> float:
    """Samples the runtime has checkpointed (work that survives a preemption)."""
    return float(read_progress(checkpoint_uri, locate).samples_done)


def read_finished_at(checkpoint_uri: str, locate: Locate = fsspec.core.url_to_fs) -> datetime | None:
    """When the runtime wrote its final progress (``status: done``), if it says."""
    return read_progress(checkpoint_uri, locate).finished_at


def runtime_command(checkpoint_uri: str, python: str = sys.executable, runtime: str = "hf") -> tuple[str, ...]:
    """The runtime's own entry point for a job that checkpoints at ``checkpoint_uri``.

    Its config is :data:`CONFIG_FILE` beside the checkpoints (see :func:`write_config`), so every
    instance reads the same one wherever it lands. ``python``: the interpreter on the instance.
    The default runtime (``hf``) runs under elastic torchrun, a process per GPU
    (:mod:`.node`); ``loop`` meets its peers itself, one process per instance.
    """
    launcher = ("-m", "airflow_provider_spotsched.runtime.node", "-m") if runtime == "hf" else ("-m",)
    return (
        python, *launcher, "airflow_provider_spotsched.runtime",
        "--config", f"{checkpoint_uri.rstrip('/')}/{CONFIG_FILE}",
        "--checkpoint-uri", checkpoint_uri,
    )


def write_config(checkpoint_uri: str, config: Mapping[str, Any], locate: Locate = fsspec.core.url_to_fs) -> None:
    """Write the runtime's training config where :func:`runtime_command` tells it to look."""
    fs, path = locate(f"{checkpoint_uri.rstrip('/')}/{CONFIG_FILE}")
    write_atomic(fs, path, json.dumps(dict(config), indent=1, sort_keys=True).encode())
