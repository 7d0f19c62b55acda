"""Checkpoints: written atomically, checksummed, the last K valid ones kept, a corrupt one skipped on load.

Layout under the job's URI (a local directory, or an fsspec URL such as ``s3://`` or ``gs://``)::

    checkpoints/ckpt-000000120/state.pt       torch.save of the training state
    checkpoints/ckpt-000000120/manifest.json  {"sha256", "bytes", "step", "samples_done", "generation", ...}

The payload is written first and the manifest last, so a checkpoint without a manifest is partial
(its writer died, or is still writing) and is ignored. On a local disk each file is written to a
temporary name, fsynced and renamed into place (then the directory is fsynced), so a crash leaves
either the old file or the new one plus a ``*.tmp-*`` leftover that is ignored and cleaned. Object
stores write an object all or nothing, which gives the same guarantee. A step saved again (an
emergency save of the step just stored) writes its payload under a new name (``state-<sha256
prefix>.pt``) and then replaces the manifest, so the stored checkpoint stays valid until the new
one is; the old payload goes last.

Checkpoints are ranked by the samples done that their manifest records, ties broken by step
(:func:`checkpoint_rank`), not by step alone: two generations of the runtime can overlap for a
moment (a released instance writes its emergency checkpoint while the next generation, at
another world size, has resumed from an older one), and steps of two world sizes are not
comparable, while samples are (every runtime consumes one global sample order). On load the
best-ranked checkpoint whose payload matches its manifest's size and SHA-256 wins. Any other
ranked above it, or of a higher step, is reported (logged with its name and why) and the next one
is used: a partial one, a corrupt one (a manifest that is not JSON, not an object, or lacks a
``payload`` file name, ``bytes`` or ``sha256``; a payload missing, a directory or not matching) or
one that could not be read. A bad checkpoint never stops the runtime while a good one is on disk.

Housekeeping never loses the best valid checkpoint, and logs every removal with its reason.
``prune`` (after each save) keeps the K best-ranked *valid* checkpoints, so corrupt ones do not
count, and the one just saved (``progress.json`` names it); it removes lower-ranked checkpoints
and corrupt ones. A partial checkpoint is removed only when a valid one of a higher step is the
best (its writer has moved on): otherwise it may be a write in progress, and ``clean_leftovers``
(at start) removes only its temporary files. A checkpoint that could not be read is kept unless
its step is below every kept one's (the error may pass). The payload is a
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
from airflow_provider_spotsched.runtime.contract import GENERATION_ENV

CHECKPOINTS = "checkpoints"
PAYLOAD = "state.pt"
MANIFEST = "manifest.json"
NAME = re.compile(r"^ckpt-(\d{9})$")
SHA256 = re.compile(r"[0-9a-f]{64}")
PARTIAL = "no manifest (partial checkpoint: its writer stopped before finishing)"


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}"


def step_of(name: str) -> int:
    """The step of checkpoint ``name`` (one :meth:`CheckpointStore.names` lists)."""
    match = NAME.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a checkpoint name (ckpt-<9-digit step>)")
    return int(match.group(1))


def checkpoint_rank(manifest: dict[str, Any], step: int) -> tuple[float, int]:
    """How far along the job's one global sample order a checkpoint is: samples done, then step.

    Steps count differently at another world size (the loop runtime's step takes ``batch_size``
    per worker unless ``global_batch_size`` is set), samples do not. A manifest without a numeric ``samples_done`` (not written by a
    runtime) ranks below every one with it, by step among its kind.
    """
    samples = manifest.get("samples_done")
    if not isinstance(samples, (int, float)) or isinstance(samples, bool):
        return -1, step
    return samples, step


def writer_generation() -> dict[str, str]:
    """The manifest's ``generation``: the backend's instance-set generation that wrote it, for diagnosis
    (two generations may overlap for a moment), when ``SPOTSCHED_GENERATION`` is set."""
    generation = os.environ.get(GENERATION_ENV)
    return {"generation": generation} if generation else {}


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
    skipped: tuple[str, ...]  # "ckpt-...: why" for every unusable one ranked above it or of a higher step


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
        """Save ``state`` as the checkpoint of ``step`` (payload, then manifest); prune to the best K and it.

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
                    "sha256": digest, "created": utc_now(), **writer_generation(), **manifest_extra}
        self.write_json(f"{CHECKPOINTS}/{name}/{MANIFEST}", manifest)
        if previous is not None and previous != payload:
            self.fs.rm(self.path(CHECKPOINTS, name, previous))
        self.prune(keeping=name)
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

    def _manifest(self, name: str) -> dict[str, Any]:
        """Checkpoint ``name``'s parsed, well-formed manifest; Unusable says why not (partial when there is none)."""
        raw = self._read(name, MANIFEST, "manifest")
        if raw is None:
            raise Unusable(PARTIAL, "partial")
        try:
            manifest = json.loads(raw)
        except UnicodeDecodeError:
            raise Unusable("unreadable manifest (not UTF-8 text)", "corrupt") from None
        except json.JSONDecodeError as error:
            raise Unusable(f"unreadable manifest ({error})", "corrupt") from None
        manifest_fields(manifest)
        return manifest

    def _verify(self, name: str, manifest: dict[str, Any] | None = None) -> bytes:
        """The payload of a complete checkpoint, matching its manifest (read unless given); Unusable says why not."""
        payload, size, digest = manifest_fields(self._manifest(name) if manifest is None else manifest)
        data = self._read(name, payload, "payload")
        if data is None:
            raise Unusable("payload missing", "corrupt")
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise Unusable(f"checksum mismatch ({len(data)} bytes read, {size} expected): corrupt", "corrupt")
        return data

    def _ranked(self) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, Unusable]]]:
        """The checkpoints with a well-formed manifest, best-ranked first (:func:`checkpoint_rank`), and the
        others with why. Only manifests are read: payloads are verified in this order, as far as needed."""
        ranked, unusable = [], []
        for name in self.names():
            try:
                ranked.append((name, self._manifest(name)))
            except Unusable as why:
                unusable.append((name, why))
        ranked.sort(key=lambda pair: checkpoint_rank(pair[1], step_of(pair[0])), reverse=True)
        return ranked, unusable

    def _best_valid(self) -> tuple[str | None, list[tuple[str, Unusable]]]:
        """The best-ranked checkpoint that passes its checksum (None if none), and the unusable ones ranked
        above it or of a higher step (those without a manifest have no rank), highest step first."""
        ranked, unusable = self._ranked()
        best: str | None = None
        above: list[tuple[str, Unusable]] = []
        for name, manifest in ranked:
            try:
                self._verify(name, manifest)
            except Unusable as bad:
                above.append((name, bad))
                continue
            best = name
            break
        if best is not None:
            unusable = [(name, why) for name, why in unusable if step_of(name) > step_of(best)]
        return best, sorted(above + unusable, key=lambda pair: step_of(pair[0]), reverse=True)

    def latest_valid(self) -> tuple[str | None, tuple[str, ...]]:
        """The checkpoint to resume: the best-ranked one that passes its checksum (None if none), and the
        skipped ones (logged)."""
        name, skipped = self._best_valid()
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

    def prune(self, keeping: str | None = None) -> None:
        """Keep the K best-ranked valid checkpoints (checksum verified) and ``keeping`` (the one just saved, which
        ``progress.json`` is about to name); remove lower-ranked and corrupt ones, logged.

        Counting valid checkpoints, not manifests, means the best valid one is never removed however
        many better-ranked ones are corrupt. A partial checkpoint goes once the best valid one has a
        higher step (its writer has moved on); one that could not be read stays unless its step is
        below every kept one's (the error may pass).
        """
        ranked, unusable = self._ranked()
        kept: list[str] = []
        for name, manifest in ranked:
            if len(kept) >= self.keep and name != keeping:
                self._remove(name, f"ranked below the {self.keep} valid checkpoints with the most samples done")
                continue
            try:
                self._verify(name, manifest)
            except Unusable as bad:
                unusable.append((name, bad))
                continue
            kept.append(name)
        for name, why in sorted(unusable, key=lambda pair: step_of(pair[0]), reverse=True):
            if why.problem == "corrupt":
                self._remove(name, str(why))
            elif why.problem == "partial" and kept and step_of(name) < step_of(kept[0]):
                self._remove(name, f"{why}, older than the best valid checkpoint {kept[0]}")
            elif why.problem == "unreadable" and kept and step_of(name) < min(map(step_of, kept)):
                self._remove(name, f"{why}, older than the {len(kept)} valid checkpoints kept")

    def clean_leftovers(self) -> list[str]:
        """Remove what crashed writers left (rank 0, at start), logged, and return the names removed.

        Temporary files go. A checkpoint without a manifest goes only when the best valid one has a
        higher step: otherwise it may be the checkpoint another process is writing right now (or the first one).
        """
        names = self.names()
        partial = [n for n in names if not self.fs.exists(self.path(CHECKPOINTS, n, MANIFEST))]
        best = self._best_valid()[0] if partial else None
        removed = []
        for name in names:
            if name in partial and best is not None and step_of(name) < step_of(best):
                self._remove(name, f"{PARTIAL}, older than the best valid checkpoint {best}")
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
