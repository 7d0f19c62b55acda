"""Build a class named in a lookup table, checking the parameters before calling it."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any


def load(kind: str, table: Mapping[str, str], name: str) -> type[Any]:
    """The class that ``table`` maps ``name`` to (``"module:Class"``), imported on first use."""
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(table)}")
    module, cls = table[name].split(":")
    return getattr(importlib.import_module(module), cls)


def parameters(kind: str, table: Mapping[str, str], name: str) -> list[str]:
    """The parameters the class ``table[name]`` is built with, in order."""
    return [p for p in inspect.signature(load(kind, table, name).__init__).parameters if p != "self"]


def build(kind: str, table: Mapping[str, str], name: str, params: Mapping[str, Any] | None = None) -> Any:
    """An instance of ``table[name]`` built with ``params``, naming any parameter it does not take."""
    cls = load(kind, table, name)
    params = dict(params or {})
    accepted = parameters(kind, table, name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"{kind} {name!r} takes no parameter(s) {unknown}; it takes {accepted}")
    return cls(**params)
