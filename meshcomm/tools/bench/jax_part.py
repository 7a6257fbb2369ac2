"""The JAX part of `meshcomm bench run`: one process with N JAX CPU devices, jax.device_put to
the new sharding beside meshcomm's in-memory reshard of the same jax.Array
(meshcomm.adapters.jax.reshard_jax). Run in a subprocess of its own (`run_subprocess`), away
from the MPI launch."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ..cases import global_array
from ..common import importable

__all__ = ["run_jax_part", "run_subprocess"]


def run_jax_part(args, cases) -> dict:
    """{case name: {method: {"time_s", "exact", "note"}, "jax_copies": bool}} for the cases
    JAX can express. The two methods alternate, one call each per round (the same load on
    a shared machine), each on a source array of its own; the median over rounds is kept.
    `jax_copies` (`meshcomm_copies`) is False where every shard of jax.device_put's
    (meshcomm's) result lies in a source shard's memory (nothing moved), True where it copied."""
    import jax
    from meshcomm.adapters.jax import expressible, reshard_jax, sharding_from_layout
    out = {}
    ndev = len(jax.devices())
    for i, case in enumerate(cases):
        why = expressible(case.src, case.shape) or expressible(case.dst, case.shape)
        if why:
            continue
        if max(case.src.mesh.device_ids + case.dst.mesh.device_ids) >= ndev:
            continue
        g = global_array(case.shape, 1000 + i, case.dtype)
        ss, ds = sharding_from_layout(case.src, case.shape), sharding_from_layout(case.dst, case.shape)
        methods = {"jax.device_put": lambda x: jax.device_put(x, ds), "meshcomm-local": lambda x: reshard_jax(x, ds)}
        res, ts, last = {}, {k: [] for k in methods}, {}
        for name, fn in methods.items():       # warm-up; a method JAX refuses is reported
            try:
                jax.block_until_ready(fn(_fresh(g, ss)))
            except Exception as e:  # noqa: BLE001 - JAX refuses some cases: report it
                res[name] = {"time_s": None, "exact": None, "note": f"{type(e).__name__}: {e}"[:200]}
        for _ in range(args.repeats):
            for name, fn in methods.items():
                if name in res:
                    continue
                # a new source array per call: JAX caches an array's host copy (`_value`),
                # and a later device_put of the same array would reuse it instead of moving data
                x = _fresh(g, ss)
                t0 = time.perf_counter()
                last[name] = fn(x)
                jax.block_until_ready(last[name])
                ts[name].append(time.perf_counter() - t0)
                key = "jax_copies" if name == "jax.device_put" else "meshcomm_copies"
                res[key] = not _aliases(last[name], x)
        for name, y in last.items():
            ok = bool(np.array_equal(np.asarray(y), g))
            res[name] = {"time_s": statistics.median(ts[name]), "exact": ok, "note": ""}
        out[case.name] = res
    return out


def _fresh(g, sharding):
    """A new jax.Array of `g` with `sharding`, its buffers ready."""
    import jax
    x = jax.device_put(g, sharding)
    x.block_until_ready()
    return x


def _aliases(y, x) -> bool:
    """Whether every shard of `y` lies inside the memory of one of `x`'s shards: JAX moved
    no data (on CPU it adopts a contiguous slice of a source buffer as the new shard)."""
    spans = [(b, b + s.data.nbytes) for s in x.addressable_shards
             for b in [s.data.unsafe_buffer_pointer()]]
    for s in y.addressable_shards:
        p = s.data.unsafe_buffer_pointer()
        if not any(lo <= p and p + s.data.nbytes <= hi for lo, hi in spans):
            return False
    return True


def run_subprocess(args) -> dict:
    """`meshcomm bench run --part jax` in a fresh process with args.procs CPU devices (no MPI
    launcher variables): its rows, or {"_error": why}."""
    if not importable("jax"):
        return {"_error": "jax is not installed (pip install meshcomm[jax])"}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDI_", "HYDRA_", "MPI_", "OMPI_"))}
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.procs}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "jax.json")
        cmd = [sys.executable, "-m", "meshcomm", "bench", "run", "--part", "jax", "--out", path,
               "--procs", str(args.procs), "--size-mb", str(args.size_mb), "--repeats", str(args.repeats)]
        if args.only:
            cmd += ["--only", args.only]
        try:
            r = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {"_error": f"the JAX part did not finish within {args.timeout:g} s"}
        if r.returncode != 0:
            return {"_error": f"the JAX part failed: {r.stderr.strip()[-500:]}"}
        with open(path) as f:
            return json.load(f)
