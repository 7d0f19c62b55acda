"""Operators: the Airflow tasks that fine-tune on a deadline-aware mix of spot and on-demand GPUs."""
