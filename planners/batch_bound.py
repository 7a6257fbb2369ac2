"""The bandwidth lower bound of a whole batch (planners/bounds.py, summed over the tensors).

Every tensor's elements are its own data, so the bytes each link is forced to carry add up
over the tensors of a batch; the bound is the busiest link's sum over its bandwidth
(``bounds.link_bound``). Alike tensors (same shape, element size and layouts) are bounded
once.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from .bounds import LinkBound, link_bound, lower_bound_bytes
from .topology import Topology

__all__ = ["batch_lower_bound"]


def batch_lower_bound(entries, topology: Topology) -> LinkBound:
    """The LinkBound of moving every (name, shape, dtype, itemsize, src, dst) of `entries`."""
    count = Counter((e[1], e[3], e[4], e[5]) for e in entries)
    links: dict = defaultdict(int)
    for (shape, itemsize, src, dst), k in count.items():
        for key, nb in lower_bound_bytes(shape, itemsize, src, dst, topology).links.items():
            links[key] += nb * k
    return link_bound(dict(links), topology)
