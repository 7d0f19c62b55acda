"""A sweep of bad input: generated job files and trace files through ``spotsched simulate``.

Every input either succeeds or exits 2 with one error line on stderr naming the job file or the
trace file, never a traceback; ``Job.from_dict`` raises only :class:`JobError` and
``load_trace`` only :class:`TraceError`. The only other stderr lines allowed are the library's
warnings (``spotsched simulate: warning: ...``: a long hole in a mangled trace). ``main`` runs
in this process, so a traceback is an exception escaping it: the test fails with it.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import io
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_spotsched.cli import BAD_INPUT, main
from airflow_provider_spotsched.market.trace import COLUMNS, TraceError, load_trace
from airflow_provider_spotsched.scheduling.model import Job, JobError

SWEEP = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

POOLS = ("a", "b")
HOURS = 48
ROWS = [
    [f"2025-01-{1 + h // 24:02d}T{h % 24:02d}:00:00Z", pool, f"{1.0 + (h % 5) / 10:.1f}", str((h + m) % 4), "3.0"]
    for h in range(HOURS)
    for m, pool in enumerate(POOLS)
]
JOB: dict[str, Any] = {
    "work": 6, "deadline_hours": 8, "max_instances": 2, "min_instances": 1, "throughput": {"alpha": 1.0, "beta": 0.0},
    "value": 50, "hard_deadline_factor": 1.5, "reconfig_overhead_hours": 0.25, "slot_hours": 1.0,
    "start": "2025-01-01T04:00:00Z",
}
MISSING = object()
"""Marks a field left out of the job."""

EXTREMES = st.sampled_from([
    MISSING, None, True, False, 0, -1, -0.5, 1e-9, 0.5, 2, 7, 1e6, 1e308, -1e308, 10**30, 10**400, 2**63,
    float("nan"), float("inf"), float("-inf"), "5", "abc", "", [], [1, 2], {}, {"a": [1, {"b": None}]},
    "2025-01-01T00:00:00Z", "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00", "2025-13-01",
])
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**20), 10**20))
JOB_FIELDS = [*JOB, "throughput.alpha", "throughput.beta", "colour"]

CELLS = st.sampled_from([
    "", " ", "nan", "NaN", "inf", "-inf", "-1", "0", "-0", "1e308", "1e400", "9" * 400, "abc", "1.5", "0x10", " 3 ",
    "\u0661", "2025-01-01", "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59Z", "2025-01-01T00:00:00Z", "a", '"',
    "é",
])


def run_simulate(trace: Path, job: Path) -> tuple[int, list[str]]:
    """``spotsched simulate`` in this process: its exit code and its stderr lines."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(["simulate", "--trace", str(trace), "--job", str(job), "--policy", "greedy",
                     "--out", str(job.parent / "result.json")])
    return code, err.getvalue().splitlines()


def check_outcome(code: int, lines: list[str], *named: Path) -> None:
    assert not any("Traceback" in line for line in lines)
    errors = [line for line in lines if not line.startswith("spotsched simulate: warning: ")]
    assert code in (0, BAD_INPUT)
    if code == BAD_INPUT:
        assert len(errors) == 1 and errors[0].startswith("spotsched simulate: error: "), lines
        assert any(str(path) in errors[0] for path in named), errors[0]
    else:
        assert not errors, lines


def write_csv(path: Path, rows: list[list[str]]) -> None:
    path.write_text("\n".join(",".join(r) for r in [list(COLUMNS), *rows]) + "\n", encoding="utf-8")


# -- job files --------------------------------------------------------------------------------


@st.composite
def job_documents(draw: st.DrawFn) -> Any:
    """The job with one to three fields at an extreme (missing, junk, out of range), or no object at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.sampled_from([[], [JOB], "job", 7, None, True]))
    data = json.loads(json.dumps(JOB))
    for name in draw(st.lists(st.sampled_from(JOB_FIELDS), min_size=1, max_size=3, unique=True)):
        value = draw(st.one_of(EXTREMES, NUMBERS))
        owner, key = (data.get("throughput"), name.split(".")[1]) if name.startswith("throughput.") else (data, name)
        if not isinstance(owner, dict):
            continue
        if value is MISSING:
            owner.pop(key, None)
        else:
            owner[key] = copy.deepcopy(value)  # EXTREMES' lists and objects are shared between examples
    return data


@SWEEP
@given(document=job_documents())
def test_a_job_file_either_simulates_or_is_refused_naming_it(document):
    with tempfile.TemporaryDirectory() as folder:
        trace, job = Path(folder) / "trace.csv", Path(folder) / "job.json"
        write_csv(trace, ROWS)
        job.write_text(json.dumps(document))  # NaN and Infinity too: Python's json reads them back
        check_outcome(*run_simulate(trace, job), job, trace)
    if isinstance(document, dict):
        try:
            Job.from_dict(document).check_feasible()
        except JobError:
            pass


# -- trace files ------------------------------------------------------------------------------


@st.composite
def mangled_rows(draw: st.DrawFn) -> list[list[str]]:
    """The trace's rows with cells replaced, rows repeated, cut short, dropped or shuffled."""
    rows = [list(r) for r in ROWS]
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["cell", "cell", "cell", "repeat", "cut", "drop", "shuffle", "blank"]))
        i = draw(st.integers(0, len(rows) - 1)) if rows else 0
        if not rows:
            break
        if kind == "cell" and rows[i]:
            rows[i][draw(st.integers(0, len(rows[i]) - 1))] = draw(st.one_of(CELLS, NUMBERS.map(repr)))
        elif kind == "repeat":
            rows.insert(i, list(rows[i]))
        elif kind == "cut" and rows[i]:
            rows[i] = rows[i][: draw(st.integers(0, len(rows[i]) - 1))]
        elif kind == "drop":
            del rows[i : i + draw(st.integers(1, len(rows)))]
        elif kind == "shuffle":
            rows = draw(st.permutations(rows))
        elif kind == "blank":
            rows.insert(i, [])
    return rows


WRITERS: dict[str, Callable[[Path, bytes], None]] = {
    "plain": lambda path, data: path.write_bytes(data),
    "bom": lambda path, data: path.write_bytes(b"\xef\xbb\xbf" + data),
    "latin-1": lambda path, data: path.write_bytes(data.decode("utf-8").encode("latin-1", "replace") + b"\xe9\n"),
    "gzip": lambda path, data: path.write_bytes(gzip.compress(data)),
    "truncated gzip": lambda path, data: path.write_bytes(gzip.compress(data)[: max(len(data) // 3, 3)]),
    "gzip magic, then junk": lambda path, data: path.write_bytes(b"\x1f\x8b" + data),
    "random bytes": lambda path, data: path.write_bytes(bytes(range(256)) * 3),
    "directory": lambda path, data: path.mkdir(),
}


@st.composite
def trace_files(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """(file name, how it is written, CSV bytes): empty, header only, a wrong header, mangled rows."""
    shape = draw(st.sampled_from(["rows", "rows", "rows", "empty", "header only", "wrong header"]))
    header = list(COLUMNS)
    rows = draw(mangled_rows()) if shape in ("rows", "wrong header") else []
    if shape == "wrong header":
        header = draw(st.lists(st.sampled_from([*COLUMNS, "price", "", "TIMESTAMP"]), min_size=0, max_size=6))
    text = "" if shape == "empty" else "\n".join(",".join(r) for r in [header, *rows]) + "\n"
    name = draw(st.sampled_from(["trace.csv", "trace.csv.gz", "trace"]))
    return name, draw(st.sampled_from(sorted(WRITERS))), text.encode("utf-8")


@SWEEP
@given(file=trace_files())
def test_a_trace_file_either_simulates_or_is_refused_naming_it(file):
    name, how, data = file
    with tempfile.TemporaryDirectory() as folder:
        trace, job = Path(folder) / name, Path(folder) / "job.json"
        WRITERS[how](trace, data)
        job.write_text(json.dumps(JOB))
        try:
            load_trace(trace)
        except TraceError as exc:
            assert str(trace) in str(exc)
        check_outcome(*run_simulate(trace, job), trace, job)
