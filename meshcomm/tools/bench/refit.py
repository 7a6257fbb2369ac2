"""`meshcomm bench refit`: whole-model refits (trainer -> generator) planned as one batch by
meshcomm beside the policies RL frameworks use, every one timed by the same simulator.

Cases (meshcomm.tools.refit_cases): DeepSeek-V3 and Qwen3-235B-A22B, experts as separate
tensors or stacked per layer, trainer PP16 x EP16 -> generator DP8 x TP32 and TP4 PP8 EP16 ->
TP8 DP16, the generator on the trainer's GPUs (colocated) or on others (disjoint).

Policies (planners/batch_baselines.py): meshcomm's batch plan (``mc.plan_many``), one sender
per tensor broadcasting to every generator rank (vLLM/SGLang-like), gather to one rank then
broadcast, meshcomm's plan per tensor one after another, node-aware per-tensor planning
within M2N-like limits, buckets striped round-robin over trainer ranks (verl-like); and the
batch's bandwidth lower bound. Per row: simulated seconds, the ratio to the bound, and
planning seconds (meshcomm: cold, every cache cleared, and cached; the others: what the
bench spent making their schedules, alike tensors once, simulation not counted). Wall
seconds; for meshcomm's cold planning also the process's CPU seconds (the same on an idle
machine, less where other work shares the cores).
"""
from __future__ import annotations

import sys
import time

from .. import common
from ..common import check_output, positive, write_json

__all__ = ["POLICIES", "refit_row", "format_refit_table", "cmd_refit", "add_refit_parser"]

POLICIES = {
    "meshcomm": "meshcomm batch plan (mc.plan_many)",
    "one_sender": "one sender per tensor (vLLM/SGLang-like)",
    "gather_broadcast": "gather to one, then broadcast",
    "per_tensor": "meshcomm plan per tensor, one after another",
    "node_aware": "node-aware per tensor, M2N-like limits",
    "striped_buckets": "buckets striped over trainer ranks (verl-like)",
}

HELP = """\
Plan and simulate whole-model refits (trainer layout -> generator layout) of DeepSeek-V3 and
Qwen3-235B-A22B: meshcomm's batch plan beside one sender per tensor (vLLM/SGLang-like),
gather-then-broadcast, meshcomm per tensor, node-aware per tensor within M2N-like limits and
buckets striped over trainer ranks (verl-like), each against the batch's lower bound.

  meshcomm bench refit --models deepseek-v3 --experts stacked --placement disjoint
"""


def add_refit_parser(bsub) -> None:
    import argparse
    r = bsub.add_parser("refit", help="whole-model refits: batch plan beside RL frameworks' policies",
                        description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--models", default="deepseek-v3,qwen3-235b-a22b", help="comma-separated")
    r.add_argument("--setups", default="pp16-ep16->dp8-tp32,tp4-pp8-ep16->tp8-dp16", help="comma-separated")
    r.add_argument("--experts", default="stacked,separate", help="stacked and/or separate")
    r.add_argument("--placement", default="disjoint,colocated", help="disjoint and/or colocated")
    r.add_argument("--topology", default="dgx-h100", help="topology preset (default dgx-h100)")
    r.add_argument("--bucket-mb", type=float, default=None, help="meshcomm's bucket (default: the cost model's)")
    r.add_argument("--verl-bucket-mb", type=float, default=2048.0, help="the verl-like policy's bucket")
    r.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of: " + ", ".join(POLICIES))
    r.add_argument("--layers", type=positive, default=None, help="only the first N layers (a quick look)")
    r.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.set_defaults(func=cmd_refit)


def refit_row(case, topology, policies=tuple(POLICIES), bucket_mb=None, verl_bucket_mb=2048.0,
              progress: bool = False) -> dict:
    """Simulated seconds, ratio to the bound and planning seconds of every policy on `case`
    (a meshcomm.tools.refit_cases.RefitCase)."""
    import meshcomm as mc
    from meshcomm.batch_args import batch_entries
    from meshcomm.planners import batch_baselines as bb
    from meshcomm.planners.batch_bound import batch_lower_bound
    from meshcomm.planners.topology import Topology
    topo = Topology.coerce(topology)
    entries = batch_entries(case.shapes, case.dtype, case.src, case.dst)
    lb = batch_lower_bound(entries, topo)
    row = {"case": case.name, "tensors": case.tensors, "bytes": case.nbytes, "devices": case.devices,
           "topology": topo.name, "lower_bound_s": lb.seconds, "policies": {}}

    def put(name, seconds, plan_s, **extra):
        row["policies"][name] = {"seconds": seconds, "over_bound": seconds / lb.seconds if lb.seconds else None,
                                 "plan_s": plan_s, **extra}
    for name in policies:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
        if name == "meshcomm":
            mc.clear_caches()
            t0, c0 = time.perf_counter(), time.process_time()
            p = mc.plan_many(case.shapes, case.dtype, case.src, case.dst, topology=topo, bucket_mb=bucket_mb)
            cold, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
            t0 = time.perf_counter()
            mc.plan_many(case.shapes, case.dtype, case.src, case.dst, topology=topo, bucket_mb=bucket_mb)
            cached = time.perf_counter() - t0
            put(name, p.simulate(topo), cold, plan_cpu_s=cold_cpu, plan_cached_s=cached, messages=p.messages,
                buckets=p.buckets, bucket_bytes=p.bucket_bytes, classes=p.classes,
                max_nic_bytes=p.max_link_bytes(topo, "nic"))
        elif name == "striped_buckets":
            t0 = time.perf_counter()
            s = bb.striped_buckets(entries, topo, int(verl_bucket_mb * (1 << 20)))
            made = time.perf_counter() - t0
            put(name, s.simulate(topo), made, messages=len(s.transfers))
        else:
            bar = common.progress(total=len(entries), desc=f"{name:>16}", unit="tensor", disable=not progress,
                                  file=sys.stderr, leave=False)
            seconds, made = bb.sequential_seconds(entries, topo, name, progress=bar.update)
            bar.close()
            put(name, seconds, made)
    m = row["policies"].get("meshcomm")
    if m:
        row["speedup"] = {k: v["seconds"] / m["seconds"] for k, v in row["policies"].items() if k != "meshcomm"}
    return row


def format_refit_table(rows) -> str:
    lines = []
    for r in rows:
        lines.append(f"{r['case']}: {r['tensors']} tensors, {r['bytes'] / 1e9:.0f} GB, {r['devices']} GPUs, "
                     f"{r['topology']}; lower bound {r['lower_bound_s']:.3f} s")
        lines.append(f"  {'policy':<48} {'simulated s':>12} {'x bound':>8} {'planning s':>11}")
        for name, v in r["policies"].items():
            plan = f"{v['plan_s']:.2f}" + (f" (cpu {v['plan_cpu_s']:.2f}, cached {v['plan_cached_s']:.3f})"
                                           if "plan_cached_s" in v else "")
            lines.append(f"  {POLICIES[name]:<48} {v['seconds']:>12.3f} {v['over_bound']:>8.2f} {plan:>11}")
        lines.append(f"  {'lower bound':<48} {r['lower_bound_s']:>12.3f} {1.0:>8.2f}")
        if "speedup" in r:
            lines.append("  meshcomm faster by: " + ", ".join(f"{k} {v:.2f}x" for k, v in r["speedup"].items()))
        lines.append("")
    return "\n".join(lines)


def cmd_refit(args) -> int:
    from ..refit_cases import SETUPS, load_models, refit_case
    if args.json:
        check_output(args.json, "--json")
    models = [m for m in args.models.split(",") if m]
    known = [k for k in load_models() if not k.startswith("_")]
    for m in models:
        if m not in known:
            raise common.UsageError(f"--models: unknown model {m!r}; known: {', '.join(known)}")
    setups = [s for s in args.setups.split(",") if s]
    for s in setups:
        if s not in SETUPS:
            raise common.UsageError(f"--setups: unknown setup {s!r}; known: {', '.join(SETUPS)}")
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            raise common.UsageError(f"--policies: unknown policy {p!r}; known: {', '.join(POLICIES)}")
    rows = []
    for model in models:
        for setup in setups:
            for experts in [e for e in args.experts.split(",") if e]:
                for place in [p for p in args.placement.split(",") if p]:
                    if place not in ("disjoint", "colocated"):
                        raise common.UsageError(f"--placement: {place!r} is not disjoint or colocated")
                    if experts not in ("stacked", "separate"):
                        raise common.UsageError(f"--experts: {experts!r} is not stacked or separate")
                    case = refit_case(model, setup, experts, colocated=place == "colocated", layers=args.layers)
                    if not args.quiet:
                        print(f"... {case.name}", file=sys.stderr)
                    row = refit_row(case, args.topology, policies, args.bucket_mb, args.verl_bucket_mb,
                                    progress=not args.quiet)
                    rows.append(row)
                    print(format_refit_table([row]), flush=True)
    if args.json:
        write_json(args.json, {"rows": rows, "policies": POLICIES})
    return 0
