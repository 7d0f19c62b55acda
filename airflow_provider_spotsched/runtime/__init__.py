"""The fine-tuning runtime: LoRA fine-tuning with elastic data parallelism, checkpoints and preemption.

Run one process per instance: ``python -m airflow_provider_spotsched.runtime --config CONFIG.json
--checkpoint-uri URI`` (see docs/runtime.md). This package's top level imports neither torch nor
Airflow, so that backends can use the exit codes below without the training stack installed.
"""

from __future__ import annotations

EXIT_DONE = 0  # the job's work is done; the final adapter is under URI/final/
EXIT_FAILURE = 1  # training failed (message on stderr)
EXIT_USAGE = 2  # bad arguments or config (message on stderr names the field)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM or a notice after an emergency checkpoint; resumable
