"""Compute backends: local processes, EC2 and Compute Engine behind one interface."""
