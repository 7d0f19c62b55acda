"""Writing a file all or nothing on any fsspec filesystem, so that a crash never leaves half a file.

Checkpoints and ``progress.json`` are read by other processes while the runtime may be killed at
any moment. On a local disk a file is written to a temporary name (``<name>.tmp-<hex>``), fsynced
and renamed into place, then the directory is fsynced: a crash leaves the old file or the new
one, plus at worst a leftover that readers ignore and the runtime removes at its next start.
Object stores write an object whole, which gives the same guarantee.
"""

from __future__ import annotations

import os
import uuid

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

TEMP_MARK = ".tmp-"
"""Part of every temporary file's name: a file carrying it is a leftover of a crashed writer."""


def write_atomic(fs: AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace ``path`` on ``fs`` with ``data`` in one step."""
    if not isinstance(fs, LocalFileSystem):
        fs.pipe_file(path, data)
        return
    parent = path.rsplit("/", 1)[0]
    os.makedirs(parent, exist_ok=True)
    temporary = f"{path}{TEMP_MARK}{uuid.uuid4().hex[:8]}"
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
