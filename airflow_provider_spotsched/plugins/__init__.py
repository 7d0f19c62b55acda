"""Airflow plugins of the provider: the per-run report pages served by Airflow's API server."""
