"""Triggers: wait in the triggerer, holding no worker slot, until a run must decide again."""
