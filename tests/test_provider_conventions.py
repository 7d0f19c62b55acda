"""The provider as Airflow 3.3 presents it: the connection form, the ``[spotsched]`` options.

What users see comes from a fresh Airflow process (the ``airflow`` CLI, and the providers manager
behind the UI's connection form) in a temporary ``AIRFLOW_HOME`` that imports this checkout; the
rest checks in-process that the hook, the provider info and the settings agree.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

import airflow_provider_spotsched as pkg
from airflow_provider_spotsched.hooks import local_connection
from airflow_provider_spotsched.hooks.local import LocalReplaySettings, LocalSpotHook

REPO = Path(__file__).resolve().parent.parent
AIRFLOW = Path(sys.executable).with_name("airflow")
EXTRAS = {"workdir", "trace", "seconds_per_slot", "market_start", "history_slots"}

CONNECTION_FORM = """
import json
from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService
from airflow.providers_manager import ProvidersManager

(meta,) = [m for m in HookMetaService.hook_meta_data() if m.connection_type == "spotsched_local"]
print(json.dumps({"form": meta.model_dump(), "behaviour": ProvidersManager().field_behaviours["spotsched_local"]}))
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A fresh deployment's environment: no DB is needed to list providers or configuration."""
    home = tmp_path_factory.mktemp("airflow-home")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__SPOTSCHED__")},
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def airflow(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([str(AIRFLOW), *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_airflow_lists_the_connection_types_hook_and_field_behaviour(env):
    hooks = json.loads(airflow(env, "providers", "hooks", "-o", "json"))
    (hook,) = [h for h in hooks if h["connection_type"] == "spotsched_local"]
    assert hook["hook_name"] == "Spot scheduler: local replay"
    assert hook["class"] == "airflow_provider_spotsched.hooks.local.LocalSpotHook"
    behaviours = json.loads(airflow(env, "providers", "behaviours", "-o", "json"))
    assert {"field_behaviours": "spotsched_local"} in behaviours
    widgets = json.loads(airflow(env, "providers", "widgets", "-o", "json"))
    listed = {w["connection_parameter_name"]: w["field_type"] for w in widgets if w["class"] == hook["class"]}
    assert listed == {
        "extra__spotsched_local__workdir": ["string", "null"],
        "extra__spotsched_local__trace": ["string", "null"],
        "extra__spotsched_local__seconds_per_slot": ["number", "null"],
        "extra__spotsched_local__market_start": ["string", "null"],
        "extra__spotsched_local__history_slots": ["integer", "null"],
    }


def test_the_ui_connection_form_hides_the_unused_fields_and_offers_the_extras(env):
    done = subprocess.run([sys.executable, "-c", CONNECTION_FORM], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    shown = json.loads(done.stdout.strip().splitlines()[-1])
    form, behaviour = shown["form"], shown["behaviour"]
    assert form["hook_name"] == "Spot scheduler: local replay"
    standard = form["standard_fields"]
    hidden = {name for name, field in standard.items() if field and field["hidden"]}
    assert hidden == {"url_schema", "host", "port", "login", "password"}
    assert set(behaviour["hidden_fields"]) == {"host", "schema", "login", "password", "port"}
    extras = form["extra_fields"]
    assert set(extras) == EXTRAS
    assert extras["trace"]["schema"] == {"type": ["string", "null"], "default": "gcp", "title": "Market trace"}
    assert extras["history_slots"]["value"] == 48 and "history" in extras["history_slots"]["description"]


def test_the_hook_and_the_provider_info_declare_one_form():
    (entry,) = pkg.get_provider_info()["connection-types"]
    assert entry["hook-name"] == LocalSpotHook.hook_name and entry["connection-type"] == LocalSpotHook.conn_type
    declared = entry["ui-field-behaviour"]
    assert LocalSpotHook.get_ui_field_behaviour() == {
        "hidden_fields": declared["hidden-fields"],
        "relabeling": declared["relabeling"],
        "placeholders": declared["placeholders"],
    }
    placeholder = json.loads(declared["placeholders"]["extra"])
    assert set(placeholder) == EXTRAS
    LocalReplaySettings.from_extra(placeholder, "the extra's placeholder")  # a valid example


def test_the_form_fields_are_the_extras_the_settings_read_with_their_defaults():
    with pytest.raises(ValueError, match=r"unknown field\(s\)") as refused:
        LocalReplaySettings.from_extra({"not_a_field": 1}, "test")
    accepted = re.search(r"use (.*)$", str(refused.value)).group(1).split(", ")
    assert set(accepted) == set(local_connection.CONN_FIELDS) == EXTRAS
    defaults = LocalReplaySettings.from_extra({}, "test")
    declared = {name: field["schema"].get("default") for name, field in local_connection.CONN_FIELDS.items()}
    assert LocalReplaySettings.from_extra({k: v for k, v in declared.items() if v is not None}, "test") == defaults
    assert declared == {
        "workdir": None, "trace": "gcp", "seconds_per_slot": 5.0, "market_start": None, "history_slots": 48,
    }


def test_the_provider_info_validates_against_airflows_schemas():
    import airflow

    schemas = Path(airflow.__file__).parent
    info = pkg.get_provider_info()
    jsonschema.validate(info, json.loads((schemas / "provider_info.schema.json").read_text()))
    yaml_schema = json.loads((schemas / "provider.yaml.schema.json").read_text())  # the stricter form schema
    jsonschema.validate(info["connection-types"], yaml_schema["properties"]["connection-types"])


def test_airflow_config_lists_the_spotsched_options_with_their_defaults(env):
    listed = airflow(env, "config", "list", "--section", "spotsched", "--include-descriptions", "--show-values")
    assert "[spotsched]" in listed
    assert "selector_state_variable = spotsched_selector_state" in listed
    assert re.search(r"^#? ?default_poll_interval = *$", listed, re.MULTILINE)
    assert re.search(r"^#? ?local_workdir = *$", listed, re.MULTILINE)
    assert re.search(r"^#? ?max_instances_limit = 1024$", listed, re.MULTILINE)
    assert re.search(r"^#? ?min_deferral_seconds = 15$", listed, re.MULTILINE)
    assert "a tenth of a slot, at most 60 seconds" in listed and "$AIRFLOW_HOME/spotsched" in listed
    selector = airflow(env, "config", "get-value", "spotsched", "selector_state_variable")
    assert selector.strip() == "spotsched_selector_state"
    overridden = {**env, "AIRFLOW__SPOTSCHED__DEFAULT_POLL_INTERVAL": "7.5"}
    assert airflow(overridden, "config", "get-value", "spotsched", "default_poll_interval").strip() == "7.5"


def test_spotsched_local_workdir_moves_the_hooks_workdir_unless_the_connection_or_dag_names_one(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("AIRFLOW__SPOTSCHED__LOCAL_WORKDIR", raising=False)
    assert LocalSpotHook().settings().workdir == tmp_path / "home" / "spotsched"
    monkeypatch.setenv("AIRFLOW__SPOTSCHED__LOCAL_WORKDIR", str(tmp_path / "configured"))
    assert LocalSpotHook().settings().workdir == tmp_path / "configured"
    assert LocalSpotHook().backend().workdir == tmp_path / "configured" / "jobs"  # where the jobs then run
    connection = {"conn_type": "spotsched_local", "extra": {"workdir": str(tmp_path / "from-conn")}}
    monkeypatch.setenv("AIRFLOW_CONN_MY_LOCAL", json.dumps(connection))
    assert LocalSpotHook("my_local").settings().workdir == tmp_path / "from-conn"
    assert LocalSpotHook("my_local", workdir=str(tmp_path / "from-dag")).settings().workdir == tmp_path / "from-dag"
