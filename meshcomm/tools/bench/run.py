"""`meshcomm bench run`: the cases scaled to 8 local processes (meshcomm.tools.cases.run_cases),
really executed with each meshcomm backend, both as an explicit Program (`mc.Program.reshard`,
constructed once per case outside the timed calls, then run with nothing but data) and as the
eager `mc.reshard` call (a cached Program found by its arguments on every call), beside the
hand-written mpi4py exchange (bench/floor.py), the allgather_slice plan (same executor, MPI),
torch DTensor's redistribute on gloo (same-mesh cases) and, in a separate process,
jax.device_put (bench/jax_part.py). Without a launcher it launches mpiexec on itself.

The goals, per case, against the hand-written exchange (its time / meshcomm's time):
a Program run at least GOALS["program"], the eager call at least GOALS["eager"]."""
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
from . import floor, jax_part

__all__ = ["cmd_run", "format_run_table", "format_goals", "GOALS"]

# hand-written exchange time / meshcomm time, per case: what a Program run and an eager call aim at
GOALS = {"program": 0.95, "eager": 0.9}


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


def time_interleaved(comm, methods, repeats: int, warmup: int = 1) -> dict:
    """{name: (median seconds, last result)} for methods [(name, fn)], run in rounds: one
    call of each method per round, so every method sees the same load on a shared machine;
    each round starts one method later (the first of a round measured up to 1.3x slower than
    the same call later in it, 8 processes here), so no method always goes first."""
    times = {n: [] for n, _ in methods}
    last = {}
    for i in range(warmup + repeats):
        k = i % len(methods)
        for name, fn in methods[k:] + methods[:k]:
            t, last[name] = spmd.time_once(comm, fn)
            if i >= warmup:
                times[name].append(t)
    return {n: (statistics.median(ts), last[n]) for n, ts in times.items()}


def _run_mpi_part(args, cases) -> list[dict] | None:
    """SPMD body: every rank runs every case; rank 0 returns the rows, others None."""
    from mpi4py import MPI
    import meshcomm as mc
    from meshcomm.backends import batch
    from meshcomm.planners import baselines
    comm = MPI.COMM_WORLD
    me = comm.rank
    # default settings: every process agrees once per Program (at its construction; an eager
    # call constructs its Program on its first call, the warm-up, and finds it afterwards)
    ctx = mc.init(backend="mixed", devices_per_process=1)
    backends = parse_backends(args.backends)

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
        # meshcomm's plan and the allgather_slice plan run by the shared executor directly
        # over MPI (no reshard API around it): plan against plan, like for like
        bp = baselines.allgather_slice(case.shape, case.dtype, case.src, case.dst)
        like = next(iter(x.values())) if x else np.empty(0, dtype=case.dtype)
        box = case.dst.index_map(case.shape).get(me)
        be = ctx.get_backend("mpi")

        def direct():
            return batch.execute(p, x, like, rank=me, devices_per_process=1, backend=be,
                                 deadline=time.monotonic() + ctx.timeout)

        def ag():
            out = batch.execute(bp, x, like, rank=me, devices_per_process=1, backend=be,
                                deadline=time.monotonic() + ctx.timeout)
            return {d: np.ascontiguousarray(v[box]) for d, v in out.items()}
        methods = []
        for b in backends:
            # constructed once, outside the timed calls (every process, same arguments)
            prog = mc.Program.reshard(case.src, case.dst, shape=case.shape, dtype=case.dtype, backend=b)
            methods.append((f"program-{b}", lambda prog=prog: prog(x)))
            methods.append((f"meshcomm-{b}", _reshard_fn(mc, x, case, b)))
        methods += [("meshcomm-plan-mpi", direct), ("allgather_slice", ag)]
        nbytes = {"allgather_slice": bp.bytes_moved}
        if not case.dst.is_partial:
            prog = floor.floor_program(case.src, case.dst, case.shape, me)
            methods.append(("floor", lambda: floor.run_floor(prog, x, case.dtype, be.comm)))
            nbytes["floor"] = prog.wire_elems * np.dtype(case.dtype).itemsize
        res = time_interleaved(comm, methods, args.repeats, warmup=1)
        entries: dict[str, dict] = {}
        for name, _ in methods:
            t, y = res[name]
            entries[name] = _entry(t, nbytes.get(name, p.bytes_moved), check(y), memcpy_s)
        if not args.no_dtensor and case.src.mesh == case.dst.mesh and \
                baselines.dtensor_style(case.shape, case.dtype, case.src, case.dst) is not None:
            entries["dtensor_redistribute"] = _dtensor_method(case, x, me, comm, timed, check,
                                                              memcpy_s, p.bytes_moved)
        if me == 0:
            rows.append({"case": case.name, "group": case.group, "shape": list(case.shape),
                         "dtype": case.dtype, "src": str(case.src), "dst": str(case.dst),
                         "procs": comm.size, "bytes_moved": p.bytes_moved,
                         "overlap": len(set(case.src.mesh.device_ids) & set(case.dst.mesh.device_ids)),
                         "memcpy_s": memcpy_s, "methods": entries})
        del g, x
    mc.finalize()
    return rows if me == 0 else None


def parse_backends(text: str) -> list[str]:
    """The backends of --backends ("mpi,torch,mixed"); each is timed as a Program and eager."""
    out = []
    for b in (v.strip() for v in text.split(",")):
        if not b:
            continue
        if ":" in b:
            raise ValueError(f"--backends entry {b!r}: a backend name (mpi, torch, mixed); there is no "
                             "per-call check to switch off any more (every backend is timed as a "
                             "Program and as the eager call)")
        out.append(b)
    return out


def _reshard_fn(mc, x, case, b: str):
    """The eager meshcomm.reshard with backend `b` (shape and dtype given)."""
    def call():
        return mc.reshard(x, case.src, case.dst, shape=case.shape, dtype=case.dtype, backend=b)
    return call


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
             f"{'case':22} {'jax.device_put ms':>18} {'meshcomm ms':>12} {'JAX copies':>10} "
             f"{'meshcomm copies':>15} {'speed-up':>8}"]
    sp, both = [], []
    for case, res in jax_rows.items():
        def cell(k):
            e = res.get(k, {})
            if e.get("time_s") is None:
                return "refused" if e.get("note") else "-"
            return f"{e['time_s'] * 1e3:.2f}" + ("" if e.get("exact") else " !")
        j, m = (res.get(k, {}).get("time_s") for k in ("jax.device_put", "meshcomm-local"))
        copies, mine = res.get("jax_copies"), res.get("meshcomm_copies")
        ratio = j / m if j and m else None
        if copies and ratio:
            sp.append(ratio)
            if mine:
                both.append(ratio)
        lines.append(f"{case:22} {cell('jax.device_put'):>18} {cell('meshcomm-local'):>12} "
                     f"{_yes_no(copies):>10} {_yes_no(mine):>15} "
                     f"{'-' if ratio is None else f'{ratio:.2f}':>8}")
    lines.append("JAX copies / meshcomm copies: 'no' where every shard of the result lies in a source "
                 "shard's memory (nothing moved: CPU devices adopt host memory); speed-up: "
                 "jax.device_put time / meshcomm time")
    if sp:
        lines.append(f"meshcomm-local: geomean speed-up over jax.device_put where JAX copies "
                     f"{geomean(sp):.2f}x (worst {min(sp):.2f}x, {len(sp)} cases)")
    if both:
        lines.append(f"meshcomm-local: geomean speed-up where both copy "
                     f"{geomean(both):.2f}x (worst {min(both):.2f}x, {len(both)} cases)")
    return lines


def _yes_no(v) -> str:
    return "-" if v is None else ("yes" if v else "no")


def _ratio(r, base: str, name: str):
    """Time of `base` / time of `name` on row r (> 1: `name` is faster), or None."""
    b, m = r["methods"].get(base, {}).get("time_s"), r["methods"].get(name, {}).get("time_s")
    return b / m if b and m else None


def _main_backend(names) -> str | None:
    """The backend the goal columns compare: mpi, else the first one timed."""
    bs = [n[len("program-"):] for n in names if n.startswith("program-")]
    bs += [n[len("meshcomm-"):] for n in names if n.startswith("meshcomm-") and n != "meshcomm-plan-mpi"]
    return "mpi" if "mpi" in bs else (bs[0] if bs else None)


def _is_meshcomm(name: str) -> bool:
    return name.startswith(("meshcomm", "program-"))


def format_run_table(rows, jax_rows=None) -> str:
    names = []
    for r in rows:
        for k in r["methods"]:
            if k not in names:
                names.append(k)
    b = _main_backend(names)
    prog, eager = (f"program-{b}", f"meshcomm-{b}") if b else (None, None)
    w = 24
    head = (f"{'case':22} {'MiB':>6} {'memcpy ms':>9} " + " ".join(f"{n[:w]:>{w}}" for n in names)
            + f" {'prog':>6} {'eager':>6} {'ag':>6}")
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
        for base, m in (("floor", prog), ("floor", eager), ("allgather_slice", eager)):
            v = _ratio(r, base, m) if m else None
            cells.append(f"{'-' if v is None else f'{v:.2f}':>6}")
        lines.append(f"{r['case']:22} {r['bytes_moved'] / 2**20:>6.1f} {r['memcpy_s'] * 1e3:>9.3f} "
                     + " ".join(cells))
    lines.append("cells: median ms, GB/s (bytes moved / time: meshcomm's plan; allgather_slice and floor "
                 "their own), time / memcpy of the same bytes; '!' marks an inexact result")
    if b:
        lines.append(f"prog, eager: floor (the hand-written exchange) time / {prog} time and / {eager} "
                     f"time; ag: allgather_slice time / {eager} time (> 1: meshcomm is faster)")
    for n in names:
        if not _is_meshcomm(n):
            continue
        for base, label, sel in (("allgather_slice", "allgather_slice", None),
                                 ("floor", "the hand-written floor", None),
                                 ("floor", "the floor, cases without pending sums", "plain"),
                                 ("dtensor_redistribute", "DTensor redistribute", None)):
            sp = [v for r in rows if (sel is None or "P(" not in r["src"])
                  for v in [_ratio(r, base, n)] if v is not None]
            if sp:
                lines.append(f"{n}: geomean speedup over {label} {geomean(sp):.2f}x "
                             f"(worst {min(sp):.2f}x, {len(sp)} cases)")
    goals = format_goals(rows)
    if goals:
        lines += ["", goals]
    if jax_rows:
        lines += _format_jax(jax_rows)
    return "\n".join(lines)


def format_goals(rows, backend: str | None = None) -> str:
    """Per case: the hand-written exchange, the Program run and the eager call of `backend`
    (default: mpi, else the first timed), and their ratios to the exchange against GOALS."""
    names = [k for r in rows for k in r["methods"]]
    b = backend or _main_backend(names)
    if b is None:
        return ""
    prog, eager = f"program-{b}", f"meshcomm-{b}"
    gp, ge = GOALS["program"], GOALS["eager"]
    lines = [f"against the hand-written exchange (floor time / meshcomm time; goals: Program >= {gp}x, "
             f"eager >= {ge}x), backend {b}:",
             f"{'case':22} {'exchange ms':>11} {'Program ms':>10} {'eager ms':>9} {'Program':>8} {'eager':>8}"]
    got = {"program": [], "eager": []}
    below = {"program": [], "eager": []}

    def ms(r, k):
        t = r["methods"].get(k, {}).get("time_s")
        return f"{t * 1e3:.2f}" if t else "-"
    for r in rows:
        if "floor" not in r["methods"]:
            continue
        cells = []
        for key, m, goal in (("program", prog, gp), ("eager", eager, ge)):
            v = _ratio(r, "floor", m)
            if v is None:
                cells.append(f"{'-':>8}")
                continue
            got[key].append(v)
            if v < goal:
                below[key].append(r["case"])
            cells.append(f"{v:7.2f}x" + ("" if v >= goal else " <"))
        lines.append(f"{r['case']:22} {ms(r, 'floor'):>11} {ms(r, prog):>10} {ms(r, eager):>9} " + " ".join(cells))
    for key, goal in (("program", gp), ("eager", ge)):
        v = got[key]
        if v:
            lines.append(f"{key}: geomean {geomean(v):.2f}x of the hand-written exchange (worst {min(v):.2f}x); "
                         f"{len(v) - len(below[key])} of {len(v)} cases at or above {goal}x"
                         + (f"; below: {', '.join(below[key])}" if below[key] else ""))
    lines.append("'<' marks a case below its goal; cases with a pending-sum dst have no hand-written exchange")
    return "\n".join(lines)


def cmd_run(args) -> int:
    if args.json:
        check_output(args.json, "--json")
    try:
        parse_backends(args.backends)
    except ValueError as e:
        print(f"meshcomm bench run: {e}", file=sys.stderr)
        return 2
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
