"""Sensors that wait on the spot market in the triggerer rather than in a worker slot."""
