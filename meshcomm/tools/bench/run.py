"""`meshcomm bench run`: the cases scaled to 8 local processes (meshcomm.tools.cases.run_cases),
really executed with each meshcomm backend beside the allgather_slice plan (same executor,
MPI), torch DTensor's redistribute on gloo (same-mesh cases) and, in a separate process,
jax.device_put (bench/jax_part.py). Without a launcher it launches mpiexec on itself."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from .. import common, spmd
from ..cases import Case, global_array, run_cases
from ..common import check_output, geomean, write_json
from . import jax_part

__all__ = ["cmd_run", "format_run_table"]


def _select(cases: list[Case], only: str | None) -> list[Case]:
    """The cases whose names contain one of the comma-separated substrings in `only`."""
    return [c for c in cases if not only or any(s in c.name for s in only.split(","))]


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
    from meshcomm.backends import base
    from meshcomm.planners import baselines
    comm = MPI.COMM_WORLD
    me = comm.rank
    # shape and dtype are given on every process: skip reshard's metadata exchange, so that
    # meshcomm's time is its plan's execution, like the baseline's (--check keeps it)
    if not args.check:
        os.environ["MESHCOMM_CHECK"] = "0"
    ctx = mc.init(backend="mixed", devices_per_process=1)
    backends = [b for b in args.backends.split(",") if b]

    def timed(fn):
        t, out = spmd.time_repeats(comm, fn, args.repeats, warmup=1)
        return out, t

    rows = []
    for i, case in enumerate(common.progress(cases, desc="bench run", unit="case", disable=me != 0,
                                             file=sys.stderr)):
        g = global_array(case.shape, 1000 + i, case.dtype)

        def check(y) -> bool:       # called within this iteration only
            return spmd.exact(comm, case.dst, case.shape, g, y)
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
            methods[f"meshcomm-{b}"] = _entry(t, p.bytes_moved, check(y), memcpy_s)
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
        methods["meshcomm-plan-mpi"] = _entry(t, p.bytes_moved, check(y), memcpy_s)

        def ag():
            out, _ = base.execute(bp, x, like, rank=me, devices_per_process=1, backend=be,
                                  deadline=time.monotonic() + ctx.timeout)
            return {d: np.ascontiguousarray(v[box]) for d, v in out.items()}
        y, t = timed(ag)
        methods["allgather_slice"] = _entry(t, bp.bytes_moved, check(y), memcpy_s)
        if not args.no_dtensor and case.src.mesh == case.dst.mesh and \
                baselines.dtensor_style(case.shape, case.dtype, case.src, case.dst) is not None:
            methods["dtensor_redistribute"] = _dtensor_method(case, x, me, comm, timed, check,
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


def _dtensor_method(case, x, me, comm, timed, check, memcpy_s, nbytes) -> dict:
    """torch DTensor's redistribute on the default (gloo) process group."""
    import logging
    for name in ("torch.distributed", "torch.distributed.tensor", "torch._logging"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import torch
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor
        from meshcomm.adapters.dtensor import placements_from_layout
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
        return _entry(t, nbytes, check(y), memcpy_s, "bytes: meshcomm's plan, for scale")
    except Exception as e:  # noqa: BLE001 - report, do not hide
        comm.Barrier()
        return _entry(None, nbytes, None, memcpy_s, f"failed: {type(e).__name__}: {e}"[:300])


def _format_jax(jax_rows) -> list[str]:
    if "_error" in jax_rows:
        return [f"JAX part: {jax_rows['_error']}"]
    lines = ["", f"one process, {len(jax_rows)} cases JAX can express, 8 CPU devices:",
             f"{'case':22} {'jax.device_put ms':>18} {'meshcomm ms':>12}"]
    for case, res in jax_rows.items():
        def cell(k):
            e = res.get(k, {})
            if e.get("time_s") is None:
                return "refused" if e.get("note") else "-"
            return f"{e['time_s'] * 1e3:.2f}" + ("" if e.get("exact") else " !")
        lines.append(f"{case:22} {cell('jax.device_put'):>18} {cell('meshcomm-local'):>12}")
    return lines


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
        lines += _format_jax(jax_rows)
    return "\n".join(lines)


def cmd_run(args) -> int:
    if args.json:
        check_output(args.json, "--json")
    cases = _select(run_cases(args.procs, args.size_mb), args.only)
    if args.part == "jax":
        res = jax_part.run_jax_part(args, cases)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return 0
    from meshcomm.backends.torch_dist import under_mpi_launcher
    if under_mpi_launcher() or args.part == "mpi":
        from mpi4py import MPI
        if MPI.COMM_WORLD.size != args.procs:
            args.procs = MPI.COMM_WORLD.size
            cases = _select(run_cases(args.procs, args.size_mb), args.only)
        rows = _run_mpi_part(args, cases)
        if rows is None:
            return 0
        if args.part == "mpi":
            with open(args.out, "w") as f:
                json.dump(rows, f)
            return 0
        jax_rows = None if args.no_jax else jax_part.run_subprocess(args)
        return _report_run(args, rows, jax_rows)
    # not under a launcher: launch mpiexec on ourselves, then the JAX part
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "mpi.json")
        argv = ["-m", "meshcomm", "bench", "run", "--part", "mpi", "--out", path, "--procs",
                str(args.procs), "--size-mb", str(args.size_mb), "--repeats", str(args.repeats),
                "--backends", args.backends]
        if args.only:
            argv += ["--only", args.only]
        if args.no_dtensor:
            argv.append("--no-dtensor")
        if args.check:
            argv.append("--check")
        try:
            r = spmd.launch(args.procs, argv, timeout=args.timeout)
        except FileNotFoundError:
            print("meshcomm bench run: no mpiexec found (install the mpich wheel)", file=sys.stderr)
            return 2
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
    jax_rows = None if args.no_jax else jax_part.run_subprocess(args)
    return _report_run(args, rows, jax_rows)


def _report_run(args, rows, jax_rows) -> int:
    print(f"real execution: {args.procs} processes on this machine, ~{args.size_mb:g} MiB per case, "
          f"median of {args.repeats} after a warm-up")
    print(format_run_table(rows, jax_rows))
    if args.json:
        write_json(args.json, {"procs": args.procs, "size_mb": args.size_mb,
                               "repeats": args.repeats, "rows": rows, "jax": jax_rows})
    bad = [r["case"] for r in rows for e in r["methods"].values() if e.get("exact") is False]
    if bad:
        print(f"INEXACT results in: {sorted(set(bad))}")
        return 1
    return 0
