"""The fixed cost of a one-process reshard of a jax.Array: a tiny array, so nothing but the
call is timed. `jax.device_put` to the new sharding beside `meshcomm.adapters.reshard_jax`,
alternating, each on a fresh source array; medians in microseconds.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python benchmarks/jax_local_overhead.py [--reps 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from meshcomm.adapters.jax import reshard_jax
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 JAX devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices()[:8])
    g = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    src = NamedSharding(mesh, P(("x", "y")))
    for name, dst in (("rows -> replicated", NamedSharding(mesh, P())),
                      ("rows -> columns", NamedSharding(mesh, P(None, ("x", "y"))))):
        fns = {"jax.device_put": lambda x: jax.device_put(x, dst), "reshard_jax": lambda x: reshard_jax(x, dst)}
        ts = {k: [] for k in fns}
        for rep in range(args.reps + 5):
            for k, f in fns.items():
                x = jax.device_put(g, src)
                x.block_until_ready()
                t0 = time.perf_counter()
                f(x).block_until_ready()
                if rep >= 5:
                    ts[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e6 for k, v in ts.items()}
        print(f"{name:20s} " + "  ".join(f"{k} {v:.0f} us" for k, v in med.items())
              + f"  ratio {med['jax.device_put'] / med['reshard_jax']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
