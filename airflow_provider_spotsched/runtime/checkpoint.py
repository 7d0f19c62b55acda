"""Checkpoints: written atomically, checksummed, the last K valid ones kept, a corrupt one skipped on load.

Layout under the job's URI (a local directory, or an fsspec URL such as ``s3://`` or ``gs://``)::

    checkpoints/ckpt-000000120/state.pt       torch.save of the training state
    checkpoints/ckpt-000000120/manifest.json  {"sha256", "bytes", "step", "samples_done", ...}

The payload is written first and the manifest last, so a checkpoint without a manifest is partial
(its writer died, or is still writing) and is ignored. On a local disk each file is written to a
temporary name, fsynced and renamed into place (then the directory is fsynced), so a crash leaves
either the old file or the new one plus a ``*.tmp-*`` leftover that is ignored and cleaned. Object
stores write an object all or nothing, which gives the same guarantee. A step saved again (an
emergency save of the step just stored) writes its payload under a new name (``state-<sha256
prefix>.pt``) and then replaces the manifest, so the stored checkpoint stays valid until the new
one is; the old payload goes last. On load the newest
checkpoint whose payload matches its manifest's size and SHA-256 wins. Any other is reported
(logged with its name and why) and the previous one is used: a partial one, a corrupt one (a
manifest that is not JSON, not an object, or lacks a ``payload`` file name, ``bytes`` or
``sha256``; a payload missing, a directory or not matching) or one that could not be read. A bad
checkpoint never stops the runtime while a good one is on disk.

Housekeeping never loses the newest valid checkpoint, and logs every removal with its reason.
``prune`` (after each save) keeps the K newest *valid* checkpoints, so corrupt ones do not count;
it removes older checkpoints and corrupt ones. A partial checkpoint is removed only when a newer
valid one exists (its writer has moved on): otherwise it may be a write in progress, and
``clean_leftovers`` (at start) removes only its temporary files. A checkpoint that could not be
read is kept unless it is older than the K valid ones (the error may pass). The payload is a
pickle the runtime wrote itself (checked by its checksum before it is unpickled): point a job only
at checkpoint storage you control.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from airflow_provider_spotsched.runtime.atomic import TEMP_MARK, write_atomic

CHECKPOINTS = "checkpoints"
PAYLOAD = "state.pt"
MANIFEST = "manifest.json"
NAME = re.compile(r"^ckpt-(\d{9})$")
SHA256 = re.compile(r"[0-9a-f]{64}")
PARTIAL = "no manifest (partial checkpoint: its writer stopped before finishing)"


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}"


def utc_now() -> str:
    """Now, to the millisecond: the scheduler times the work between two progress reports by
    their stamps, and a demo's market hour is 20 s."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Unusable(ValueError):
    """Why a checkpoint cannot be loaded, and whether that is a reason to delete it.

    ``corrupt``: its manifest is malformed or its payload does not match it, for good;
    ``partial``: no manifest, so its writer may still be running; ``unreadable``: a read error,
    which may pass. Only a corrupt checkpoint is deleted for what is wrong with it, the others
    only for their age.
    """

    def __init__(self, why: str, problem: Literal["corrupt", "partial", "unreadable"]) -> None:
        super().__init__(why)
        self.problem = problem


def manifest_fields(manifest: Any) -> tuple[str, int, str]:
    """The payload's file name, size and SHA-256 that a parsed manifest gives; Unusable if it lacks one."""
    if not isinstance(manifest, dict):
        raise Unusable(f"malformed manifest ({json.dumps(manifest)[:40]} is not an object)", "corrupt")
    missing = [key for key in ("payload", "bytes", "sha256") if key not in manifest]
    if missing:
        raise Unusable(f"malformed manifest (no {', '.join(missing)})", "corrupt")
    payload, size, digest = manifest["payload"], manifest["bytes"], manifest["sha256"]
    if not isinstance(payload, str) or payload in ("", ".", "..") or "/" in payload:
        problem = f"payload is {payload!r}, not a file name"  # nor a path out of its checkpoint
    elif not isinstance(size, int) or isinstance(size, bool) or size < 0:
        problem = f"bytes is {size!r}, not a size in bytes"
    elif not isinstance(digest, str) or not SHA256.fullmatch(digest):
        problem = f"sha256 is {digest!r}, not a hex SHA-256 digest"
    else:
        return payload, size, digest
    raise Unusable(f"malformed manifest ({problem})", "corrupt")


@dataclass(frozen=True)
class Loaded:
    """A checkpoint that passed its checksum, with the ones skipped on the way (newest first)."""

    name: str
    state: dict[str, Any]
    skipped: tuple[str, ...]  # "ckpt-...: why" for every newer checkpoint that was unusable


class CheckpointStore:
    """The job's storage: checkpoints, their manifests and the final adapter."""

    def __init__(self, uri: str, keep: int = 3, log: Callable[[str], None] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1 (got {keep}): the newest valid checkpoint is never pruned")
        self.uri = uri
        self.fs, self.root = fsspec.core.url_to_fs(uri)
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.keep = keep
        self.log = log or (lambda message: None)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    # -- writing -------------------------------------------------------------------------------

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write one file all or nothing (:func:`~.atomic.write_atomic`)."""
        write_atomic(self.fs, self.path(relative), data)

    def write_json(self, relative: str, payload: dict[str, Any]) -> None:
        self.write_bytes(relative, (json.dumps(payload, indent=1, sort_keys=True) + "\n").encode())

    def save(self, step: int, state: dict[str, Any], **manifest_extra: Any) -> str:
        """Save ``state`` as the checkpoint of ``step`` (payload, then manifest); prune to the last K.

        Re-saving a step that is already stored writes the new payload beside the old one and then
        swaps the manifest (one atomic write): the stored checkpoint stays valid until the new one
        is, so a write that fails or is killed half-way never leaves the step without one.
        """
        name = checkpoint_name(step)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        digest = hashlib.sha256(data).hexdigest()
        previous = self._stored_payload(name)
        payload = PAYLOAD if previous is None else f"state-{digest[:16]}.pt"
        self.write_bytes(f"{CHECKPOINTS}/{name}/{payload}", data)
        manifest = {"name": name, "step": step, "payload": payload, "bytes": len(data),
                    "sha256": digest, "created": utc_now(), **manifest_extra}
        self.write_json(f"{CHECKPOINTS}/{name}/{MANIFEST}", manifest)
        if previous is not None and previous != payload:
            self.fs.rm(self.path(CHECKPOINTS, name, previous))
        self.prune()
        return name

    def _stored_payload(self, name: str) -> str | None:
        """The payload file that checkpoint ``name``'s manifest names, None if it has no usable manifest."""
        try:
            raw = self._read(name, MANIFEST, "manifest")
            return None if raw is None else manifest_fields(json.loads(raw))[0]
        except (Unusable, ValueError):
            return None

    def put_directory(self, local_dir: str, relative: str) -> None:
        """Copy a local directory's files (e.g. the final adapter) to ``relative``, each atomically."""
        for entry in sorted(os.listdir(local_dir)):
            source = os.path.join(local_dir, entry)
            if os.path.isfile(source):
                with open(source, "rb") as handle:
                    self.write_bytes(f"{relative}/{entry}", handle.read())

    # -- reading -------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Checkpoint directories (complete or not), newest step first."""
        try:
            entries = self.fs.ls(self.path(CHECKPOINTS), detail=False)
        except FileNotFoundError:
            return []
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in entries]
        return sorted((n for n in names if NAME.match(n)), reverse=True)

    def _read(self, name: str, file: str, what: str) -> bytes | None:
        """One file of checkpoint ``name``, None if it is absent; Unusable if it cannot be read."""
        try:
            return self.fs.cat_file(self.path(CHECKPOINTS, name, file))
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise Unusable(f"{what} is a directory", "corrupt") from None
        except OSError as error:
            raise Unusable(f"{what} could not be read ({error})", "unreadable") from None

    def _verify(self, name: str) -> bytes:
        """The payload of a complete checkpoint, matching its manifest; Unusable says why not."""
        raw = self._read(name, MANIFEST, "manifest")
        if raw is None:
            raise Unusable(PARTIAL, "partial")
        try:
            manifest = json.loads(raw)
        except UnicodeDecodeError:
            raise Unusable("unreadable manifest (not UTF-8 text)", "corrupt") from None
        except json.JSONDecodeError as error:
            raise Unusable(f"unreadable manifest ({error})", "corrupt") from None
        payload, size, digest = manifest_fields(manifest)
        data = self._read(name, payload, "payload")
        if data is None:
            raise Unusable("payload missing", "corrupt")
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise Unusable(f"checksum mismatch ({len(data)} bytes read, {size} expected): corrupt", "corrupt")
        return data

    def _newest_valid(self) -> tuple[str | None, list[tuple[str, Unusable]]]:
        """The newest checkpoint that passes its checksum (None if none), and the newer ones with why not."""
        skipped = []
        for name in self.names():
            try:
                self._verify(name)
            except Unusable as why:
                skipped.append((name, why))
                continue
            return name, skipped
        return None, skipped

    def latest_valid(self) -> tuple[str | None, tuple[str, ...]]:
        """The newest checkpoint that passes its checksum (None if none), and the skipped ones (logged)."""
        name, skipped = self._newest_valid()
        for newer, why in skipped:
            self.log(f"checkpoint {newer} skipped: {why}")
        return name, tuple(f"{newer}: {why}" for newer, why in skipped)

    def load(self, name: str) -> dict[str, Any]:
        """The state of checkpoint ``name``, checksum verified; the error names it (other ranks call this)."""
        try:
            data = self._verify(name)
        except Unusable as why:
            raise Unusable(f"checkpoint {name}: {why}", why.problem) from None
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)

    def load_latest(self) -> Loaded | None:
        name, skipped = self.latest_valid()
        return None if name is None else Loaded(name, self.load(name), skipped)

    # -- housekeeping --------------------------------------------------------------------------

    def prune(self) -> None:
        """Keep the K newest valid checkpoints (checksum verified); remove older and corrupt ones, logged.

        Counting valid checkpoints, not manifests, means the newest valid one is never removed
        however many newer ones are corrupt. A partial checkpoint goes once a newer valid one exists
        (its writer has moved on); one that could not be read stays (the error may pass).
        """
        newest: str | None = None
        valid = 0
        for name in self.names():
            if valid == self.keep:
                self._remove(name, f"older than the {self.keep} newest valid checkpoints")
                continue
            try:
                self._verify(name)
            except Unusable as why:
                if why.problem == "corrupt":
                    self._remove(name, str(why))
                elif why.problem == "partial" and newest is not None:
                    self._remove(name, f"{why}, older than the newest valid checkpoint {newest}")
                continue
            newest = newest or name
            valid += 1

    def clean_leftovers(self) -> list[str]:
        """Remove what crashed writers left (rank 0, at start), logged, and return the names removed.

        Temporary files go. A checkpoint without a manifest goes only when a newer valid one exists:
        otherwise it may be the checkpoint another process is writing right now (or the first one).
        """
        names = self.names()
        partial = [n for n in names if not self.fs.exists(self.path(CHECKPOINTS, n, MANIFEST))]
        newest = self._newest_valid()[0] if partial else None
        removed = []
        for name in names:
            if name in partial and newest is not None and name < newest:
                self._remove(name, f"{PARTIAL}, older than the newest valid checkpoint {newest}")
                removed.append(name)
            else:
                removed += self._remove_temporaries(CHECKPOINTS, name)
        if self.fs.exists(self.root):
            removed += self._remove_temporaries()
        return removed

    def _remove(self, name: str, why: str) -> None:
        self.fs.rm(self.path(CHECKPOINTS, name), recursive=True)
        self.log(f"checkpoint {name} removed: {why}")

    def _remove_temporaries(self, *parts: str) -> list[str]:
        """Remove the ``*.tmp-*`` files directly under ``parts`` (logged); their names."""
        removed = []
        for entry in self.fs.ls(self.path(*parts), detail=False):
            file = entry.rstrip("/").rsplit("/", 1)[-1]
            if TEMP_MARK in file:
                self.fs.rm(entry)
                self.log(f"temporary file {'/'.join([*parts, file])} removed: leftover of an interrupted write")
                removed.append(file)
        return removed
