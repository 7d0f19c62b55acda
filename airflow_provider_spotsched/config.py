"""The ``[spotsched]`` section of Airflow's configuration: the provider's deployment-wide defaults.

Declared in the provider info (``config``), so ``airflow config list`` shows the options with
their descriptions and ``conf.get("spotsched", ...)`` knows their defaults. A DAG's argument or
a connection's extra wins over them. This module imports nothing.
"""

from __future__ import annotations

from typing import Any

SECTION = "spotsched"

CONFIG: dict[str, Any] = {
    SECTION: {
        "description": "Defaults of the Spot Scheduler provider (airflow-provider-spotsched) for every DAG\n"
        "of the deployment.\n",
        "options": {
            "selector_state_variable": {
                "description": "The Airflow Variable holding the selector's learnt state, when an operator\n"
                "names none. Runs that share it learn together.\n",
                "version_added": "0.1.0",
                "type": "string",
                "example": "spotsched_selector_state_team_a",
                "default": "spotsched_selector_state",
            },
            "default_poll_interval": {
                "description": "Seconds between status polls of a running job, when an operator gives no\n"
                "poll_interval. Empty: a tenth of a slot, at most 60 seconds.\n",
                "version_added": "0.1.0",
                "type": "float",
                "example": "30",
                "default": None,
            },
            "min_deferral_seconds": {
                "description": "The least time a deferral between slots lasts: a wake (a preemption, the job's end)\n"
                "is held until then, and a wait shorter than this is waited in the worker. Airflow 3.3\n"
                "fails a task resumed before the scheduler has read the executor's report of the worker\n"
                "that deferred it (apache/airflow#71580); the scheduler reads it within seconds. 0 turns\n"
                "the guard off.\n",
                "version_added": "0.1.0",
                "type": "float",
                "example": "30",
                "default": "15",
            },
            "max_instances_limit": {
                "description": "The most instances one job may ask for (max_instances): a larger job is refused\n"
                "before anything launches. Raise it where jobs really run on more; the account's own\n"
                "quota is checked too where the backend can read it (EC2).\n",
                "version_added": "0.1.0",
                "type": "integer",
                "example": "256",
                "default": "1024",
            },
            "local_workdir": {
                "description": "The local backend's work directory (job directories, default checkpoints), when its\n"
                "spotsched_local connection and the operator's backend_options give no workdir.\n"
                "Empty: $AIRFLOW_HOME/spotsched.\n",
                "version_added": "0.1.0",
                "type": "string",
                "example": "/data/spotsched",
                "default": None,
            },
        },
    }
}
"""The provider info's ``config`` entry."""
