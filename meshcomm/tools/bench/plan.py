"""`meshcomm bench plan`: measured planning time from 8 to 4096 devices, cold (every cache
cleared with meshcomm.clear_caches) and cached, median of repeats."""
from __future__ import annotations

import statistics
import sys
import time

from meshcomm.layout import Layout
from meshcomm.mesh import Mesh

from .. import common
from ..common import check_output, write_json

__all__ = ["PLAN_SIZES", "plan_cases", "alltoall_case", "plan_rows", "cmd_plan"]

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
    if max_devices >= 4096:
        out.append(alltoall_case(4096))
    return out


def alltoall_case(n: int = 4096):
    """(label, devices, shape, src, dst): a tiny tensor of 4 elements per device, split over
    a 1-d mesh of n devices, to the transposed split of the same devices seen as a
    sqrt(n) x sqrt(n) mesh (minor axis major): every device sends its 4 elements to the
    device at its transposed grid position, n tiny pieces."""
    import math
    k = math.isqrt(n)
    src = Layout(Mesh(list(range(n)), ("x",)), ("x",))
    dst = Layout(Mesh([list(range(i * k, (i + 1) * k)) for i in range(k)], ("a", "b")), (("b", "a"),))
    return (f"all-to-all {n} -> {k}x{k} transposed, tiny", n, (4 * n,), src, dst)


def plan_rows(topology, repeats: int = 5, cached_repeats: int = 200, max_devices: int = 4096,
              progress: bool = True) -> list[dict]:
    import meshcomm as mc
    from meshcomm.planners.topology import Topology
    topo = Topology.coerce(topology)
    rows = []
    cases = plan_cases(max_devices)
    for label, n, shape, src, dst in common.progress(cases, desc="bench plan", unit="case",
                                                     disable=not progress, file=sys.stderr):
        cold, cold_cpu = [], []
        p = None
        for _ in range(repeats):
            mc.clear_caches()
            t0, c0 = time.perf_counter(), time.process_time()
            p = mc.plan(shape, "float32", src, dst, topology=topo)
            cold.append(time.perf_counter() - t0)
            cold_cpu.append(time.process_time() - c0)
        warm = []
        for _ in range(cached_repeats):
            t0 = time.perf_counter()
            mc.plan(shape, "float32", src, dst, topology=topo)
            warm.append(time.perf_counter() - t0)
        rows.append({"case": label, "devices": n, "shape": list(shape), "topology": topo.name,
                     "transfers": len(p.transfers), "messages": p.messages,
                     "cold_s": statistics.median(cold), "cold_cpu_s": statistics.median(cold_cpu),
                     "cached_s": statistics.median(warm),
                     "repeats": repeats, "cached_repeats": cached_repeats})
    return rows


def cmd_plan(args) -> int:
    if args.json:
        check_output(args.json, "--json")
    rows = plan_rows(args.topology, repeats=args.repeats, max_devices=args.max_devices,
                     progress=not args.quiet)
    print(f"planning time, 8192x8192 float32 (the all-to-all: 4 floats per device), topology {args.topology} "
          f"(median of {args.repeats} cold / 200 cached calls)")
    print(f"{'case':40} {'devices':>7} {'transfers':>9} {'cold ms':>9} {'cold cpu ms':>11} {'cached us':>10}")
    for r in rows:
        print(f"{r['case']:40} {r['devices']:>7} {r['transfers']:>9} {r['cold_s'] * 1e3:>9.1f} "
              f"{r['cold_cpu_s'] * 1e3:>11.1f} {r['cached_s'] * 1e6:>10.1f}")
    print("cold: wall-clock; cold cpu: this process's CPU time (robust to other load on the machine)")
    if args.json:
        write_json(args.json, {"rows": rows})
    return 0
