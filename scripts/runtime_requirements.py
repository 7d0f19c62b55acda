"""Print the requirements of one extra of pyproject.toml, its references to our own extras expanded.

``pip install pkg[runtime]`` would also install the base dependencies (Airflow and the scheduling
stack); a GPU node needs the runtime's alone. So the image installs this list, then the package
with ``--no-deps``. Usage: ``python scripts/runtime_requirements.py [pyproject.toml] [extra]``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: pip install tomli
    import tomli as tomllib


def requirements(pyproject: Path, extra: str = "runtime") -> list[str]:
    """The extra's requirements, each once, ``airflow-provider-spotsched[x]`` replaced by extra x's."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    own = re.compile(rf"^{re.escape(project['name'])}\[([^\]]+)\]$")
    seen: list[str] = []

    def add(name: str, path: tuple[str, ...]) -> None:
        if name not in extras:
            raise SystemExit(f"{pyproject}: no extra {name!r}; choose one of {sorted(extras)}")
        if name in path:
            raise SystemExit(f"{pyproject}: extra {name!r} refers to itself through {' -> '.join(path)}")
        for requirement in extras[name]:
            if match := own.match(requirement.replace(" ", "")):
                for inner in match.group(1).split(","):
                    add(inner.strip(), (*path, name))
            elif requirement not in seen:
                seen.append(requirement)

    add(extra, ())
    return seen


if __name__ == "__main__":
    arguments = sys.argv[1:]
    path = Path(arguments[0]) if arguments else Path(__file__).resolve().parents[1] / "pyproject.toml"
    print("\n".join(requirements(path, arguments[1] if len(arguments) > 1 else "runtime")))
