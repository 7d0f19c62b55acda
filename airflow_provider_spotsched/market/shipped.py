"""The traces shipped inside the package, by the short names users give them, parsed once.

A DAG, a connection's extras and the step operators name a market as ``"gcp"``, ``"aws"`` or a
trace file's path; every slot of a run and every trigger of a triggerer reads the same file
again, so a parsed trace is kept per process.
"""

from __future__ import annotations

import functools
from pathlib import Path

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.market.trace import Trace, load_trace

SHIPPED_TRACES = {"gcp": GCP_TRACE, "aws": AWS_TRACE}


def trace_path(name: str) -> Path:
    """The shipped trace called ``name``, or the trace file at path ``name``."""
    path = SHIPPED_TRACES.get(name, Path(name).expanduser())
    try:
        found = path.is_file()
    except OSError:  # a name no file system accepts (too long, say)
        found = False
    if not found:
        raise ValueError(f'trace {name!r} is neither "gcp", "aws" nor an existing trace file')
    return path


@functools.lru_cache(maxsize=32)
def cached_trace(path: str | Path) -> Trace:
    """``load_trace(path)`` once per process (worker processes forked after loading inherit it)."""
    return load_trace(path)
