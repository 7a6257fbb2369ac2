"""Adapters between meshcomm and framework arrays. Imported lazily: `import meshcomm`
never imports jax or torch; the first use of a name below imports its framework.

* JAX: ``reshard_jax(x, dst)`` (a jax.Array, or a pytree of them moved as one batch),
  ``layout_from_sharding(sharding, shape)``, ``sharding_from_layout(layout, shape=None)``
  (meshcomm.adapters.jax)
* torch DTensor: ``reshard_dtensor(dt, device_mesh, placements)``,
  ``reshard_state_dict(sd, device_mesh, placements)`` (a dict of DTensors as one batch),
  ``layout_from_placements(device_mesh, placements, shape)`` (meshcomm.adapters.dtensor)
"""
from __future__ import annotations

import importlib

_NAMES = {
    "reshard_jax": "jax",
    "layout_from_sharding": "jax",
    "sharding_from_layout": "jax",
    "reshard_dtensor": "dtensor",
    "reshard_state_dict": "dtensor",
    "layout_from_placements": "dtensor",
    "placements_from_layout": "dtensor",
}

__all__ = sorted(_NAMES)


def __getattr__(name):
    mod = _NAMES.get(name)
    if mod is None:
        raise AttributeError(f"module 'meshcomm.adapters' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


def __dir__():
    return sorted(list(globals()) + list(_NAMES))
