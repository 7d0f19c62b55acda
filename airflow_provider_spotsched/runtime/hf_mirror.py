"""Trainer checkpoints in an object store: written on local disk, mirrored complete-or-absent.

The Trainer writes checkpoints with ``os``, so a job whose checkpoint URI is an object store
(``s3://``, ``gs://``, any fsspec URL) trains into a local staging directory and
:class:`CheckpointMirror` keeps the store in step with it, under the same rule as on disk
(:mod:`.hf_checkpoints`): a checkpoint is complete exactly when its manifest is there and every
file matches it.

- **up**: after a save, each file of ``checkpoint-N/`` is uploaded to ``checkpoint-N.<upload id>/``
  in the store, then the manifest, last; a preemption mid-upload leaves a checkpoint without a
  manifest, which no resume takes. Each upload has a store directory of its own, so two writers of
  the same step (a stale generation and the next, for a moment) never mix or overwrite each other's
  files. The upload id starts with the writer's generation (``g3-``) when it has one. The store is then
  pruned to the K newest complete checkpoints and the one just uploaded.
- **down**: on a resume, the newest checkpoint in the store whose manifest is there is downloaded
  to ``checkpoint-N/`` (the Trainer's name) and verified against it on local disk; one that fails
  (a truncated object, a checksum mismatch) is named, skipped and removed, and the next older one
  is tried. A store written before upload ids (plain ``checkpoint-N/``) is read the same way.
- ``final/`` (the adapter) is uploaded the same way; ``progress.json`` goes to the store directly.

Credentials are the instance's own (an instance profile, a service account), through fsspec;
``storage_options`` may name others.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import fsspec

from airflow_provider_spotsched.runtime.checkpoint import Unusable, writer_generation
from airflow_provider_spotsched.runtime.hf_checkpoints import MANIFEST, verify

STAGING_ENV = "SPOTSCHED_STAGING_DIR"
"""Where the local copies go (default ``~/.cache/spotsched/staging``): the disk the Trainer writes to."""
STORED = re.compile(r"^(checkpoint-(\d+))(?:\.(?:g(\d+)-)?[0-9a-f]+)?$")
"""A checkpoint's directory in the store: the Trainer's ``checkpoint-N``, then its upload's id (none before ids),
``g<generation>-<hex>`` when the writer had a generation, else ``<hex>``."""


def stored_step(name: str) -> int | None:
    """The step of a checkpoint directory in the store (``checkpoint-N`` or ``checkpoint-N.<upload id>``)."""
    match = STORED.match(name)
    return int(match.group(2)) if match else None


def stored_generation(name: str) -> int | None:
    """The generation that uploaded a checkpoint directory of the store, from its name; None if it does not say.

    In the name, not only in the manifest: an upload cut off before its manifest must still say whose it was.
    """
    match = STORED.match(name)
    return int(match.group(3)) if match and match.group(3) else None


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
        generation = writer_generation().get("generation", "")
        self.generation = int(generation) if generation.isascii() and generation.isdigit() else None

    def _remote(self, local: Path) -> str:
        return f"{self.root}/{local.relative_to(self.local_root).as_posix()}"

    def upload(self, directory: Path, name: str | None = None) -> None:
        """Every file of a local checkpoint (or ``final/``), its manifest last when it has one; into ``name``
        beside the directory's place in the store when given."""
        target = self._remote(directory) if name is None else f"{self._remote(directory.parent)}/{name}"

        def remote(path: Path) -> str:
            relative = path.relative_to(directory).as_posix()
            return target if relative == "." else f"{target}/{relative}"

        files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
        if (directory / MANIFEST).is_file():
            files.append(directory / MANIFEST)
        for folder in sorted({path.parent for path in files}):  # a no-op on object stores, needed on disks
            self.fs.makedirs(remote(folder), exist_ok=True)
        for path in files:
            self.fs.put_file(str(path), remote(path))

    def upload_checkpoint(self, directory: Path) -> str:
        """Upload a local ``checkpoint-N`` under a store name of its own (``checkpoint-N.<upload id>``); that name.

        Never into an existing directory: a stale generation saving the same step at the same moment would
        otherwise mix its files with this one's under either's manifest (a checkpoint that looks complete and is
        corrupt), and a prune of either could remove files the other is uploading. The writer's generation leads
        the id, so that a prune can tell an older generation's cut-off upload (:meth:`prune`).
        """
        generation = "" if self.generation is None else f"g{self.generation}-"
        name = f"{directory.name}.{generation}{uuid.uuid4().hex[:8]}"
        self.upload(directory, name)
        return name

    def remote_checkpoints(self, output_dir: Path) -> list[str]:
        """The checkpoint directories in the store with a manifest, newest step first, and of one step the newest
        generation's first: a stale writer's upload of that step may lack files that a prune of the newer
        generation removed (:meth:`prune`), and must neither be resumed from first nor be kept in its place."""
        remote_dir = self._remote(output_dir)
        try:
            entries = self.fs.ls(remote_dir, detail=False)
        except FileNotFoundError:
            return []
        names = [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]
        complete = [name for name in names if STORED.match(name)
                    and self.fs.exists(f"{remote_dir}/{name}/{MANIFEST}")]

        def rank(name: str) -> tuple[int, int, str]:
            generation = stored_generation(name)
            return stored_step(name) or 0, -1 if generation is None else generation, name

        return sorted(complete, key=rank, reverse=True)

    def download(self, output_dir: Path, name: str) -> Path:
        """The store's ``name`` checkpoint as a fresh local ``checkpoint-N`` (an older local copy replaced)."""
        match = STORED.match(name)
        if match is None:
            raise ValueError(f"{name!r} is not a checkpoint directory of the store (checkpoint-N[.<upload id>])")
        local = output_dir / match.group(1)
        shutil.rmtree(local, ignore_errors=True)
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get(f"{self._remote(output_dir)}/{name}", str(local), recursive=True)
        return local

    def fetch_latest_valid(self, output_dir: Path) -> tuple[Path | None, str | None, list[str]]:
        """Download the newest store checkpoint that verifies locally: its local copy and its store name (for the
        other instances to download the same one), and ``"name: why"`` per one skipped."""
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
                    self.fs.rm(f"{self._remote(output_dir)}/{name}", recursive=True)
                continue
            return local, name, skipped
        return None, None, skipped

    def prune(self, output_dir: Path, keep: int, keeping: str | None = None) -> list[str]:
        """Remove from the store all but the ``keep`` newest complete checkpoints and ``keeping`` (the one just
        uploaded, which ``progress.json`` is about to name), and incomplete ones older than the newest (their
        upload was cut off). An incomplete one of the newest's step or later stays: another writer may still be
        uploading it, and removing some of its files would leave it corrupt under the manifest it puts last.
        Unless it is an older generation's at a step that a newer generation completed: no resume can want it, and
        no later step may ever come to prune it (the job's last step); its writer, if still running, is stale.

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
        newest = stored_step(complete[0]) if complete else None
        completed_by: dict[int, int] = {}  # step -> the newest generation that completed it
        for name in complete:
            step, generation = stored_step(name), stored_generation(name)
            if step is not None and generation is not None:
                completed_by[step] = max(generation, completed_by.get(step, generation))
        for name in names:
            step = stored_step(name)
            if step is None or name in kept:
                continue  # not a checkpoint, or kept
            generation = stored_generation(name)
            outdone = generation is not None and generation < completed_by.get(step, generation)
            if name not in complete and (newest is None or step >= newest) and not outdone:
                continue  # an upload that may still be running
            self.fs.rm(f"{remote_dir}/{name}", recursive=True)
            removed.append(name)
        return removed

    def has(self, local: Path) -> bool:
        """Whether the store holds anything at ``local``'s place (e.g. ``final/``)."""
        return bool(self.fs.exists(self._remote(local)))
