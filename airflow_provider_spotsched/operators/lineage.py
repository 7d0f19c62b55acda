"""What a successful fine-tune tells Airflow's data-aware scheduling and OpenLineage.

The task's outlet is the trained adapter's Asset, so DAGs scheduled on it run on each new model.
By default it is the adapter's own location when the DAG file fixes ``checkpoint_uri``
(``{checkpoint_uri}/final``, where the runtime's contract puts the adapter), else
``spotsched://{dag_id}/{task_id}/adapter`` (see :mod:`airflow_provider_spotsched.assets`): a
templated URI, or the local backend's default checkpoints, differ per run. The asset event's
``extra`` tells a consumer where this run's adapter is and what the run was:

``{"adapter_uri", "job_id", "cost", "policy", "deadline_met"}``

For OpenLineage (``apache-airflow-providers-openlineage``, when installed) the operator reports
the market it read as input and the adapter as output; :class:`AdapterLineage` is that lineage
as plain names, so it does not need OpenLineage to be built or checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from airflow.sdk import Asset, BaseOperator

from airflow_provider_spotsched import AWS_TRACE, GCP_TRACE
from airflow_provider_spotsched.assets import create_asset, location_uri, openlineage_name
from airflow_provider_spotsched.hooks.market_spec import MarketSpec

ADAPTER_DIR = "final"
"""Where under its checkpoint URI the training writes the finished adapter (the runtime's contract)."""
TEMPLATE_MARKERS = ("{{", "{%", "{#")
LIVE_MARKETS = {"aws": ("aws://ec2", "spot-price-history", "instance_type"),
                "gcp": ("gcp://cloudbilling", "compute-spot-prices", "machine_type")}
"""A live market's OpenLineage dataset: namespace, name prefix, and the option that ends the name."""


def adapter_location(checkpoint_uri: str) -> str:
    """Where the finished adapter of a run checkpointing under ``checkpoint_uri`` lies."""
    return f"{checkpoint_uri.rstrip('/')}/{ADAPTER_DIR}"


def fixed_text(value: Any) -> TypeGuard[str]:
    """Whether ``value`` is text the DAG file fixes: no Jinja in it, so every run renders it unchanged."""
    return isinstance(value, str) and not any(m in value for m in TEMPLATE_MARKERS)


def default_adapter_asset(dag_id: str, task_id: str, checkpoint_uri: Any) -> Asset:
    """The adapter's location when ``checkpoint_uri`` is fixed in the DAG file, else its ``spotsched://`` name."""
    if fixed_text(checkpoint_uri) and checkpoint_uri:
        return Asset(location_uri(adapter_location(checkpoint_uri)))
    return create_asset(dag_id=dag_id, task_id=task_id)


def add_adapter_outlet(operator: BaseOperator, asset: Asset | None) -> Asset:
    """Make ``asset`` (default: :func:`default_adapter_asset`) one of the operator's outlets."""
    asset = asset or default_adapter_asset(operator.dag_id, operator.task_id, getattr(operator, "checkpoint_uri", None))
    if asset not in operator.outlets:
        operator.outlets.append(asset)
    return asset


def emit_adapter_event(
    context: Mapping[str, Any], asset: Asset, result: Mapping[str, Any], adapter_uri: str
) -> dict[str, Any]:
    """Attach the run's ``extra`` to the asset event Airflow emits when the task succeeds."""
    extra = {
        "adapter_uri": adapter_uri,
        "job_id": result["job_id"],
        "cost": result["cost"],
        "policy": result["policy"],
        "deadline_met": result["deadline_met"],
    }
    context["outlet_events"][asset].extra.update(extra)
    return extra


def market_name(backend: str, compute_conn_id: str | None, backend_options: Mapping[str, Any] | None,
                market_source: Any) -> tuple[str, str] | None:
    """The OpenLineage name of the market a run read; ``None`` for a market given as a bare source."""
    if backend == "local":  # the local backend replays its connection's trace, whatever the market source
        from airflow_provider_spotsched.hooks.local import LocalSpotHook

        return openlineage_name(str(LocalSpotHook(compute_conn_id, **dict(backend_options or {})).settings().trace))
    if not isinstance(market_source, (MarketSpec, Mapping, str)):
        return None
    spec = MarketSpec.coerce(market_source)
    if spec.kind == "trace":
        name = str(spec.options["path"])
        return openlineage_name(str({"gcp": GCP_TRACE, "aws": AWS_TRACE}.get(name, Path(name).expanduser())))
    if spec.kind == "history":
        return openlineage_name(str(spec.options["root"]))
    namespace, prefix, option = LIVE_MARKETS[spec.kind]
    return namespace, f"{prefix}/{spec.options[option]}"


@dataclass(frozen=True)
class AdapterLineage:
    """A run's lineage as OpenLineage ``(namespace, name)`` pairs.

    :param market: the market read (input), if it has a name.
    :param adapter: the adapter asset (output).
    :param location: where this run's adapter lies, when the asset names no location.
    """

    market: tuple[str, str] | None
    adapter: tuple[str, str]
    location: tuple[str, str] | None

    @classmethod
    def of(cls, operator: Any, adapter_uri: str | None) -> AdapterLineage:
        """The lineage of ``operator``'s run, whose adapter the asset event placed at ``adapter_uri``."""
        adapter = openlineage_name(operator.adapter_asset.uri)
        location = openlineage_name(adapter_uri) if adapter_uri else None
        return cls(
            market_name(operator.backend, operator.compute_conn_id, operator.backend_options, operator.market_source),
            adapter,
            location if location != adapter else None,
        )

    def to_openlineage(self) -> Any:
        """As the OpenLineage provider's ``OperatorLineage`` (only that provider calls for it)."""
        from airflow.providers.common.compat.openlineage.facet import (
            Dataset,
            DatasetFacet,
            Identifier,
            SymlinksDatasetFacet,
        )
        from airflow.providers.openlineage.extractors import OperatorLineage

        facets: dict[str, DatasetFacet] = {}
        if self.location is not None:
            namespace, name = self.location
            located = Identifier(namespace=namespace, name=name, type="LOCATION")
            facets["symlinks"] = SymlinksDatasetFacet(identifiers=[located])
        inputs = [Dataset(namespace=self.market[0], name=self.market[1])] if self.market else []
        adapter = Dataset(namespace=self.adapter[0], name=self.adapter[1], facets=facets)
        return OperatorLineage(inputs=inputs, outputs=[adapter])


class AdapterLineageMixin:
    """The fine-tune operator's OpenLineage method: the market in, the adapter out."""

    adapter_asset: Asset  # set by the operator (add_adapter_outlet)

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Called by the OpenLineage provider once the task succeeded, with its asset event's extra set."""
        extra = task_instance.get_template_context()["outlet_events"][self.adapter_asset].extra
        return AdapterLineage.of(self, extra.get("adapter_uri")).to_openlineage()
