"""The fleet dashboard over every spot run the caller may read (being built)."""

from __future__ import annotations

from fastapi import APIRouter

FLEET_ROUTE = "/fleet"

router = APIRouter()
