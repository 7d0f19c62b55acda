"""Running a job for real: the slot loop over a compute backend and a market feed, Airflow-free."""
