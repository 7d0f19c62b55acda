"""Hooks: build compute backends and market feeds from Airflow connections."""
