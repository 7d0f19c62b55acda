"""The divergence guard: a NaN/inf or exploding loss rolls training back to the last good checkpoint.

A step's loss (the global mean, identical on every rank) is judged *before* its update is
applied: it is bad when it is not finite, or when it exceeds ``explode_factor`` (default 4) times
the median of the last ``window`` (default 20) good losses, judged once at least ``window // 2``
losses are known. On a bad loss the runtime restores the newest checkpoint (only guard-approved
states are ever checkpointed) and multiplies the learning rate by ``lr_backoff`` (default 0.5);
the batches are replayed, not skipped, so the data order stays a function of the position. After
``max_rollbacks`` (default 3) rollbacks the job fails with a clear error rather than loop.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from airflow_provider_spotsched.runtime.config import GuardSettings


class DivergenceError(RuntimeError):
    """Training kept diverging after the allowed number of rollbacks."""


def bad_loss_reason(loss: float, recent: Sequence[float], settings: GuardSettings) -> str | None:
    """Why ``loss`` must not be applied (None when it is fine)."""
    if not math.isfinite(loss):
        return f"loss is {loss}"
    window = list(recent)[-settings.window:]
    if len(window) >= max(1, settings.window // 2):
        median = statistics.median(window)
        if median > 0 and loss > settings.explode_factor * median:
            return f"loss {loss:.4g} exceeds {settings.explode_factor} x the recent median {median:.4g}"
    return None


def check_rollback_allowed(rollbacks_done: int, reason: str, settings: GuardSettings) -> None:
    """Raise :class:`DivergenceError` when one more rollback would exceed ``max_rollbacks``."""
    if rollbacks_done >= settings.max_rollbacks:
        raise DivergenceError(
            f"training diverged ({reason}) after {rollbacks_done} rollback(s), the maximum "
            "(guard.max_rollbacks): lower lr, check the data, or raise guard.max_rollbacks"
        )
