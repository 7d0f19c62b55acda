"""Templated arguments read back as the values they stand for.

Airflow renders a template to text unless the DAG sets ``render_template_as_native_obj=True``:
a number arrives as ``"4"``, a dict as its JSON text (``| tojson``), and a template inside a dict
renders to text in place. The operators and the market sensor read their templated fields with
these helpers; they live here, below both, because operators and sensors may not import each
other (the layers contract in setup.cfg).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from airflow_provider_spotsched.scheduling.model import FIELD_RULES, JobError, shown


def rendered_number(name: str, value: Any, integer: bool = False) -> Any:
    """A templated number as a number: a rendered template is text ("4") unless the DAG renders
    native objects; anything else is returned as given, for the job's own checks."""
    if not isinstance(value, str):
        return value
    try:
        return int(value) if integer else float(value)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise JobError(f"{name}={value!r} is not {kind}; check the template or XCom that gives it") from None


def rendered_object(name: str, value: Any) -> dict[str, Any] | None:
    """A templated dict as a dict: a template renders to JSON text (``| tojson``) unless the DAG
    renders native objects; ``None`` or empty text is ``None``."""
    if value is None or value == "":
        return None
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(parsed, Mapping):
        raise JobError(
            f"{name}={shown(value)}: neither a dict nor JSON text of an object; give a dict, or render it with "
            "| tojson (or set render_template_as_native_obj=True on the DAG)"
        )
    return dict(parsed)


def rendered_job(name: str, value: Any) -> dict[str, Any] | None:
    """The spec's job fields given as a templated dict (see :func:`rendered_object`), with each
    number in it that a template rendered to text (``{"work": "{{ params.work }}"}``) read back
    as a number, as :func:`rendered_number` reads the fine-tune operator's own fields."""
    fields = rendered_object(name, value)
    if fields is None:
        return None
    for key in fields.keys() & FIELD_RULES.keys():
        fields[key] = rendered_number(f"{name}.{key}", fields[key], integer=FIELD_RULES[key][0])
    throughput = fields.get("throughput")
    if isinstance(throughput, Mapping):
        fields["throughput"] = {k: rendered_number(f"{name}.throughput.{k}", v) for k, v in throughput.items()}
    return fields
