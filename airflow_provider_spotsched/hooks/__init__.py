"""Hooks: build compute backends and market feeds from Airflow connections, and read templated arguments back."""
