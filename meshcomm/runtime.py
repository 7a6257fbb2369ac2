"""Process-wide state: which backend this process runs under and which devices it owns.

Without `meshcomm.init(...)` there is no context and one process owns every device.
"""
from __future__ import annotations

_CTX = None


def current():
    """The active distributed context, or None (single process owns all devices)."""
    return _CTX


def _set(ctx) -> None:
    global _CTX
    _CTX = ctx
