"""The runtime-only install against the full one: installed size and import time, in one run.

Sizes are of the distributions each install brings, resolved from what this environment has
installed (so run it in the project's venv, which holds both): the runtime's is the closure of
``scripts/runtime_requirements.py``'s list plus this package; the full install's is the closure of
the base dependencies and the ``train`` extra (``pip install airflow-provider-spotsched[train]``).
Import time is ``python -X importtime`` summed over every module (self times), each in a fresh
interpreter: the runtime's training modules with every module outside the runtime-only install
blocked (:func:`blocker`: as on a runtime-only node) and unblocked (as on a full install), and the
Airflow-side operator, which only the full install can import. Usage: ``python benchmarks/runtime_install.py [--json]``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "airflow-provider-spotsched"
RUNTIME_IMPORT = "import airflow_provider_spotsched.runtime.train, airflow_provider_spotsched.runtime.hf_callback"
OPERATOR_IMPORT = "import airflow_provider_spotsched.operators.fine_tune"


def blocker(dists: Mapping[str, metadata.Distribution]) -> str:
    """Python source that hides every module and distribution but the standard library and
    ``dists`` (by canonical name) and this package (an editable install lists no module files):
    a runtime-only node, simulated in this environment (which has more)."""
    modules = sorted(
        top_levels(dists.values()) | set(sys.stdlib_module_names) | {"__main__", "_distutils_hack", "airflow_provider_spotsched"}
    )
    return f"""
import importlib.machinery, re, sys
class OnlyTheRuntime:
    modules, dists = frozenset({modules!r}), frozenset({sorted(dists)!r})
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] not in cls.modules and not name.startswith("_sysconfigdata"):  # stdlib, per platform
            return None  # as if not installed: `import` raises ModuleNotFoundError, find_spec gives None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
    @classmethod
    def find_distributions(cls, context=None):
        finder = importlib.machinery.PathFinder
        found = finder.find_distributions(context) if context else finder.find_distributions()
        return (d for d in found if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() in cls.dists)
sys.meta_path = [OnlyTheRuntime if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def top_levels(dists: Iterable[metadata.Distribution]) -> set[str]:
    """The top-level modules the distributions install (from their file lists)."""
    names: set[str] = set()
    for dist in dists:
        for file in dist.files or ():
            top = file.parts[0]
            if top.endswith((".dist-info", ".data")) or top in ("..", "__pycache__"):
                continue
            if len(file.parts) > 1 or file.suffix in (".py", ".so", ".pyd"):
                names.add(top.split(".")[0])
    return names


def runtime_install() -> dict[str, metadata.Distribution]:
    """The distributions of the runtime-only install: the extra's closure and this package."""
    return closure(runtime_requirements()) | {PACKAGE: metadata.distribution(PACKAGE)}


def runtime_requirements() -> list[str]:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from runtime_requirements import requirements
    finally:
        sys.path.pop(0)
    return requirements(ROOT / "pyproject.toml", "runtime")


def closure(requirements: Iterable[str]) -> dict[str, metadata.Distribution]:
    """Every installed distribution ``requirements`` pull in, by canonical name (markers evaluated)."""
    found: dict[str, metadata.Distribution] = {}
    pending = [(Requirement(r), "") for r in requirements]
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform dependency this environment does not have
        first = name not in found
        found[name] = dist
        for wanted in ("", *requirement.extras) if first else requirement.extras:
            pending += [(Requirement(r), wanted) for r in dist.requires or ()]
    return found


def installed_bytes(dists: Iterable[metadata.Distribution]) -> int:
    total = 0
    for dist in dists:
        for file in dist.files or ():
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                total += path.stat().st_size
    return total


def import_ms(code: str, only: Mapping[str, metadata.Distribution] | None = None) -> tuple[float, int]:
    """Summed self import time (ms) and module count of ``code`` in a fresh interpreter
    (with ``only``: with every other top-level module blocked, see :func:`blocker`)."""
    source = (blocker(only) if only is not None else "") + code
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", source], capture_output=True, text=True, env=env, check=True)
    selfs = [int(m.group(1)) for m in re.finditer(r"^import time:\s+(\d+) \|", done.stderr, re.M)]
    return sum(selfs) / 1000.0, len(selfs)


def measure() -> dict[str, dict[str, float]]:
    package = metadata.distribution(PACKAGE)
    runtime = runtime_install()
    full = closure([*(package.requires or [])]) | closure([f"{PACKAGE}[train]"])
    figures: dict[str, dict[str, float]] = {}
    for name, dists in (("runtime-only", runtime), ("full", full)):
        figures[name] = {"distributions": len(dists), "installed_mb": installed_bytes(dists.values()) / 1e6}
    figures["runtime-only"]["runtime_import_ms"], figures["runtime-only"]["runtime_modules"] = import_ms(RUNTIME_IMPORT, runtime)
    figures["full"]["runtime_import_ms"], figures["full"]["runtime_modules"] = import_ms(RUNTIME_IMPORT)
    figures["full"]["operator_import_ms"], figures["full"]["operator_modules"] = import_ms(OPERATOR_IMPORT)
    figures["runtime-only"]["airflow_statsmodels_matplotlib_dists"] = sum(
        1 for n in runtime if n.startswith("apache-airflow") or n in ("statsmodels", "matplotlib")
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    figures = measure()
    if parser.parse_args().json:
        print(json.dumps(figures, indent=1))
        return
    print(f"{'install':<14}{'dists':>7}{'installed MB':>14}{'runtime import ms':>19}{'operator import ms':>20}")
    for name, f in figures.items():
        operator = f"{f['operator_import_ms']:.0f}" if "operator_import_ms" in f else "(no Airflow)"
        print(f"{name:<14}{f['distributions']:>7.0f}{f['installed_mb']:>14.0f}{f['runtime_import_ms']:>19.0f}{operator:>20}")
    print(f"runtime import: `{RUNTIME_IMPORT}` (runtime-only: all but its install's modules blocked); operator import: `{OPERATOR_IMPORT}`")


if __name__ == "__main__":
    main()
