"""meshcomm.backends: executors of a plan (imported as meshcomm.backends).

A backend never decides what to send: it runs the planner's transfers in the global order.
"""
from __future__ import annotations

import importlib

__all__ = ["get_backend", "BACKENDS"]

BACKENDS = {
    "local": ("meshcomm.backends.local", "LocalBackend"),
    "mpi": ("meshcomm.backends.mpi", "MPIBackend"),
    "torch": ("meshcomm.backends.torch_dist", "TorchBackend"),
    "mixed": ("meshcomm.backends.mixed", "MixedBackend"),
}


def get_backend(name: str):
    try:
        mod, cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(BACKENDS)}") from None
    return getattr(importlib.import_module(mod), cls)
