"""The fine-tuning runtime: LoRA fine-tuning with elastic data parallelism, checkpoints and preemption.

Run one process per instance: ``python -m airflow_provider_spotsched.runtime --config CONFIG.json
--checkpoint-uri URI`` (see docs/runtime.md). What it promises its callers (exit codes, the
progress file) is in :mod:`.contract`, which, like this package's top level, imports neither torch
nor Airflow, so that backends can use it without the training stack installed.
"""
