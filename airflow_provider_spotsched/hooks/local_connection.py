"""The ``spotsched_local`` connection form, as plain data: Airflow's UI builds the form from it.

Airflow 3.3 reads a connection type's form from the provider info (``hook-name``,
``conn-fields``, ``ui-field-behaviour``) without importing the hook, and without the Flask
AppBuilder packages it ignores what a hook's ``get_ui_field_behaviour`` returns; so
:func:`~airflow_provider_spotsched.get_provider_info` and
:meth:`~airflow_provider_spotsched.hooks.local.LocalSpotHook.get_ui_field_behaviour` both read
this module, which imports nothing. The fields are the extras the hook reads (see
:mod:`airflow_provider_spotsched.hooks.local`).
"""

from __future__ import annotations

from typing import Any

CONN_TYPE = "spotsched_local"
HOOK_NAME = "Spot scheduler: local replay"

CONN_FIELDS: dict[str, dict[str, Any]] = {
    "workdir": {
        "label": "Work directory",
        "description": "Where job directories and default checkpoints live. "
        "Empty: [spotsched] local_workdir, else $AIRFLOW_HOME/spotsched.",
        "schema": {"type": ["string", "null"]},
    },
    "trace": {
        "label": "Market trace",
        "description": 'The market replayed: "gcp" or "aws" (the shipped traces) or the path of a trace file.',
        "schema": {"type": ["string", "null"], "default": "gcp"},
    },
    "seconds_per_slot": {
        "label": "Seconds per market slot",
        "description": "Wall-clock seconds one market slot lasts in the replay.",
        "schema": {"type": ["number", "null"], "default": 5.0},
    },
    "market_start": {
        "label": "Market start (UTC)",
        "description": "ISO-8601 UTC timestamp in the trace where the job is submitted, e.g. "
        "2025-10-11T03:10:00Z. Empty: right after the history slots.",
        "schema": {"type": ["string", "null"]},
    },
    "history_slots": {
        "label": "History slots",
        "description": "Slots of market history before submission (forecasts and the selector's warm-up read them).",
        "schema": {"type": ["integer", "null"], "default": 48, "minimum": 1},
    },
}
"""The extras, in the provider info's ``conn-fields`` format (a JSON schema per field)."""

UI_FIELD_BEHAVIOUR: dict[str, Any] = {
    "hidden-fields": ["host", "schema", "login", "password", "port"],
    "relabeling": {},
    "placeholders": {
        "extra": '{"workdir": "/data/spotsched", "trace": "gcp", "seconds_per_slot": 5, '
        '"market_start": "2025-10-11T03:10:00Z", "history_slots": 48}'
    },
}
"""The standard fields, in the provider info's ``ui-field-behaviour`` format (kebab-case keys)."""


def connection_type_info(hook_class_name: str) -> dict[str, Any]:
    """The ``connection-types`` entry of the provider info."""
    return {
        "hook-class-name": hook_class_name,
        "hook-name": HOOK_NAME,
        "connection-type": CONN_TYPE,
        "ui-field-behaviour": UI_FIELD_BEHAVIOUR,
        "conn-fields": CONN_FIELDS,
    }


def field_behaviour() -> dict[str, Any]:
    """:data:`UI_FIELD_BEHAVIOUR` as ``get_ui_field_behaviour`` returns it (snake_case keys)."""
    return {
        "hidden_fields": list(UI_FIELD_BEHAVIOUR["hidden-fields"]),
        "relabeling": dict(UI_FIELD_BEHAVIOUR["relabeling"]),
        "placeholders": dict(UI_FIELD_BEHAVIOUR["placeholders"]),
    }
