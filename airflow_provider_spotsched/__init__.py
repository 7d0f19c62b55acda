"""Deadline-aware LLM fine-tuning on spot and on-demand GPUs, as an Apache Airflow provider.

Importing this package imports no Airflow: the scheduling, forecasting and simulation code
stands on its own, and the Airflow layer maps Airflow concepts onto it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__version__ = "0.1.0"

TRACES_DIR = Path(__file__).parent / "data" / "traces"
AWS_TRACE = TRACES_DIR / "aws_p3.2xlarge_9az_2023-02-15.csv.gz"
GCP_TRACE = TRACES_DIR / "gcp_h100_13zones_2025-10.csv.gz"


def get_provider_info() -> dict[str, Any]:
    """What Airflow's providers manager reads through the ``apache_airflow_provider`` entry point.

    Listing a module here imports nothing: Airflow imports it only when it is used. The
    connection form and the ``[spotsched]`` options are plain data, read from Airflow-free modules.
    """
    from airflow_provider_spotsched.config import CONFIG
    from airflow_provider_spotsched.hooks.local_connection import connection_type_info

    package = "airflow_provider_spotsched"
    return {
        "package-name": "airflow-provider-spotsched",
        "name": "Spot Scheduler",
        "description": "Deadline-aware LLM fine-tuning on a mix of spot and on-demand GPU instances.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Spot Scheduler",
                "external-doc-url": "https://github.com/airflow-provider-spotsched/airflow-provider-spotsched",
                "tags": ["service"],
            }
        ],
        "operators": [
            {
                "integration-name": "Spot Scheduler",
                "python-modules": [f"{package}.operators.fine_tune", f"{package}.operators.forecast", f"{package}.operators.solver"],
            }
        ],
        "sensors": [{"integration-name": "Spot Scheduler", "python-modules": [f"{package}.sensors.market"]}],
        "hooks": [
            {
                "integration-name": "Spot Scheduler",
                "python-modules": [
                    f"{package}.hooks.local",
                    f"{package}.hooks.compute",
                    f"{package}.hooks.market_data",
                ],
            }
        ],
        "triggers": [
            {
                "integration-name": "Spot Scheduler",
                "python-modules": [f"{package}.triggers.spot_job", f"{package}.triggers.market"],
            }
        ],
        "connection-types": [connection_type_info(f"{package}.hooks.local.LocalSpotHook")],
        "extra-links": [f"{package}.links.report.SpotRunReportLink"],
        "asset-uris": [
            {
                "schemes": ["spotsched"],
                "handler": f"{package}.assets.sanitize_uri",
                "factory": f"{package}.assets.create_asset",
                "to_openlineage_converter": f"{package}.assets.convert_asset_to_openlineage",
            }
        ],
        "config": CONFIG,
    }
