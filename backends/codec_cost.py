"""What compression costs on this machine, and the choices that follow: codec throughput, the link, `compression="auto"` and the reduce algorithm.

Inputs of the cost model (planners/compressed.CodecCost inside planners/simulate.py):

* Codec throughput of one process while every process codes: the `meshcomm tune` file
  (MESHCOMM_TUNING; its "codecs" list: {"op": "codec", "codec": "zfp(rate=8)",
  "encode_GBps": .., "decode_GBps": .., "world": n}) when it has the codec, else built-in per-core figures
  (`PER_CORE_GBPS`, measured on a quiet 2-core host of this project) times
  min(1, cores / processes on the host).
* The link: under MESHCOMM_EMULATE_GBPS=g, g Gb/s out of every emulated node; else the
  tuning table's largest measured `send` (point-to-point) bandwidth; else
  `LOCAL_GBPS`, what MPI's shared memory moves between processes of one host here (several
  GB/s). Against such a link a CPU codec near 0.2 GB/s per core never pays: "auto"
  compresses nothing on one host unless the link is emulated (or measured) slow.

Every input is the same on every process of a launch (same environment, same table, same
host size), so every process makes the same choice; the agreement check compares the raw
argument and the settings (`agreement_key`) beforehand.
"""
from __future__ import annotations

import json
import os

from meshcomm.planners.compressed import CodecCost, Compression, replicated_reductions
from meshcomm.planners.topology import Topology

from meshcomm import settings
from meshcomm.arrays import numpy_dtype
from meshcomm.caches import memo
from meshcomm.compression import AUTO, ZFP, Cast, coerce

from .tuning import table_from_env

__all__ = ["AUTO_CANDIDATES", "LOCAL_GBPS", "PER_CORE_GBPS", "agreement_key", "check", "choose_reduce", "link",
           "resolve", "speed"]

# (encode, decode) GB/s of uncompressed bytes, one core, 4 MiB float32 normal values
PER_CORE_GBPS = {"zfp": (0.2, 0.2), "bf16": (4.0, 8.0), "fp16": (0.5, 2.0)}
LOCAL_GBPS = 40.0           # MPI over shared memory between processes of one host (~5 GB/s)
AUTO_CANDIDATES = (Cast("bf16"), ZFP(rate=16))     # about bf16's accuracy, 2x smaller
PAYS = 0.9                  # compress only when the model's time is at most this fraction


# How compressed reductions run: "auto" (the cost model's choice, one-shot on ties), "oneshot"
# (each addend coded once, sent to its root) or "ring" (each hop decodes, adds, re-encodes).
REDUCE_ALGORITHM = "auto"
# True: the point-to-point compression baseline of the benchmarks (whole messages, decoded and
# re-encoded at every hop). Both are set by tests and benchmarks, the same on every process.
PER_HOP = False


def agreement_key(arg) -> str | None:
    """The `("codec", ...)` field of the agreement: the argument and the settings that
    decide how it runs ("none" without compression: a field every process knows, so the
    agreement's one-allreduce form can still decide)."""
    c = coerce(arg)
    if c is None:
        return "none"
    key = f"{c} reduce={REDUCE_ALGORITHM} chunk={settings.get('COMPRESSION_CHUNK')}"
    if PER_HOP:
        key += " per-hop"
    if c is AUTO:
        key += f" link={settings.get('EMULATE_GBPS')}/{settings.get('EMULATE_NODE_SIZE')}"
    return key


def check(arg, dtype_name: str | None, devtype: str | None, what: str) -> None:
    """TypeError when a concrete codec cannot code these tiles (CUDA tensors; ZFP: other
    than float32/float64; casts: other than floats), naming the dtype and the codec."""
    c = coerce(arg)
    if c is None or c is AUTO:
        return
    if devtype not in (None, "cpu"):
        raise TypeError(f"{what}: compression={c} codes on the host; the tiles are on {devtype} "
                        "(move them to the CPU, or pass compression=None)")
    if dtype_name is not None:
        c.max_wire_bytes((4,), numpy_dtype(dtype_name))      # TypeError naming dtype and codec


def _host_processes(backend, world: int) -> int:
    hosts = None if backend is None else backend.hosts
    if hosts:
        return sum(1 for h in hosts if h == hosts[backend.rank])
    return max(1, world)


@memo(maxsize=8)
def _codec_entries(path) -> tuple:
    """The "codecs" list of a `meshcomm tune` file (a table read and checked by tuning)."""
    if not path:
        return ()
    with open(path, "rb") as f:
        d = json.loads(f.read().decode("utf-8"))
    return tuple(m for m in d.get("codecs", ()) if isinstance(m, dict) and m.get("op") == "codec")


def speed(codec, processes_per_host: int) -> tuple[float, float]:
    """(encode, decode) bytes/s of one process while all code at once."""
    path = settings.get("TUNING")
    if path:
        table_from_env()                # a missing or malformed file: tuning's error naming the variable
    for m in _codec_entries(path):
        if m.get("codec") == str(codec):
            return float(m["encode_GBps"]) * 1e9, float(m["decode_GBps"]) * 1e9
    key = "zfp" if isinstance(codec, ZFP) else codec.to
    share = min(1.0, (os.cpu_count() or 1) / max(1, processes_per_host))
    enc, dec = PER_CORE_GBPS[key]
    return enc * share * 1e9, dec * share * 1e9


def link(devices_per_process: int) -> Topology:
    """The topology the model prices links with (module docstring)."""
    g = settings.get("EMULATE_GBPS")
    if g is not None:
        return Topology(devices_per_process * settings.get("EMULATE_NODE_SIZE"), intra_node_gbps=LOCAL_GBPS,
                        inter_node_gbps=g, intra_node_latency_s=5e-6, inter_node_latency_s=20e-6,
                        name=f"emulated {g:g} Gb/s")
    sends = [m for m in table_from_env().measurements if isinstance(m, dict) and m.get("op") == "send"
             and m.get("algbw_GBps")]
    gbps = LOCAL_GBPS
    if sends:
        gbps = 8 * float(max(sends, key=lambda m: m["bytes"])["algbw_GBps"])
    return Topology(devices_per_process, intra_node_gbps=max(gbps, LOCAL_GBPS), inter_node_gbps=gbps,
                    intra_node_latency_s=5e-6, inter_node_latency_s=20e-6, name=f"measured {gbps:.3g} Gb/s")


def _cost(plan, comp: Compression, topo: Topology, procs: int) -> float:
    enc, dec = speed(comp.codec, procs)
    return plan.simulate(topo, compression=CodecCost(comp, enc, dec))


def choose_reduce(plan, comp: Compression, topo: Topology, procs: int) -> Compression:
    """`comp` with the reduce algorithm REDUCE_ALGORITHM names, or (auto) the one the model
    finds faster; one-shot on ties (each addend coded once: smaller error)."""
    mode = REDUCE_ALGORITHM
    if mode != "auto":
        return Compression(comp.codec, mode, comp.per_hop, comp.chunk_bytes, comp.strip)
    if comp.per_hop:
        return Compression(comp.codec, "ring", True, comp.chunk_bytes, comp.strip)
    if not any(t.kind == "reduce" and len(t.srcs) > 2 for t in plan.transfers) or replicated_reductions(plan):
        return comp                     # replicated roots: one-shot keeps the replicas equal
    one = Compression(comp.codec, "oneshot", False, comp.chunk_bytes, comp.strip)
    ring = Compression(comp.codec, "ring", False, comp.chunk_bytes, comp.strip)
    return ring if _cost(plan, ring, topo, procs) < 0.95 * _cost(plan, one, topo, procs) else one


def resolve(arg, plan, *, backend=None, world: int = 1, devices_per_process: int = 1, strip: int = 0,
            local: bool = False) -> Compression | None:
    """The Compression a call runs with, or None. `local`: one process owns every device
    (nothing travels, so "auto" compresses nothing; a concrete codec still applies, so the
    results are the same as under a launcher). Cached by its inputs and the settings."""
    c = coerce(arg)
    if c is None or (c is AUTO and local):
        return None
    env = (PER_HOP, settings.get("COMPRESSION_CHUNK"), REDUCE_ALGORITHM) + tuple(
        settings.get(k) for k in ("EMULATE_GBPS", "EMULATE_NODE_SIZE", "TUNING"))
    return _resolve(c, plan, _host_processes(backend, world), devices_per_process, strip, env)


@memo(maxsize=1024)
def _resolve(c, plan, procs: int, devices_per_process: int, strip: int, env: tuple) -> Compression | None:
    per_hop, chunk = env[0], env[1]
    topo = link(devices_per_process)
    if c is AUTO:
        if numpy_dtype(plan.dtype).name not in ("float32", "float64") or not plan.transfers:
            return None
        best, best_t = None, plan.simulate(topo) * PAYS
        for cand in AUTO_CANDIDATES:
            comp = choose_reduce(plan, Compression(cand, "oneshot", per_hop, chunk, strip), topo, procs)
            t = _cost(plan, comp, topo, procs)
            if t < best_t:
                best, best_t = comp, t
        return best
    return choose_reduce(plan, Compression(c, "oneshot", per_hop, chunk, strip), topo, procs)
