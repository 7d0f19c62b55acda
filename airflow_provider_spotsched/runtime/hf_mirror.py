"""Trainer checkpoints in an object store: written on local disk, mirrored complete-or-absent.

The Trainer writes checkpoints with ``os``, so a job whose checkpoint URI is an object store
(``s3://``, ``gs://``, any fsspec URL) trains into a local staging directory and
:class:`CheckpointMirror` keeps the store in step with it, under the same rule as on disk
(:mod:`.hf_checkpoints`): a checkpoint is complete exactly when its manifest is there and every
file matches it.

- **up**: after a save, each file of ``checkpoint-N/`` is uploaded, then the manifest, last; a
  preemption mid-upload leaves a checkpoint without a manifest, which no resume takes. The store
  is then pruned to the K newest complete checkpoints and the one just uploaded.
- **down**: on a resume, the newest checkpoint in the store whose manifest is there is downloaded
  and verified against it on local disk; one that fails (a truncated object, a checksum mismatch)
  is named, skipped and removed, and the next older one is tried.
- ``final/`` (the adapter) is uploaded the same way; ``progress.json`` goes to the store directly.

Credentials are the instance's own (an instance profile, a service account), through fsspec;
``storage_options`` may name others.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fsspec

from airflow_provider_spotsched.runtime.checkpoint import Unusable
from airflow_provider_spotsched.runtime.hf_checkpoints import MANIFEST, NAME, checkpoint_step, verify

STAGING_ENV = "SPOTSCHED_STAGING_DIR"
"""Where the local copies go (default ``~/.cache/spotsched/staging``): the disk the Trainer writes to."""


def is_remote(checkpoint_uri: str) -> bool:
    """Whether the URI names an object store (anything but a plain path or ``file://``)."""
    protocol = fsspec.core.split_protocol(checkpoint_uri)[0]
    return protocol not in (None, "file")


def staging_directory(checkpoint_uri: str, env: Mapping[str, str]) -> Path:
    """The local directory that stands for ``checkpoint_uri`` on this machine: one per URI."""
    base = Path(env.get(STAGING_ENV) or Path.home() / ".cache" / "spotsched" / "staging").expanduser()
    return base / hashlib.sha256(checkpoint_uri.rstrip("/").encode()).hexdigest()[:16]


class CheckpointMirror:
    """The store's side of a local checkpoint directory tree (``checkpoints/checkpoint-N``, ``final``)."""

    def __init__(self, checkpoint_uri: str, local_root: Path, log: Callable[[str], None],
                 storage_options: Mapping[str, Any] | None = None) -> None:
        try:
            self.fs, self.root = fsspec.core.url_to_fs(checkpoint_uri.rstrip("/"), **dict(storage_options or {}))
        except ImportError as error:  # fsspec names the package of the URL's filesystem
            raise ValueError(f"checkpoint URI {checkpoint_uri!r}: {error} on the training machine") from None
        self.local_root, self.log = local_root, log

    def _remote(self, local: Path) -> str:
        return f"{self.root}/{local.relative_to(self.local_root).as_posix()}"

    def upload(self, directory: Path) -> None:
        """Every file of a local checkpoint (or ``final/``), its manifest last when it has one."""
        files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
        if (directory / MANIFEST).is_file():
            files.append(directory / MANIFEST)
        for folder in sorted({path.parent for path in files}):  # a no-op on object stores, needed on disks
            self.fs.makedirs(self._remote(folder), exist_ok=True)
        for path in files:
            self.fs.put_file(str(path), self._remote(path))

    def remote_checkpoints(self, output_dir: Path) -> list[str]:
        """The ``checkpoint-N`` names in the store with a manifest, newest step first."""
        remote_dir = self._remote(output_dir)
        try:
            entries = self.fs.ls(remote_dir, detail=False)
        except FileNotFoundError:
            return []
        names = [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]
        complete = [name for name in names if NAME.match(name)
                    and self.fs.exists(f"{remote_dir}/{name}/{MANIFEST}")]
        return sorted(complete, key=lambda name: checkpoint_step(Path(name)) or 0, reverse=True)

    def download(self, output_dir: Path, name: str) -> Path:
        """The store's ``name`` checkpoint as a fresh local directory (an older local copy replaced)."""
        local = output_dir / name
        shutil.rmtree(local, ignore_errors=True)
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get(self._remote(local), str(local), recursive=True)
        return local

    def fetch_latest_valid(self, output_dir: Path) -> tuple[Path | None, list[str]]:
        """Download the newest store checkpoint that verifies locally; ``"checkpoint-N: why"`` per one skipped."""
        skipped = []
        for name in self.remote_checkpoints(output_dir):
            local = self.download(output_dir, name)
            try:
                verify(local)
            except Unusable as why:
                skipped.append(f"{name}: {why}")
                shutil.rmtree(local, ignore_errors=True)
                if why.problem == "unreadable":  # the local copy could not be read: the store's may be sound
                    self.log(f"checkpoint {name} in the store skipped, kept there: {why}")
                else:
                    self.log(f"checkpoint {name} in the store skipped and removed: {why}")
                    self.fs.rm(self._remote(local), recursive=True)
                continue
            return local, skipped
        return None, skipped

    def prune(self, output_dir: Path, keep: int, keeping: str | None = None) -> list[str]:
        """Remove from the store all but the ``keep`` newest complete checkpoints and ``keeping`` (the one just
        uploaded, which ``progress.json`` is about to name), and incomplete ones older than the newest (their
        upload was cut off).

        ``keeping`` matters when the store holds a newer checkpoint than this run's: one a stale generation
        finished after this one resumed from an older one. Pushed out by it, this run's saves would leave the
        store nothing to fall back on while this run later saves that same step again over it, file by file.
        """
        removed: list[str] = []
        remote_dir = self._remote(output_dir)
        try:
            names = [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in self.fs.ls(remote_dir, detail=False)]
        except FileNotFoundError:
            return removed
        complete = self.remote_checkpoints(output_dir)
        kept = {*complete[:keep], keeping}
        newest = checkpoint_step(Path(complete[0])) if complete else None
        for name in names:
            step = checkpoint_step(Path(name))
            if step is None or name in kept or (name not in complete and (newest is None or step > newest)):
                continue  # not a checkpoint, kept, or an upload that may still be running
            self.fs.rm(f"{remote_dir}/{name}", recursive=True)
            removed.append(name)
        return removed

    def has(self, local: Path) -> bool:
        """Whether the store holds anything at ``local``'s place (e.g. ``final/``)."""
        return bool(self.fs.exists(self._remote(local)))
