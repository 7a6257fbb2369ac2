"""`make demo`: reshard Alpa's benchmark cases across 8 local processes with each backend.

    python -m meshcomm.demo                      # 8 processes under the venv's mpiexec
    python -m meshcomm.demo --procs 8 --mib 16 --backends mpi,torch,mixed --repeats 3
    python -m meshcomm.demo --local              # one process, in-memory local backend

Alpa's cases (meshcomm/data/alpa_resharding_cases.json: 2x4 -> 2x4 meshes of p3.8xlarge
nodes, 2 GiB int32 tensors) are scaled to this machine: "nodes" of 2 devices, so a 2x4 mesh
becomes 2x2 and the two meshes sit on devices 0..3 and 4..7; tensors are ~16 MiB float32.
Every process builds the same seeded global tensor, takes its src tiles, calls
`meshcomm.reshard` (SPMD) and checks its dst tiles against `meshcomm.shard` of the same data
(rank 0 also reassembles the whole result with `meshcomm.unshard`). Per case it prints the
median time (max over processes) of a few rounds after a warm-up (the baseline and the backends
take turns within each round, so all see the same machine load), the plan's bytes moved, the
effective bandwidth (bytes moved / time), and, for comparison, an allgather-then-slice of the
same data ("ag+slice": meshcomm.planners.baselines.allgather_slice, every dst device receives
the whole tensor along ring-allgather chains and keeps its box, run by the same executor over
MPI). `--mpi-allgather` adds MPI's own Allgatherv of the src tiles followed by slicing.

When the distributed backends are not available (or the launch fails), the demo runs the
same cases in one process with the local backend and says so.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from importlib import resources

import numpy as np

from . import notation
from .layout import Layout
from .mesh import Mesh

DEFAULT_BACKENDS = ("mpi", "torch", "mixed")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    src: Layout
    dst: Layout
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _scale_mesh(devs, start: int, gpus_per_node: int) -> Mesh:
    """Keep the node count, shrink GPUs per node; devices numbered from `start`."""
    arr = np.asarray(devs)
    rows = arr.shape[0] if arr.ndim == 2 else 1
    cols = min(arr.shape[-1], gpus_per_node)
    return Mesh(np.arange(start, start + rows * cols).reshape(rows, cols), ("x", "y"))


def _scale_shape(shape, target_elems: int, divisors) -> tuple[int, ...]:
    """Scale `shape` down by a common power of two per dimension so that the element count is
    close to target_elems, keeping every dimension divisible by what the layouts split it."""
    shape = list(shape)
    while math.prod(shape) > target_elems:
        i = int(np.argmax(shape))
        if shape[i] % 2 or (shape[i] // 2) % divisors[i]:
            # try the next biggest dimension that can be halved
            order = sorted(range(len(shape)), key=lambda j: -shape[j])
            for j in order:
                if shape[j] % 2 == 0 and (shape[j] // 2) % divisors[j] == 0:
                    i = j
                    break
            else:
                break
        shape[i] //= 2
    return tuple(shape)


def alpa_cases(procs: int = 8, mib: float = 16.0) -> list[Case]:
    """Alpa's n-to-m and 1-to-m cases scaled to `procs` devices and ~`mib` MiB float32."""
    data = json.loads(resources.files("meshcomm").joinpath("data/alpa_resharding_cases.json").read_text())
    target = int(mib * 2**20 / 4)
    gpn = max(1, procs // 4)              # 2 devices per "node" on 8 processes
    cases = []
    for c in data["n_to_m"]:
        src_m = _scale_mesh(c["src_mesh"], 0, gpn)
        dst_m = _scale_mesh(c["dst_mesh"], src_m.size, gpn)
        if src_m.size + dst_m.size > procs:
            # too many nodes for this machine: shrink the src mesh to one device per node
            src_m = Mesh(np.arange(len(c["src_mesh"])).reshape(-1, 1), ("x", "y"))
            dst_m = _scale_mesh(c["dst_mesh"], src_m.size, gpn)
            if src_m.size + dst_m.size > procs:
                continue
        src = Layout(src_m, tuple(c["src_spec"]))
        dst = Layout(dst_m, tuple(c["dst_spec"]))
        divs = [math.lcm(_ways(src, d), _ways(dst, d)) for d in range(len(c["shape"]))]
        shape = _scale_shape(c["shape"], target, divs)
        cases.append(Case(f"alpa{c['case']}", shape, src, dst))
    one = data["one_to_m"]
    for i, dm in enumerate(one["dst_meshes"]):
        arr = np.asarray(dm)
        rows, cols = arr.shape
        if 1 + rows * cols > procs:
            continue
        src = Layout(Mesh([[0]], ("x", "y")), (None,))
        dst = Layout(Mesh(np.arange(1, 1 + rows * cols).reshape(rows, cols), ("x", "y")), (None,))
        cases.append(Case(f"1to{rows * cols}" + (f"({rows}x{cols})" if rows > 1 else ""),
                          (target,), src, dst))
    return cases


def extra_cases(procs: int = 8, mib: float = 16.0) -> list[Case]:
    """Cases outside Alpa's reach: uneven splits, explicit Blocks, a pending sum."""
    if procs < 8:
        return []
    n = int(mib * 2**20 / 4)
    rows = max(7, n // 1000)
    shape = (rows - rows % 2 + 1, 1000)    # odd: uneven 4-way split
    a = Mesh([[0, 1], [2, 3]], ("x", "y"))
    b = Mesh([[4, 5], [6, 7]], ("x", "y"))
    c = Mesh([[2, 3, 4, 5]], ("x", "y"))
    from .layout import Blocks
    r0 = shape[0]
    return [
        Case("uneven", shape, Layout(a, (("x", "y"), None)), Layout(b, (None, ("y", "x")))),
        Case("blocks", shape, Layout(a, ("x", "y")),
             Layout(c, (Blocks("y", [r0 // 8, r0 // 4, r0 // 2, r0 - r0 // 8 - r0 // 4 - r0 // 2]), None))),
        # int32 so that the random addends of the pending sum add up exactly
        Case("partial", shape, Layout(a, (None, "y"), partial=("x",)), Layout(b, ("x", "y")), "int32"),
    ]


def _ways(layout: Layout, dim: int) -> int:
    e = layout.spec[dim] if dim < len(layout.spec) else None
    if e is None:
        return 1
    return math.prod(layout.mesh.axis_size(a) for a in e)


def global_array(shape, seed: int, dtype: str = "float32") -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
    return rng.integers(-1000, 1000, size=shape, dtype=dtype)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


HEADER = (f"{'case':<11s} {'shape':<15s} {'src -> dst':<34s} {'backend':<9s} {'time ms':>9s} "
          f"{'moved':>10s} {'GB/s':>7s} {'exact':>6s}")


def row(case: Case, backend: str, seconds: float, moved: int, exact: str) -> str:
    layouts = f"{notation.format_layout(case.src)} -> {notation.format_layout(case.dst)}"
    bw = moved / seconds / 1e9 if seconds > 0 else float("nan")
    shape = "x".join(map(str, case.shape))
    return (f"{case.name:<11s} {shape:<15s} {layouts:<34s} {backend:<9s} {seconds * 1e3:9.2f} "
            f"{fmt_bytes(moved):>10s} {bw:7.2f} {exact:>6s}")


# -- one process, local backend -----------------------------------------------------------

def run_local(cases, repeats: int, seed: int) -> int:
    import meshcomm as mc
    print(HEADER)
    bad = 0
    for i, case in enumerate(cases):
        g = global_array(case.shape, seed + i, case.dtype)
        x = mc.shard(g, case.src, seed=seed)
        p = mc.plan(case.shape, case.dtype, case.src, case.dst)
        y = mc.reshard(x, case.src, case.dst, shape=case.shape)      # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            y = mc.reshard(x, case.src, case.dst, shape=case.shape)
            times.append(time.perf_counter() - t0)
        ok = np.array_equal(mc.unshard(y, case.dst), g)
        bad += not ok
        print(row(case, "local", statistics.median(times), p.bytes_moved, "yes" if ok else "NO"),
              flush=True)
    return 1 if bad else 0


# -- the driver -----------------------------------------------------------------------------

def find_mpiexec() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    return shutil.which("mpiexec")


def distributed_available() -> str | None:
    """None when the distributed backends can run, else why not."""
    import meshcomm
    if not hasattr(meshcomm, "init"):
        return "meshcomm.init is not available yet"
    try:
        import meshcomm.backends.mpi  # noqa: F401
    except Exception as e:           # noqa: BLE001 - report any import failure
        return f"meshcomm.backends.mpi does not import ({type(e).__name__}: {e})"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed"
    if find_mpiexec() is None:
        return "no mpiexec next to the Python interpreter or on PATH"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m meshcomm.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=8, help="processes (= devices), default 8")
    ap.add_argument("--mib", type=float, default=16.0, help="tensor size in MiB, default 16")
    ap.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                    help="comma-separated backends to run (default mpi,torch,mixed)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed rounds per case (median; methods interleaved within a round)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default="", help="comma-separated case names to run (default all)")
    ap.add_argument("--no-extra", action="store_true", help="only Alpa's cases")
    ap.add_argument("--no-baseline", action="store_true", help="skip the allgather-then-slice row")
    ap.add_argument("--mpi-allgather", action="store_true",
                    help="also time MPI Allgatherv of the src tiles, then slice (a user's plain version)")
    ap.add_argument("--local", action="store_true", help="one process, local backend")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole launch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    cases = alpa_cases(args.procs, args.mib) + ([] if args.no_extra else extra_cases(args.procs, args.mib))
    if args.cases:
        want = set(args.cases.split(","))
        cases = [c for c in cases if c.name in want]
    if args.worker:
        from .demo_worker import worker_main
        return worker_main(cases, args)

    print(f"meshcomm demo: {len(cases)} resharding cases from Alpa's benchmark (scaled: 2 devices "
          f"per node, ~{args.mib:g} MiB float32), median of {args.repeats} after a warm-up")
    why = None if not args.local else "--local given"
    if why is None:
        why = distributed_available()
    if why is None:
        mpiexec = find_mpiexec()
        cmd = [mpiexec, "-n", str(args.procs), sys.executable, "-m", "meshcomm.demo", "--worker",
               "--procs", str(args.procs), "--mib", str(args.mib), "--backends", args.backends,
               "--repeats", str(args.repeats), "--seed", str(args.seed)]
        if args.cases:
            cmd += ["--cases", args.cases]
        if args.no_extra:
            cmd.append("--no-extra")
        if args.no_baseline:
            cmd.append("--no-baseline")
        if args.mpi_allgather:
            cmd.append("--mpi-allgather")
        print(f"launching {args.procs} processes: {mpiexec} -n {args.procs} python -m meshcomm.demo "
              "--worker ...", flush=True)
        env = dict(os.environ)
        env.setdefault("MESHCOMM_TIMEOUT", "120")
        env.setdefault("OMP_NUM_THREADS", "1")
        try:
            r = subprocess.run(cmd, timeout=args.timeout, env=env)
            if r.returncode == 0:
                return 0
            why = f"the {args.procs}-process run exited with status {r.returncode}"
        except subprocess.TimeoutExpired:
            why = f"the {args.procs}-process run did not finish within {args.timeout:g} s"
        print(f"meshcomm demo: FAILED: {why}", flush=True)
        print("NOTE: the same cases in ONE process with the local backend, for reference; the "
              "distributed backends are NOT exercised below.", flush=True)
        run_local(cases, args.repeats, args.seed)
        return 1
    print(f"NOTE: running in ONE process with the local backend ({why}); the distributed "
          f"backends are not exercised.", flush=True)
    return run_local(cases, args.repeats, args.seed)


if __name__ == "__main__":
    sys.exit(main())
