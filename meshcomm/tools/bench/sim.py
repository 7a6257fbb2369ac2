"""`meshcomm bench sim`: simulated seconds per case for meshcomm, each baseline and the bound.

Every case (meshcomm.tools.cases.all_cases) is planned by meshcomm and by each baseline
(meshcomm.planners.baselines), every plan is verified, and the flow-level simulator gives
seconds on the topology beside the bandwidth lower bound. `--plot` needs matplotlib.

Then the collectives (cases named coll-...): all_reduce, all_gather and reduce_scatter on
meshes of 2 and 4 nodes of the topology (axes node x gpu), over the whole mesh and over
the nodes (one group per GPU slot, the groups sharing every NIC), for 64 KiB and 64 MiB of
data per member (all_gather: its result). Each row gives the bytes every member moves on
average and the time: meshcomm's plan and the ring algorithm as a plan of the same
transfers (baselines.ring_collective), both under the flow model; the ring and tree
algorithms under the alpha-beta model (baselines.collective_cost).
"""
from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np

from ..cases import Case, all_cases
from .. import common
from ..common import check_output, geomean, require, write_json

__all__ = ["BASELINE_NAMES", "sim_row", "sim_rows", "sim_summary", "format_sim_table", "plot_sim",
           "cmd_sim", "COLLECTIVE_OPS", "CollectiveCase", "collective_cases", "collective_row",
           "format_collective_table"]

BASELINE_NAMES = ("send_recv", "alpa_broadcast", "allgather_slice", "dtensor_style")


def _check_plan(p) -> None:
    from meshcomm.planners import baselines
    from meshcomm.planners.verify import verify
    if isinstance(p, baselines.Steps):
        p.verify()
    else:
        verify(p)


def sim_row(case: Case, topology, verify: bool = True) -> dict:
    """Simulated seconds of meshcomm and every baseline on one case, and the bound."""
    import meshcomm as mc
    from meshcomm.arrays import normalize_dtype
    from meshcomm.planners import baselines
    from meshcomm.planners.bounds import lower_bound_bytes
    from meshcomm.planners.topology import Topology
    topo = Topology.coerce(topology)
    _, itemsize = normalize_dtype(case.dtype)
    p = mc.plan(case.shape, case.dtype, case.src, case.dst, topology=topo)
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
    return [sim_row(c, topology, verify=verify)
            for c in common.progress(cases, desc="bench sim", unit="case", disable=not progress,
                                     file=sys.stderr)]


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
    """Bar chart (log scale) of simulated seconds per case per method; needs matplotlib."""
    require("matplotlib", "a plot")
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


# -- collectives against ring and tree ----------------------------------------------------------

COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
COLLECTIVE_NODES = (2, 4)
COLLECTIVE_BYTES = (64 << 10, 64 << 20)


@dataclasses.dataclass(frozen=True)
class CollectiveCase:
    name: str
    op: str
    nodes: int
    axes: tuple[str, ...]
    nbytes: int                 # data per member (all_gather: its result), float32


def _size_str(n: int) -> str:
    return f"{n >> 20}MiB" if n >= 1 << 20 else f"{n >> 10}KiB"


def collective_cases(topology) -> list[CollectiveCase]:
    """all_reduce, all_gather, reduce_scatter on 2 and 4 nodes of `topology`, over the whole
    mesh and over the nodes, 64 KiB and 64 MiB per member."""
    from meshcomm.planners.topology import Topology
    dpn = Topology.coerce(topology).devices_per_node
    out = []
    for nodes in COLLECTIVE_NODES:
        for axes in (("node", "gpu"), ("node",)):
            for nbytes in COLLECTIVE_BYTES:
                for op in COLLECTIVE_OPS:
                    name = f"coll-{op}-{nodes}x{dpn}-{'+'.join(axes)}-{_size_str(nbytes)}"
                    out.append(CollectiveCase(name, op, nodes, axes, nbytes))
    return out


def collective_row(case: CollectiveCase, topology, verify: bool = True) -> dict:
    """meshcomm's plan and the ring plan (flow model), ring and tree (alpha-beta): bytes each
    member moves on average, and seconds."""
    import meshcomm as mc
    from meshcomm.collectives.layouts import groups, problem
    from meshcomm.planners import baselines
    from meshcomm.planners.topology import Topology
    topo = Topology.coerce(topology)
    mesh = mc.Mesh(np.arange(case.nodes * topo.devices_per_node).reshape(case.nodes, -1), ("node", "gpu"))
    gs = groups(mesh, case.axes)
    k = len(gs[0])
    n = case.nbytes // 4
    tile = (n // k,) if case.op == "all_gather" else (n,)
    nelems = tile[0] * k if case.op == "all_gather" else n
    pr = problem(case.op, mesh, case.axes, tile)
    p = mc.plan(pr.shape, "float32", pr.src, pr.dst, topology=topo)
    ring_plan = baselines.ring_collective(case.op, pr.shape, "float32", pr.src, pr.dst, gs, topo)
    if verify:
        _check_plan(p)
        _check_plan(ring_plan)
    members = mesh.size
    row = {"case": case.name, "op": case.op, "nodes": case.nodes, "devices": members,
           "axes": list(case.axes), "group_size": k, "groups": len(gs), "bytes": nelems * 4,
           "topology": topo.name,
           "meshcomm": {"bytes_per_member": p.bytes_moved / members, "seconds": p.simulate(topo),
                        "messages": p.messages},
           "ring_plan": {"bytes_per_member": ring_plan.bytes_moved / members,
                         "seconds": ring_plan.simulate(topo), "messages": ring_plan.messages}}
    for algo in baselines.COLLECTIVE_ALGORITHMS:
        c = baselines.collective_cost(case.op, algo, gs, nelems, 4, topo)
        row[algo] = {"bytes_per_member": c.bytes_moved / members, "seconds": c.seconds, "steps": c.steps}
    return row


def _us(x: float) -> str:
    return f"{x * 1e6:,.1f}"


def format_collective_table(rows) -> str:
    head = (f"{'collective':38} {'groups':>7} {'data':>6}  {'meshcomm KiB':>12} {'us':>9}  "
            f"{'ring plan us':>12}  {'ring KiB':>9} {'us':>9}  {'tree KiB':>9} {'us':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        m, rp, ring, tree = r["meshcomm"], r["ring_plan"], r["ring"], r["tree"]
        lines.append(f"{r['case'].removeprefix('coll-'):38} {str(r['groups']) + 'x' + str(r['group_size']):>7} "
                     f"{_size_str(r['bytes']):>6}  {m['bytes_per_member'] / 1024:>12,.1f} {_us(m['seconds']):>9}  "
                     f"{_us(rp['seconds']):>12}  {ring['bytes_per_member'] / 1024:>9,.1f} {_us(ring['seconds']):>9}  "
                     f"{tree['bytes_per_member'] / 1024:>9,.1f} {_us(tree['seconds']):>9}")
    return "\n".join(lines)


def cmd_sim(args) -> int:
    from meshcomm.planners.topology import Topology
    topo = Topology.coerce(args.topology)
    for path, option in ((args.json, "--json"), (args.plot, "--plot")):
        if path:
            check_output(path, option)
    if args.plot:
        require("matplotlib", "--plot")
    cases = all_cases()
    if args.only:
        cases = [c for c in cases if any(s in c.name for s in args.only.split(","))]
    colls = collective_cases(topo)
    if args.only:
        colls = [c for c in colls if any(s in c.name for s in args.only.split(","))]
    rows = sim_rows(cases, topo, verify=not args.no_verify, progress=not args.quiet)
    crows = [collective_row(c, topo, verify=not args.no_verify)
             for c in common.progress(colls, desc="bench sim collectives", unit="case",
                                      disable=args.quiet, file=sys.stderr)]
    summary = sim_summary(rows)
    if rows or not crows:
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
    if crows:
        print(f"{chr(10) if rows else ''}collectives on {topo}, float32 (groups: how many x members; data per member, "
              f"all_gather: its result; KiB: bytes each member moves on average; meshcomm and "
              f"ring plan: flow model; ring, tree: alpha-beta model)")
        print(format_collective_table(crows))
    if args.json:
        write_json(args.json, {"topology": str(topo), "rows": rows, "summary": summary,
                               "collectives": crows})
    if args.plot:
        plot_sim(rows, args.plot, topo.name)
        print(f"wrote {args.plot}")
    return 0
