"""The Hugging Face Trainer's ``checkpoint-N/`` directories, made complete-or-ignored and checksummed.

The Trainer writes a checkpoint's files one by one (safetensors adapter, optimizer, scheduler,
RNG state, ``trainer_state.json``) with no atomicity: a preemption or ``kill -9`` mid-save
leaves a directory that looks like a checkpoint and is not. After each save the callback fsyncs
every file and writes :data:`MANIFEST` (each file's size and SHA-256) last, atomically
(:func:`~.atomic.write_atomic`), so a checkpoint is complete exactly when its manifest is there
and every file matches it. On resume the newest complete, checksum-valid checkpoint wins;
newer ones are logged with why they were skipped and removed (the writer that left them has
exited: a job runs one generation of processes at a time), or renamed aside if they could not be
read (a read error may pass, and only a checkpoint known to be bad is deleted). Pruning keeps the K newest *valid*
checkpoints, so a corrupt one never pushes the newest valid one out. Local directories: the
Trainer writes with ``os``, not fsspec; :mod:`.hf_mirror` carries them to and from object stores.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from airflow_provider_spotsched.runtime.atomic import TEMP_MARK, write_atomic
from airflow_provider_spotsched.runtime.checkpoint import PARTIAL, SHA256, Unusable, utc_now

MANIFEST = "spotsched-manifest.json"
NAME = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR + "-" + global step
CHUNK = 1 << 20


def checkpoint_step(directory: Path) -> int | None:
    match = NAME.match(directory.name)
    return int(match.group(1)) if match else None


def checkpoints(output_dir: Path) -> list[Path]:
    """The ``checkpoint-N`` directories under ``output_dir``, complete or not, newest step first."""
    if not output_dir.is_dir():
        return []
    found = [(step, entry) for entry in output_dir.iterdir()
             if entry.is_dir() and (step := checkpoint_step(entry)) is not None]
    return [entry for _, entry in sorted(found, key=lambda pair: pair[0], reverse=True)]


def _digest(path: Path) -> tuple[int, str]:
    """Size and SHA-256 of ``path``, read in chunks (optimizer states of real models are large)."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST and TEMP_MARK not in p.name)


def write_manifest(directory: Path, **extra: Any) -> dict[str, Any]:
    """Fsync the checkpoint's files, then write their sizes and digests as its manifest (last)."""
    entries = {}
    for path in _files(directory):
        with open(path, "rb") as handle:  # durable before the manifest vouches for it
            os.fsync(handle.fileno())
        size, digest = _digest(path)
        entries[path.relative_to(directory).as_posix()] = {"bytes": size, "sha256": digest}
    if not entries:
        raise ValueError(f"checkpoint {directory} has no files to vouch for: the Trainer saved nothing there")
    manifest = {"name": directory.name, "files": entries, "created": utc_now(), **extra}
    write_atomic(LocalFileSystem(), str(directory / MANIFEST),
                 (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return manifest


def verify(directory: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint whose every file matches it; :class:`Unusable` says why not."""
    try:
        raw = (directory / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise Unusable(PARTIAL, "partial") from None
    except OSError as error:
        raise Unusable(f"manifest could not be read ({error})", "unreadable") from None
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise Unusable(f"unreadable manifest ({error})", "corrupt") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise Unusable("malformed manifest (no files object)", "corrupt")
    for relative, entry in files.items():
        path = directory / relative
        if ".." in Path(relative).parts or Path(relative).is_absolute():
            raise Unusable(f"malformed manifest (file {relative!r} lies outside the checkpoint)", "corrupt")
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) \
                or not isinstance(entry.get("sha256"), str) or not SHA256.fullmatch(entry["sha256"]):
            raise Unusable(f"malformed manifest (entry of {relative!r} lacks bytes or sha256)", "corrupt")
        if not path.is_file():
            raise Unusable(f"{relative} missing", "corrupt")
        try:
            size, digest = _digest(path)
        except OSError as error:
            raise Unusable(f"{relative} could not be read ({error})", "unreadable") from None
        if (size, digest) != (entry["bytes"], entry["sha256"]):
            raise Unusable(f"checksum mismatch in {relative} ({size} bytes read, {entry['bytes']} expected)", "corrupt")
    return manifest


def latest_valid(output_dir: Path, log: Callable[[str], None]) -> tuple[Path | None, list[str]]:
    """The newest valid checkpoint (None if none) and ``"checkpoint-N: why"`` for each newer one skipped."""
    skipped = []
    for directory in checkpoints(output_dir):
        try:
            verify(directory)
        except Unusable as why:
            skipped.append(f"{directory.name}: {why}")
            log(f"checkpoint {directory.name} skipped: {why}")
            continue
        return directory, skipped
    return None, skipped


def remove_newer_than(output_dir: Path, keep_step: int | None, log: Callable[[str], None]) -> list[str]:
    """Clear the checkpoints newer than the one resumed from out of the way, so the Trainer never saves into one.

    Called at start, when the processes that left them have exited; a Trainer saving step N into a
    stale ``checkpoint-N`` would otherwise mix old files with new. A corrupt or partial one is
    removed; one that could not be read (a read error may pass) is renamed aside, never deleted.
    """
    removed = []
    for directory in checkpoints(output_dir):
        step = checkpoint_step(directory)
        if step is None or (keep_step is not None and step <= keep_step):
            continue
        try:
            verify(directory)
            problem = "unreadable"  # readable now, but not when the resume was chosen: keep it too
        except Unusable as why:
            problem = why.problem
        if problem == "unreadable":
            aside = directory.with_name(f"{directory.name}.unreadable-{utc_now().replace(':', '')}")
            directory.rename(aside)
            log(f"checkpoint {directory.name} set aside as {aside.name}: it could not be read, and the resumed run "
                "would save into it; check the storage and resume from it by renaming it back")
        else:
            shutil.rmtree(directory)
            log(f"checkpoint {directory.name} removed: {problem} and newer than the one resumed from")
        removed.append(directory.name)
    return removed


def prune(output_dir: Path, keep: int, log: Callable[[str], None]) -> list[str]:
    """Keep the ``keep`` newest valid checkpoints; remove older ones, corrupt ones, and partial ones
    older than the newest valid one (their writer moved on). An unreadable one stays (the error may pass)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (got {keep}): the newest valid checkpoint is never pruned")
    removed, valid, newest = [], 0, None
    for directory in checkpoints(output_dir):
        why: str | None = None
        if valid == keep:
            why = f"older than the {keep} newest valid checkpoints"
        else:
            try:
                verify(directory)
                valid += 1
                newest = newest or directory.name
            except Unusable as problem:
                if problem.problem == "corrupt":
                    why = str(problem)
                elif problem.problem == "partial" and newest is not None:
                    why = f"{problem}, older than the newest valid checkpoint {newest}"
        if why is not None:
            shutil.rmtree(directory)
            log(f"checkpoint {directory.name} removed: {why}")
            removed.append(directory.name)
    return removed
