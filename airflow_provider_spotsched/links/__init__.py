"""Operator extra links: buttons on a task instance that lead to the provider's pages."""
