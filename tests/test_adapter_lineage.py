"""The adapter Asset a fine-tune declares and the lineage it reports, without running a fine-tune.

tests/test_adapter_asset_e2e.py runs one in a real deployment; here the operator is only built
(in a DAG, as a DAG file builds it), and the asset event and OpenLineage facets are produced
from a context like the one Airflow hands the task.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk import DAG, Asset
from airflow.sdk.execution_time.context import OutletEventAccessors

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.assets import convert_asset_to_openlineage, create_asset, openlineage_name
from airflow_provider_spotsched.hooks.market_spec import MarketSpec
from airflow_provider_spotsched.operators.fine_tune import DeadlineSpotFineTuneOperator
from airflow_provider_spotsched.operators.lineage import AdapterLineage, emit_adapter_event, market_name

RESULT = {"job_id": "d-t-0123456789ab", "cost": 3.25, "policy": "chc", "deadline_met": True, "savings": 9.0}


def built(task_id: str = "fine_tune", **overrides: Any) -> DeadlineSpotFineTuneOperator:
    fields: dict[str, Any] = dict(
        task_id=task_id, pools=["us-east4-a"], deadline=6.0, throughput={"alpha": 60.0}, value=100.0, work=100,
        command="python train.py",
    )
    with DAG("finetune_dag", schedule=None):
        return DeadlineSpotFineTuneOperator(**{**fields, **overrides})


def test_the_adapter_asset_is_the_fixed_checkpoints_final_dir_else_named_by_the_task(tmp_path):
    assert built(checkpoint_uri=str(tmp_path / "ckpt") + "/").outlets == [Asset((tmp_path / "ckpt" / "final").as_uri())]
    assert built(checkpoint_uri="s3://models/llm").outlets == [Asset("s3://models/llm/final")]
    named = Asset("spotsched://finetune_dag/fine_tune/adapter")
    assert built().outlets == [named]  # the local backend's default checkpoints differ per run
    assert built(checkpoint_uri="gs://models/{{ run_id }}").outlets == [named]
    assert create_asset(dag_id="finetune_dag", task_id="fine_tune") == named


def test_a_given_adapter_asset_joins_the_tasks_own_outlets_once():
    mine, report = Asset("s3://models/llm-v2"), Asset("s3://reports/run")
    operator = built(adapter_asset=mine, outlets=[report, mine])
    assert operator.adapter_asset == mine and operator.outlets == [report, mine]
    assert built(adapter_asset=mine, outlets=[report]).outlets == [report, mine]


@pytest.mark.parametrize("uri", ["spotsched:///fine_tune/adapter", "spotsched://finetune_dag"])
def test_airflow_refuses_a_spotsched_uri_that_names_no_task(uri):
    with pytest.raises(ValueError, match=r"spotsched://\{dag_id\}/\{task_id\}/adapter"):
        Asset(uri)


def test_the_asset_event_carries_where_the_adapter_is_and_what_the_run_was():
    operator, events = built(), OutletEventAccessors()
    extra = emit_adapter_event({"outlet_events": events}, operator.adapter_asset, RESULT, "/w/checkpoints/j/final")
    assert events[Asset("spotsched://finetune_dag/fine_tune/adapter")].extra == extra == {
        "adapter_uri": "/w/checkpoints/j/final", "job_id": RESULT["job_id"], "cost": 3.25, "policy": "chc",
        "deadline_met": True,
    }


def test_the_market_read_is_named_as_openlineage_names_files_and_apis(tmp_path, monkeypatch):
    assert market_name("local", None, {"trace": "aws"}, None) == ("file", str(AWS_TRACE))
    monkeypatch.setenv("AIRFLOW_CONN_REPLAY", '{"conn_type": "spotsched_local", "extra": {"trace": "gcp"}}')
    replayed = market_name("local", "replay", None, MarketSpec.coerce("aws"))
    assert replayed == ("file", str(GCP_TRACE))  # the local backend reads its own trace
    assert market_name("ec2", "aws_default", None, "gcp") == ("file", str(GCP_TRACE))
    history = {"kind": "history", "options": {"root": "s3://bucket/market/"}}
    assert market_name("ec2", "aws_default", None, history) == ("s3://bucket", "market/")
    aws = MarketSpec("aws", "aws_default", {"instance_type": "p3.2xlarge", "availability_zones": ["us-east-1a"],
                                            "on_demand_price": 3.06})
    assert market_name("ec2", "aws_default", None, aws) == ("aws://ec2", "spot-price-history/p3.2xlarge")
    gcp = MarketSpec("gcp", None, {"machine_type": "a3-highgpu-1g", "zones": ["europe-west4-b"]})
    assert market_name("gce", "gcp", None, gcp) == ("gcp://cloudbilling", "compute-spot-prices/a3-highgpu-1g")
    assert market_name("ec2", "aws_default", None, SimpleNamespace()) is None  # a bare MarketSource has no name


def test_the_lineage_is_the_market_in_and_the_adapter_out_with_this_runs_location(tmp_path):
    operator = built(backend_options={"trace": "gcp"})
    lineage = AdapterLineage.of(operator, str(tmp_path / "checkpoints" / "j" / "final"))
    assert lineage == AdapterLineage(
        market=("file", str(GCP_TRACE)),
        adapter=("spotsched://finetune_dag", "fine_tune/adapter"),
        location=("file", str(tmp_path / "checkpoints" / "j" / "final")),
    )
    fixed = built(checkpoint_uri="s3://models/llm", backend="ec2", compute_conn_id="aws_default", market_source="aws")
    assert AdapterLineage.of(fixed, "s3://models/llm/final") == AdapterLineage(
        market=("file", str(AWS_TRACE)), adapter=("s3://models", "llm/final"), location=None)
    assert openlineage_name("relative/dir") == ("file", str(Path("relative/dir").absolute()))


def test_openlineage_gets_the_datasets_from_the_operator_once_the_task_succeeded(tmp_path):
    pytest.importorskip("airflow.providers.openlineage", reason="apache-airflow-providers-openlineage is not installed")
    operator = built(backend_options={"trace": "gcp"})
    context = {"outlet_events": OutletEventAccessors()}
    emit_adapter_event(context, operator.adapter_asset, RESULT, str(tmp_path / "final"))
    facets = operator.get_openlineage_facets_on_complete(SimpleNamespace(get_template_context=lambda: context))
    assert [(d.namespace, d.name) for d in facets.inputs] == [("file", str(GCP_TRACE))]
    (output,) = facets.outputs
    assert (output.namespace, output.name) == ("spotsched://finetune_dag", "fine_tune/adapter")
    (location,) = output.facets["symlinks"].identifiers
    assert (location.namespace, location.name, location.type) == ("file", str(tmp_path / "final"), "LOCATION")
    converted = convert_asset_to_openlineage(operator.adapter_asset, None)
    assert (converted.namespace, converted.name) == (output.namespace, output.name)
