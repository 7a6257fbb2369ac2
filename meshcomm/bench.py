"""`meshcomm bench`: meshcomm beside the baselines, in one run.

    meshcomm bench sim  [--topology p3.8xlarge] [--json FILE] [--plot FILE.png]
    meshcomm bench plan [--topology NAME] [--repeats N] [--max-devices 4096] [--json FILE]
    mpiexec -n 8 meshcomm bench run [--size-mb N] [--json FILE]   (or without mpiexec: it launches)

``sim`` is simulated: every case is planned by meshcomm and by each baseline
(meshcomm.planners.baselines), every plan is verified, and the flow-level simulator
(meshcomm.planners.simulate) gives seconds on the topology, beside the bandwidth lower bound
(meshcomm.lower_bound). Cases: Alpa's n-to-m and 1-to-m resharding cases
(meshcomm/data/alpa_resharding_cases.json) and meshcomm's own (uneven, Blocks, partial sums,
3-d meshes, MoE all-to-all shapes, same-mesh redistributions where DTensor applies).

``plan`` is measured: wall-clock planning time from 8 to 4096 devices, cold (plan cache and
tiling cache cleared) and cached, median of repeats.

``run`` is measured: the cases scaled to 8 local processes, really executed with each meshcomm
backend beside the allgather_slice plan (same executor, MPI), torch DTensor's redistribute
on gloo (same-mesh cases) and, in one process with 8 JAX CPU devices, jax.device_put.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from importlib import resources

import numpy as np

from .layout import Blocks, Layout
from .mesh import Mesh

__all__ = ["Case", "alpa_cases", "own_cases", "sim_rows", "plan_rows", "add_parser",
           "geomean"]

BASELINE_NAMES = ("send_recv", "alpa_broadcast", "allgather_slice", "dtensor_style")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group: str                  # "alpa n-to-m" | "alpa 1-to-m" | "own"
    shape: tuple[int, ...]
    dtype: str
    src: Layout
    dst: Layout
    note: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


# -- cases ---------------------------------------------------------------------------------

def _spec(entries) -> tuple:
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


def _load_alpa() -> dict:
    return json.loads(resources.files("meshcomm").joinpath("data/alpa_resharding_cases.json").read_text())


def alpa_cases() -> list[Case]:
    """Alpa's resharding benchmark cases (int32, p3.8xlarge device numbering)."""
    data = _load_alpa()
    axes = ("x", "y")
    out = []
    for c in data["n_to_m"]:
        src = Layout(Mesh(c["src_mesh"], axes), _spec(c["src_spec"]))
        dst = Layout(Mesh(c["dst_mesh"], axes), _spec(c["dst_spec"]))
        out.append(Case(f"alpa-n2m-{c['case']}", "alpa n-to-m", tuple(c["shape"]), "int32", src, dst))
    o = data["one_to_m"]
    src = Layout(Mesh(o["src_mesh"], axes), _spec(o["src_spec"]))
    for dm in o["dst_meshes"]:
        dst = Layout(Mesh(dm, axes), _spec(o["dst_spec"]))
        rows, cols = np.asarray(dm).shape
        out.append(Case(f"alpa-1tm-{rows}x{cols}", "alpa 1-to-m", tuple(o["shape"]), "int32", src, dst))
    return out


def own_cases() -> list[Case]:
    """meshcomm's own cases on 4-device nodes (device d on node d // 4)."""
    g = Mesh.grid
    xy = ("x", "y")
    m24 = g((2, 4), xy)                       # nodes 0, 1
    m24b = g((2, 4), xy, start=8)             # nodes 2, 3
    m34 = g((3, 4), xy, start=8)              # nodes 2, 3, 4
    m24s = g((2, 4), xy, start=4)             # nodes 1, 2: overlaps m24 on node 1
    xyz = ("x", "y", "z")
    c3a = g((2, 2, 4), xyz)                   # nodes 0..3
    c3b = g((2, 2, 4), xyz, start=16)         # nodes 4..7
    L = Layout
    return [
        Case("uneven-2x4-to-3x4", "own", (1000, 1000, 300), "int32",
             L(m24, ("x", "y")), L(m34, (("x", "y"),)), "torch.chunk splits of 1000 by 4 and 12"),
        Case("blocks-2x4-to-2x4", "own", (1000, 1000, 256), "int32",
             L(m24, (Blocks("x", [300, 700]),)), L(m24b, ("x", "y")), "explicit uneven Blocks"),
        Case("partial-reduce-2x4-to-2x4", "own", (8192, 8192), "float32",
             L(m24, (None, "y"), partial=("x",)), L(m24b, ("x", "y")), "pending sum over x reduced"),
        Case("partial-keep-2x4-to-2x4", "own", (8192, 8192), "float32",
             L(m24, ("y",), partial=("x",)), L(m24b, (None, "y"), partial=("x",)), "pending sum kept"),
        Case("mesh3d-2x2x4-to-2x2x4", "own", (1024, 1024, 256), "float32",
             L(c3a, ("x", "z", None)), L(c3b, (("y", "z"), "x", None)), "3-d meshes"),
        Case("moe-a2a-cross-2x4-to-2x4", "own", (8, 8192, 2048), "float32",
             L(m24, (None, ("x", "y"), None)), L(m24b, (("x", "y"), None, None)),
             "MoE dispatch: tokens -> experts, two meshes"),
        Case("overlap-2x4-to-2x4-shifted", "own", (4096, 4096, 16), "float32",
             L(m24, ("x", "y")), L(m24s, ("y", "x")), "meshes share node 1"),
        Case("same-moe-a2a-2x4", "own", (8, 8192, 2048), "float32",
             L(m24, (None, ("x", "y"), None)), L(m24, (("x", "y"), None, None)),
             "MoE dispatch within one mesh (all-to-all)"),
        Case("same-transpose-2x4", "own", (8192, 8192), "float32",
             L(m24, ("x", "y")), L(m24, ("y", "x")), "within one mesh"),
        Case("same-allgather-2x4", "own", (4096, 8192), "float32",
             L(m24, (("x", "y"),)), L(m24, ()), "FSDP-style all-gather within one mesh"),
        Case("same-reduce-scatter-2x4", "own", (8192, 8192), "float32",
             L(m24, (None,), partial=("x", "y")), L(m24, (("x", "y"),)),
             "gradient reduce-scatter within one mesh"),
        Case("same-partial-to-replicate-2x4", "own", (4096, 4096), "float32",
             L(m24, ("y",), partial=("x",)), L(m24, ("y",)), "all-reduce over x within one mesh"),
    ]


def all_cases() -> list[Case]:
    return alpa_cases() + own_cases()


# -- bench sim --------------------------------------------------------------------------------

def geomean(xs) -> float:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _check_plan(p) -> None:
    from .planners import baselines
    from .planners.verify import verify
    if isinstance(p, baselines.Steps):
        p.verify()
    else:
        verify(p)


def sim_row(case: Case, topology, verify: bool = True) -> dict:
    """Simulated seconds of meshcomm and every baseline on one case, and the bound."""
    from . import api
    from .planners import baselines
    from .planners.bounds import lower_bound_bytes
    from .planners.topology import Topology
    from .arrays import normalize_dtype
    topo = Topology.coerce(topology)
    _, itemsize = normalize_dtype(case.dtype)
    p = api.plan(case.shape, case.dtype, case.src, case.dst, topology=topo)
    if verify:
        _check_plan(p)
    lb = lower_bound_bytes(case.shape, itemsize, case.src, case.dst, topo)
    row = {
        "case": case.name, "group": case.group, "shape": list(case.shape), "dtype": case.dtype,
        "src": str(case.src), "dst": str(case.dst), "note": case.note, "bytes": case.nbytes,
        "topology": topo.name,
        "meshcomm_s": p.simulate(topo), "lower_bound_s": lb.seconds,
        "lower_bound_nic_bytes": lb.nic, "meshcomm_nic_bytes": p.max_link_bytes(topo, "nic"),
        "meshcomm_messages": p.messages, "baselines": {}, "baseline_nic_bytes": {},
    }
    for name in BASELINE_NAMES:
        bp = baselines.BASELINES[name](case.shape, case.dtype, case.src, case.dst, topo)
        if bp is None:
            row["baselines"][name] = None
            row["baseline_nic_bytes"][name] = None
            continue
        if verify:
            _check_plan(bp)
        row["baselines"][name] = bp.simulate(topo)
        row["baseline_nic_bytes"][name] = bp.max_link_bytes(topo, "nic")
    m = row["meshcomm_s"]
    row["meshcomm_over_bound"] = m / lb.seconds if lb.seconds > 0 else (1.0 if m == 0 else math.inf)
    row["speedup"] = {k: (v / m if v is not None and m > 0 else None) for k, v in row["baselines"].items()}
    return row


def sim_rows(cases, topology, verify: bool = True, progress: bool = True) -> list[dict]:
    from tqdm import tqdm
    rows = []
    for c in tqdm(cases, desc="bench sim", unit="case", disable=not progress, file=sys.stderr):
        rows.append(sim_row(c, topology, verify=verify))
    return rows


def sim_summary(rows) -> dict:
    out = {}
    for label, sel in (("all", rows), ("alpa", [r for r in rows if r["group"].startswith("alpa")])):
        out[label] = {f"geomean_speedup_over_{b}": geomean(r["speedup"][b] for r in sel)
                      for b in ("send_recv", "alpa_broadcast", "allgather_slice", "dtensor_style")}
        out[label]["worst_meshcomm_over_bound"] = max((r["meshcomm_over_bound"] for r in sel), default=float("nan"))
        out[label]["cases"] = len(sel)
    return out


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:,.1f}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_sim_table(rows) -> str:
    short = {"send_recv": "send_recv", "alpa_broadcast": "alpa_bcast",
             "allgather_slice": "allgather", "dtensor_style": "dtensor"}
    head = (f"{'case':30} {'MiB':>7} {'bound ms':>9} {'meshcomm':>9} {'/bound':>7} "
            + " ".join(f"{short[b]:>10}" for b in BASELINE_NAMES)
            + "  " + " ".join(f"{'x' + short[b]:>11}" for b in BASELINE_NAMES))
    lines = [head, "-" * len(head)]
    for r in rows:
        sp = " ".join(f"{_x(r['speedup'][b]):>11}" for b in BASELINE_NAMES)
        lines.append(f"{r['case']:30} {r['bytes'] / 2**20:>7.0f} {_ms(r['lower_bound_s']):>9} "
                     f"{_ms(r['meshcomm_s']):>9} {r['meshcomm_over_bound']:>7.4f} "
                     + " ".join(f"{_ms(r['baselines'][b]):>10}" for b in BASELINE_NAMES) + "  " + sp)
    return "\n".join(lines)


def plot_sim(rows, path: str, topology_name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    methods = ["lower bound", "meshcomm"] + list(BASELINE_NAMES)
    vals = {m: [] for m in methods}
    for r in rows:
        vals["lower bound"].append(r["lower_bound_s"])
        vals["meshcomm"].append(r["meshcomm_s"])
        for b in BASELINE_NAMES:
            vals[b].append(r["baselines"][b])
    n = len(rows)
    w = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(10, 0.6 * n + 3), 5.5))
    x = np.arange(n)
    for k, m in enumerate(methods):
        ys = [np.nan if v is None or v <= 0 else v for v in vals[m]]
        ax.bar(x + (k - (len(methods) - 1) / 2) * w, ys, w, label=m,
               hatch="//" if m == "lower bound" else None,
               color="none" if m == "lower bound" else None,
               edgecolor="black" if m == "lower bound" else None)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels([r["case"] for r in rows], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("simulated seconds (log)")
    ax.set_title(f"meshcomm vs baselines, simulated on {topology_name}")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_sim(args) -> int:
    from .planners.topology import Topology
    topo = Topology.coerce(args.topology)
    cases = all_cases()
    if args.only:
        cases = [c for c in cases if any(s in c.name for s in args.only.split(","))]
    rows = sim_rows(cases, topo, verify=not args.no_verify, progress=not args.quiet)
    summary = sim_summary(rows)
    print(f"simulated on {topo}  (times in ms; /bound = meshcomm / lower bound; "
          f"x<name> = baseline time / meshcomm time)")
    print(format_sim_table(rows))
    for label, s in summary.items():
        if not s["cases"]:
            continue
        print(f"{label} cases ({s['cases']}): geomean speedup over send_recv "
              f"{s['geomean_speedup_over_send_recv']:.2f}x, over alpa_broadcast "
              f"{s['geomean_speedup_over_alpa_broadcast']:.2f}x, over allgather_slice "
              f"{s['geomean_speedup_over_allgather_slice']:.2f}x; worst meshcomm/bound "
              f"{s['worst_meshcomm_over_bound']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"topology": str(topo), "rows": rows, "summary": summary}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_sim(rows, args.plot, topo.name)
        print(f"wrote {args.plot}")
    return 0


# -- bench plan -------------------------------------------------------------------------------

PLAN_SIZES = ((2, 4), (4, 8), (8, 16), (16, 32), (32, 64), (32, 128))


def plan_cases(max_devices: int = 4096):
    """(label, devices, shape, src, dst) from 8 to max_devices devices: a mesh reshaped in
    place (a x b -> b x a, same devices) and a transposed copy onto a disjoint mesh."""
    out = []
    for a, b in PLAN_SIZES:
        n = a * b
        if n > max_devices:
            continue
        src = Layout(Mesh.grid((a, b), ("x", "y")), ("x", "y"))
        dst = Layout(Mesh.grid((b, a), ("x", "y")), ("x", "y"))
        out.append((f"reshape {a}x{b}->{b}x{a}", n, (8192, 8192), src, dst))
        h = n // 2
        a2, b2 = (a // 2, b) if a % 2 == 0 else (a, b // 2)
        src = Layout(Mesh.grid((a2, b2), ("x", "y")), ("x", "y"))
        dst = Layout(Mesh.grid((a2, b2), ("x", "y"), start=h), ("y", "x"))
        out.append((f"cross {a2}x{b2}->{a2}x{b2}@{h} transposed", n, (8192, 8192), src, dst))
    return out


def plan_rows(topology, repeats: int = 5, cached_repeats: int = 200, max_devices: int = 4096,
              progress: bool = True) -> list[dict]:
    from tqdm import tqdm
    from . import api
    from .planners.topology import Topology
    topo = Topology.coerce(topology)
    rows = []
    cases = plan_cases(max_devices)
    for label, n, shape, src, dst in tqdm(cases, desc="bench plan", unit="case",
                                          disable=not progress, file=sys.stderr):
        cold, cold_cpu = [], []
        p = None
        for _ in range(repeats):
            api.clear_plan_cache()
            t0, c0 = time.perf_counter(), time.process_time()
            p = api.plan(shape, "float32", src, dst, topology=topo)
            cold.append(time.perf_counter() - t0)
            cold_cpu.append(time.process_time() - c0)
        warm = []
        for _ in range(cached_repeats):
            t0 = time.perf_counter()
            api.plan(shape, "float32", src, dst, topology=topo)
            warm.append(time.perf_counter() - t0)
        rows.append({"case": label, "devices": n, "shape": list(shape), "topology": topo.name,
                     "transfers": len(p.transfers), "messages": p.messages,
                     "cold_s": statistics.median(cold), "cold_cpu_s": statistics.median(cold_cpu),
                     "cached_s": statistics.median(warm),
                     "repeats": repeats, "cached_repeats": cached_repeats})
    return rows


def cmd_plan(args) -> int:
    rows = plan_rows(args.topology, repeats=args.repeats, max_devices=args.max_devices,
                     progress=not args.quiet)
    print(f"planning time, 8192x8192 float32, topology {args.topology} "
          f"(median of {args.repeats} cold / 200 cached calls)")
    print(f"{'case':40} {'devices':>7} {'transfers':>9} {'cold ms':>9} {'cold cpu ms':>11} {'cached us':>10}")
    for r in rows:
        print(f"{r['case']:40} {r['devices']:>7} {r['transfers']:>9} {r['cold_s'] * 1e3:>9.1f} "
              f"{r['cold_cpu_s'] * 1e3:>11.1f} {r['cached_s'] * 1e6:>10.1f}")
    print("cold: wall-clock; cold cpu: this process's CPU time (robust to other load on the machine)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


# -- CLI -------------------------------------------------------------------------------------

HELP = """\
Benchmarks of meshcomm beside baselines, each figure reproducible by the command that prints it.

  sim    simulated seconds per case for meshcomm, send_recv, alpa_broadcast,
         allgather_slice and dtensor_style, and the bandwidth lower bound
  plan   measured planning time from 8 to 4096 devices, cold and cached
  run    measured: real execution on 8 local processes beside allgather_slice, DTensor
         and jax.device_put
"""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: simulated cases, planning time, real runs",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    s = bsub.add_parser("sim", help="simulate Alpa's and meshcomm's cases for every method")
    s.add_argument("--topology", default="p3.8xlarge", help="topology preset (default p3.8xlarge)")
    s.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    s.add_argument("--plot", metavar="FILE.png", help="bar chart of time per case per method")
    s.add_argument("--only", metavar="NAMES", help="comma-separated substrings of case names")
    s.add_argument("--no-verify", action="store_true", help="skip verifying every plan")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_sim)
    q = bsub.add_parser("plan", help="planning time from 8 to 4096 devices, cold and cached")
    q.add_argument("--topology", default="p3.8xlarge")
    q.add_argument("--repeats", type=int, default=5, help="cold repeats per case (median)")
    q.add_argument("--max-devices", type=int, default=4096)
    q.add_argument("--json", metavar="FILE")
    q.add_argument("--quiet", action="store_true")
    q.set_defaults(func=cmd_plan)
    _add_run_parser(bsub)
    p.set_defaults(func=lambda args: _no_sub(p, args))


def _no_sub(parser, args) -> int:
    parser.print_help()
    return 2


def _add_run_parser(bsub) -> None:
    r = bsub.add_parser("run", help="really execute the cases on 8 local processes (mpiexec)",
                        description=RUN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--procs", type=int, default=8, help="processes when launching (default 8)")
    r.add_argument("--size-mb", type=float, default=16.0, help="tensor size in MiB (default 16)")
    r.add_argument("--repeats", type=int, default=5, help="timed repeats after a warm-up (median)")
    r.add_argument("--backends", default="mpi,torch,mixed", help="meshcomm backends to time")
    r.add_argument("--only", metavar="NAMES", help="comma-separated substrings of case names")
    r.add_argument("--no-dtensor", action="store_true", help="skip torch DTensor redistribute")
    r.add_argument("--no-jax", action="store_true", help="skip the one-process jax.device_put part")
    r.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    r.add_argument("--check", action="store_true",
                   help="keep reshard's metadata exchange (MESHCOMM_CHECK=1) in the timed calls")
    r.add_argument("--timeout", type=float, default=900.0, help="seconds for each launch")
    r.add_argument("--part", choices=("mpi", "jax"), help=argparse.SUPPRESS)
    r.add_argument("--out", help=argparse.SUPPRESS)
    r.set_defaults(func=cmd_run)


RUN_HELP = """\
Really execute resharding cases (Alpa's, scaled to 8 local processes, plus same-mesh cases)
and time every method: meshcomm.reshard with each backend (meshcomm-mpi/-torch/-mixed),
meshcomm's plan and the allgather_slice baseline plan run by the shared executor directly
over MPI (meshcomm-plan-mpi, allgather_slice: plan against plan), torch DTensor's own
redistribute on gloo (same-mesh cases), and,
in one process with 8 JAX CPU devices, jax.device_put to the new sharding beside meshcomm.
Times are medians over --repeats after a warm-up (max over ranks per repeat).

  mpiexec -n 8 meshcomm bench run [--size-mb N] [--json FILE]    # SPMD, then the JAX part
  meshcomm bench run [--procs 8] ...                              # launches mpiexec itself
"""


# -- bench run ----------------------------------------------------------------------------------

def run_cases(procs: int = 8, mib: float = 16.0) -> list[Case]:
    """Alpa's cases scaled to `procs` processes (as `make demo` scales them), uneven / Blocks
    / partial ones, and same-mesh cases where DTensor's redistribute applies."""
    from . import demo
    out = []
    for c in demo.alpa_cases(procs, mib) + demo.extra_cases(procs, mib):
        out.append(Case(c.name, "alpa" if c.name.startswith(("alpa", "1to")) else "own",
                        tuple(c.shape), c.dtype, c.src, c.dst))
    if procs >= 8:
        m = Mesh.grid((2, 4), ("x", "y"))
        elems = int(mib * 2**20 / 4)
        n = max(8, int(math.isqrt(elems)) // 8 * 8)
        t = max(8, elems // (8 * 512) // 8 * 8)
        out += [
            Case("same-transpose", "same-mesh", (n, n), "float32",
                 Layout(m, ("x", "y")), Layout(m, ("y", "x"))),
            Case("same-moe-a2a", "same-mesh", (8, t, 512), "float32",
                 Layout(m, (None, ("x", "y"), None)), Layout(m, (("x", "y"), None, None))),
            Case("same-allgather", "same-mesh", (n // 2, n), "float32",
                 Layout(m, (("x", "y"),)), Layout(m, ())),
            Case("same-reduce-scatter", "same-mesh", (n, n), "int32",
                 Layout(m, (None,), partial=("x", "y")), Layout(m, (("x", "y"),))),
            Case("same-allreduce-x", "same-mesh", (n, n), "int32",
                 Layout(m, ("y",), partial=("x",)), Layout(m, ("y",))),
        ]
    return out


def _global(case: Case, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(case.dtype).kind == "f":
        return rng.standard_normal(case.shape, dtype=np.float32).astype(case.dtype, copy=False)
    return rng.integers(-1000, 1000, size=case.shape, dtype=case.dtype)


def _memcpy_seconds(nbytes: int, repeats: int) -> float:
    a = np.ones(max(1, nbytes), np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    ts = []
    for _ in range(max(3, repeats)):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _entry(t, nbytes, exact, memcpy_s, note="") -> dict:
    return {"time_s": t, "bytes": nbytes, "gbps": (nbytes / t / 1e9 if t and t > 0 else None),
            "exact": exact, "memcpy_ratio": (t / memcpy_s if t and memcpy_s > 0 else None),
            "note": note}


def _run_mpi_part(args, cases) -> list[dict] | None:
    """SPMD body: every rank runs every case; rank 0 returns the rows, others None."""
    from mpi4py import MPI
    import meshcomm as mc
    from .backends import base
    from .planners import baselines
    from .spmd_timing import time_repeats
    import os
    comm = MPI.COMM_WORLD
    me = comm.rank
    # shape and dtype are given on every process: skip reshard's metadata exchange, so that
    # meshcomm's time is its plan's execution, like the baseline's (--check keeps it)
    if not args.check:
        os.environ["MESHCOMM_CHECK"] = "0"
    ctx = mc.init(backend="mixed", devices_per_process=1)
    backends = [b for b in args.backends.split(",") if b]

    def timed(fn):
        t, out = time_repeats(comm, fn, args.repeats, warmup=1)
        return out, t

    def exact(case, g, y) -> bool:
        ok = True
        if me in case.dst.mesh and not case.dst.is_partial:
            want = g[case.dst.index_map(case.shape)[me]]
            got = y.get(me) if isinstance(y, dict) else y
            got = None if got is None else np.asarray(got)
            ok = got is not None and got.shape == want.shape and np.array_equal(got, want)
        return comm.allreduce(int(not ok)) == 0

    rows = []
    from tqdm import tqdm
    for i, case in enumerate(tqdm(cases, desc="bench run", unit="case", disable=me != 0,
                                  file=sys.stderr)):
        g = _global(case, 1000 + i)
        if me in case.src.mesh:
            x = {me: np.ascontiguousarray(mc.shard(g, case.src, seed=7)[me] if case.src.is_partial
                                          else g[case.src.index_map(case.shape)[me]])}
        else:
            x = {}
        p = mc.plan(case.shape, case.dtype, case.src, case.dst)
        memcpy_s = _memcpy_seconds(p.bytes_moved, args.repeats) if me == 0 else 0.0
        methods: dict[str, dict] = {}
        for b in backends:
            y, t = timed(lambda b=b: mc.reshard(x, case.src, case.dst, shape=case.shape,
                                                dtype=case.dtype, backend=b))
            methods[f"meshcomm-{b}"] = _entry(t, p.bytes_moved, exact(case, g, y), memcpy_s)
        # meshcomm's plan and the allgather_slice plan run by the shared executor directly
        # over MPI (no reshard API around it): plan against plan, like for like
        bp = baselines.allgather_slice(case.shape, case.dtype, case.src, case.dst)
        like = next(iter(x.values())) if x else np.empty(0, dtype=case.dtype)
        box = case.dst.index_map(case.shape).get(me)
        be = ctx.get_backend("mpi")

        def direct():
            out, _ = base.execute(p, x, like, rank=me, devices_per_process=1, backend=be,
                                  deadline=time.monotonic() + ctx.timeout)
            return out
        y, t = timed(direct)
        methods["meshcomm-plan-mpi"] = _entry(t, p.bytes_moved, exact(case, g, y), memcpy_s)

        def ag():
            out, _ = base.execute(bp, x, like, rank=me, devices_per_process=1, backend=be,
                                  deadline=time.monotonic() + ctx.timeout)
            return {d: np.ascontiguousarray(v[box]) for d, v in out.items()}
        y, t = timed(ag)
        methods["allgather_slice"] = _entry(t, bp.bytes_moved, exact(case, g, y), memcpy_s)
        if not args.no_dtensor and case.src.mesh == case.dst.mesh and \
                baselines.dtensor_style(case.shape, case.dtype, case.src, case.dst) is not None:
            methods["dtensor_redistribute"] = _dtensor_method(case, x, g, me, comm, timed, exact,
                                                              memcpy_s, p.bytes_moved)
        if me == 0:
            rows.append({"case": case.name, "group": case.group, "shape": list(case.shape),
                         "dtype": case.dtype, "src": str(case.src), "dst": str(case.dst),
                         "procs": comm.size, "bytes_moved": p.bytes_moved,
                         "overlap": len(set(case.src.mesh.device_ids) & set(case.dst.mesh.device_ids)),
                         "memcpy_s": memcpy_s, "methods": methods})
        del g, x
    mc.finalize()
    return rows if me == 0 else None


def _dtensor_method(case, x, g, me, comm, timed, exact, memcpy_s, nbytes) -> dict:
    """torch DTensor's redistribute on the default (gloo) process group."""
    import logging
    for name in ("torch.distributed", "torch.distributed.tensor", "torch._logging"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import torch
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor
        from .adapters.dtensor import placements_from_layout
        mesh = DeviceMesh("cpu", torch.tensor(np.asarray(case.src.mesh.devices).tolist()),
                          mesh_dim_names=case.src.mesh.axis_names)
        spl = placements_from_layout(case.src)
        dpl = placements_from_layout(case.dst)
        local = torch.from_numpy(np.ascontiguousarray(x[me]))
        stride, acc = [], 1
        for s in reversed(case.shape):
            stride.append(acc)
            acc *= max(s, 1)
        dt = DTensor.from_local(local, mesh, spl, run_check=False, shape=torch.Size(case.shape),
                                stride=tuple(reversed(stride)))

        def run():
            return {me: dt.redistribute(mesh, dpl).to_local().numpy()}
        y, t = timed(run)
        return _entry(t, nbytes, exact(case, g, y), memcpy_s, "bytes: meshcomm's plan, for scale")
    except Exception as e:  # noqa: BLE001 - report, do not hide
        comm.Barrier()
        return _entry(None, nbytes, None, memcpy_s, f"failed: {type(e).__name__}: {e}"[:300])


def _run_jax_part(args, cases) -> dict:
    """One process, 8 JAX CPU devices: jax.device_put to the new sharding beside meshcomm's
    in-memory reshard of the same jax.Array (meshcomm.adapters.jax.reshard_jax)."""
    import jax
    from .adapters.jax import expressible, reshard_jax, sharding_from_layout
    out = {}
    ndev = len(jax.devices())
    for i, case in enumerate(cases):
        why = expressible(case.src, case.shape) or expressible(case.dst, case.shape)
        if why:
            continue
        if max(case.src.mesh.device_ids + case.dst.mesh.device_ids) >= ndev:
            continue
        g = _global(case, 1000 + i)
        ss, ds = sharding_from_layout(case.src, case.shape), sharding_from_layout(case.dst, case.shape)
        x = jax.device_put(g, ss)
        x.block_until_ready()
        res = {}
        for name, fn in (("jax.device_put", lambda: jax.device_put(x, ds)),
                         ("meshcomm-local", lambda: reshard_jax(x, ds))):
            try:
                y = fn()
                jax.block_until_ready(y)
                ts = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    y = fn()
                    jax.block_until_ready(y)
                    ts.append(time.perf_counter() - t0)
                ok = bool(np.array_equal(np.asarray(y), g))
                res[name] = {"time_s": statistics.median(ts), "exact": ok, "note": ""}
            except Exception as e:  # noqa: BLE001 - JAX refuses some cases: report it
                res[name] = {"time_s": None, "exact": None, "note": f"{type(e).__name__}: {e}"[:200]}
        out[case.name] = res
    return out


def _jax_subprocess(args) -> dict:
    import os
    import subprocess
    import tempfile
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


def format_run_table(rows, jax_rows=None) -> str:
    names = []
    for r in rows:
        for k in r["methods"]:
            if k not in names:
                names.append(k)
    w = 24
    head = f"{'case':22} {'MiB':>6} {'memcpy ms':>9} " + " ".join(f"{n[:w]:>{w}}" for n in names)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for n in names:
            e = r["methods"].get(n)
            if e is None:
                cells.append(f"{'-':>{w}}")
            elif e["time_s"] is None:
                cells.append(f"{'failed':>{w}}")
            else:
                flag = "" if e["exact"] else "!"
                ratio = f"{e['memcpy_ratio']:.0f}x" if e.get("memcpy_ratio") else "-"
                cells.append(f"{e['time_s'] * 1e3:.2f} {e['gbps']:.2f} {ratio}{flag}".rjust(w))
        lines.append(f"{r['case']:22} {r['bytes_moved'] / 2**20:>6.1f} {r['memcpy_s'] * 1e3:>9.3f} "
                     + " ".join(cells))
    lines.append("cells: median ms, GB/s (bytes moved / time: meshcomm's plan; allgather_slice its own "
                 "plan), time / memcpy of the same bytes; '!' marks an inexact result")
    base = "allgather_slice"
    for n in names:
        if n.startswith("meshcomm"):
            sp = [r["methods"][base]["time_s"] / r["methods"][n]["time_s"] for r in rows
                  if r["methods"].get(n, {}).get("time_s") and r["methods"].get(base, {}).get("time_s")]
            if sp:
                lines.append(f"{n}: geomean speedup over allgather_slice {geomean(sp):.2f}x "
                             f"(worst {min(sp):.2f}x, {len(sp)} cases)")
            dt = [r["methods"]["dtensor_redistribute"]["time_s"] / r["methods"][n]["time_s"] for r in rows
                  if r["methods"].get("dtensor_redistribute", {}).get("time_s") and r["methods"][n].get("time_s")]
            if dt:
                lines.append(f"{n}: geomean speedup over DTensor redistribute {geomean(dt):.2f}x "
                             f"(worst {min(dt):.2f}x, {len(dt)} same-mesh cases)")
    if jax_rows:
        if "_error" in jax_rows:
            lines.append(f"JAX part: {jax_rows['_error']}")
        else:
            lines.append("")
            lines.append(f"one process, {len(jax_rows)} cases JAX can express, 8 CPU devices:")
            lines.append(f"{'case':22} {'jax.device_put ms':>18} {'meshcomm ms':>12}")
            for case, res in jax_rows.items():
                def cell(k):
                    e = res.get(k, {})
                    if e.get("time_s") is None:
                        return "refused" if e.get("note") else "-"
                    return f"{e['time_s'] * 1e3:.2f}" + ("" if e.get("exact") else " !")
                lines.append(f"{case:22} {cell('jax.device_put'):>18} {cell('meshcomm-local'):>12}")
    return "\n".join(lines)


def cmd_run(args) -> int:
    import os
    import subprocess
    import tempfile
    cases = run_cases(args.procs, args.size_mb)
    if args.only:
        cases = [c for c in cases if any(s in c.name for s in args.only.split(","))]
    if args.part == "jax":
        res = _run_jax_part(args, cases)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return 0
    from .backends.torch_dist import under_mpi_launcher
    if under_mpi_launcher() or args.part == "mpi":
        from mpi4py import MPI
        if MPI.COMM_WORLD.size != args.procs:
            args.procs = MPI.COMM_WORLD.size
            cases = [c for c in run_cases(args.procs, args.size_mb)
                     if not args.only or any(s in c.name for s in args.only.split(","))]
        rows = _run_mpi_part(args, cases)
        if rows is None:
            return 0
        if args.part == "mpi":
            with open(args.out, "w") as f:
                json.dump(rows, f)
            return 0
        jax_rows = None if args.no_jax else _jax_subprocess(args)
        return _report_run(args, rows, jax_rows)
    # not under a launcher: launch mpiexec ourselves, then the JAX part
    from .demo import find_mpiexec
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print("meshcomm bench run: no mpiexec found (install the mpich wheel)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("MESHCOMM_TIMEOUT", "120")
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "mpi.json")
        cmd = [mpiexec, "-n", str(args.procs), sys.executable, "-m", "meshcomm", "bench", "run",
               "--part", "mpi", "--out", path, "--procs", str(args.procs), "--size-mb",
               str(args.size_mb), "--repeats", str(args.repeats), "--backends", args.backends]
        if args.only:
            cmd += ["--only", args.only]
        if args.no_dtensor:
            cmd.append("--no-dtensor")
        if args.check:
            cmd.append("--check")
        try:
            r = subprocess.run(cmd, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"meshcomm bench run: the {args.procs}-process run did not finish within "
                  f"{args.timeout:g} s", file=sys.stderr)
            return 1
        if r.returncode != 0:
            print(f"meshcomm bench run: the {args.procs}-process run exited with {r.returncode}",
                  file=sys.stderr)
            return 1
        with open(path) as f:
            rows = json.load(f)
    jax_rows = None if args.no_jax else _jax_subprocess(args)
    return _report_run(args, rows, jax_rows)


def _report_run(args, rows, jax_rows) -> int:
    print(f"real execution: {args.procs} processes on this machine, ~{args.size_mb:g} MiB per case, "
          f"median of {args.repeats} after a warm-up")
    print(format_run_table(rows, jax_rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"procs": args.procs, "size_mb": args.size_mb, "repeats": args.repeats,
                       "rows": rows, "jax": jax_rows}, f, indent=1)
        print(f"wrote {args.json}")
    bad = [r["case"] for r in rows for e in r["methods"].values() if e.get("exact") is False]
    if bad:
        print(f"INEXACT results in: {sorted(set(bad))}")
        return 1
    return 0
