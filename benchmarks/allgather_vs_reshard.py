"""meshcomm.reshard vs a plain allgather-then-slice, on 8 processes (or 4).

    .venv/bin/mpiexec -n 8 .venv/bin/python benchmarks/allgather_vs_reshard.py [--backends mpi,mpi:shape,mpi:program]

Alpa's cross-mesh resharding case specs (meshcomm/data/alpa_resharding_cases.json, the
n-to-m suite) scaled to a 2x2 src mesh (devices 0-3, axes x, y) and a 2x2 dst mesh
(devices 4-7), a 16 MiB float32 tensor, one device per process (with 4 processes: 2x1
meshes, devices 0-1 and 2-3).

* reshard: every process calls meshcomm with the src tile it owns and gets its dst tile,
  as each --backends entry says: `NAME` the eager `meshcomm.reshard` without shape and dtype
  (processes without src tiles learn them: an agreement every call), `NAME:shape` the eager
  call with them (its cached Program, found by the call's arguments), `NAME:program` a run of
  `mc.Program.reshard(src, dst, shape=, dtype=)` constructed once per case before the
  timed calls.
* baseline: an allgather of the tensor's distinct src tiles (one replica of each, so every
  element travels once into every process), then each dst process assembles the global
  array and slices its dst tile out. Three ways, the fastest counts: MPI_Allgatherv
  (blocking); MPI_Iallgatherv waited on the way meshcomm waits (polling that yields the
  core: on an oversubscribed machine MPICH's spinning waits are slow); and a direct
  Isend/Irecv of each tile to every process (one step, like reshard's own messages).

Each figure is the median over repeats of the slowest process's time (barrier before
each call); every round calls each method once, in turn (the same load on a shared machine). Both results are checked bitwise against the tile of the original tensor.
Rank 0 prints one row per case and the geometric mean of the speed-ups.
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

from mpi4py import MPI

import meshcomm as mc
from meshcomm.backends.base import Work, wait_polling
from meshcomm.tools.cases import alpa_spec, global_array, load_alpa
from meshcomm.tools.common import geomean
from meshcomm.tools.bench.run import time_interleaved
from meshcomm.tools.spmd import exact

BASELINES = {"blocking": "MPI_Allgatherv", "polite": "MPI_Iallgatherv polled like meshcomm polls",
             "direct": "Isend/Irecv of each tile to every process"}
MESHES = {8: (mc.Mesh([[0, 1], [2, 3]], ("x", "y")), mc.Mesh([[4, 5], [6, 7]], ("x", "y"))),
          4: (mc.Mesh([[0], [1]], ("x", "y")), mc.Mesh([[2], [3]], ("x", "y")))}


def alpa_cases():
    """(case number, src spec, dst spec) of Alpa's n-to-m cases, each pair of specs once."""
    out, seen = [], set()
    for c in load_alpa()["n_to_m"]:
        key = (json.dumps(c["src_spec"]), json.dumps(c["dst_spec"]))
        if key in seen:
            continue
        seen.add(key)
        out.append((c["case"], alpa_spec(c["src_spec"]), alpa_spec(c["dst_spec"])))
    return out


def shape_for(mib: float, ndim: int = 3) -> tuple[int, ...]:
    n = int(mib * 2**20 // 4)
    # keep Alpa's 2:2:1 proportions (1024 x 1024 x 512) as far as powers of two allow
    c = round((n / 4) ** (1 / 3))
    c = 2 ** round(math.log2(c))
    shape = (2 * c, 2 * c, n // (4 * c * c))
    assert math.prod(shape) == n, shape
    return shape


class _Req(Work):
    def __init__(self, req):
        self.req = req

    def test(self):
        return self.req.Test()


class AllgatherSlice:
    """The baseline: Allgatherv of one replica of each src tile, assemble, slice."""

    def __init__(self, comm, x_shape, src, dst):
        self.comm, self.shape, self.src, self.dst = comm, x_shape, src, dst
        st = src.tiles(x_shape)
        self.st = st
        self.contrib = {}           # device -> box, one device per distinct src tile
        for sc, groups in st.classes.items():
            d = next(iter(groups.values()))[0]
            self.contrib[d] = st.boxes[d]
        rank = comm.Get_rank()
        self.counts = [0] * comm.Get_size()
        self.order = sorted(self.contrib)
        for d in self.order:
            self.counts[d] += math.prod(b - a for a, b in self.contrib[d])
        self.displs = [sum(self.counts[:r]) for r in range(len(self.counts))]
        self.recv = np.empty(sum(self.counts), dtype=np.float32)
        self.rank = rank

    def __call__(self, tile, polite=False, direct=False):
        me = self.rank
        send = tile.reshape(-1) if me in self.contrib else np.empty(0, np.float32)
        if direct:              # one step: each contributor sends its tile straight to everyone
            reqs = []
            for d in self.order:
                n, off = self.counts[d], self.displs[d]
                if d == me:
                    self.recv[off:off + n] = send
                    reqs += [_Req(self.comm.Isend(send, dest=r, tag=7)) for r in range(self.comm.Get_size())
                             if r != me]
                else:
                    reqs.append(_Req(self.comm.Irecv(self.recv[off:off + n], source=d, tag=7)))
            wait_polling(reqs, None)
        elif polite:              # non-blocking, waited for the way meshcomm waits (yields the core)
            req = self.comm.Iallgatherv(send, [self.recv, self.counts, self.displs, MPI.FLOAT])
            wait_polling([_Req(req)], None)
        else:
            self.comm.Allgatherv(send, [self.recv, self.counts, self.displs, MPI.FLOAT])
        if me not in self.dst.mesh:
            return None
        full = np.empty(self.shape, np.float32)
        for d in self.order:
            box = self.contrib[d]
            n = self.counts[d]
            full[tuple(slice(a, b) for a, b in box)] = \
                self.recv[self.displs[d]:self.displs[d] + n].reshape([b - a for a, b in box])
        box = self.dst.tiles(self.shape).boxes[me]
        return full[tuple(slice(a, b) for a, b in box)].copy()


def _reshard_fn(inp, src, dst, shape, spec: str):
    """meshcomm as `spec` says: "mpi" (the eager call, shape and dtype not given: processes
    without tiles learn them), "mpi:shape" (the eager call, given) or "mpi:program" (a
    Program, constructed here: every process calls this in the same order)."""
    name, _, opt = spec.partition(":")
    if opt not in ("", "shape", "program"):
        raise SystemExit(f"--backends entry {spec!r}: the suffix is :shape or :program")
    if opt == "program":
        prog = mc.Program.reshard(src, dst, shape=shape, dtype="float32", backend=name)
        return lambda: prog(inp)
    kw = {"shape": shape, "dtype": "float32"} if opt else {}
    return lambda: mc.reshard(inp, src, dst, backend=name, **kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="mpi,mpi:shape,mpi:program",
                    help="comma list of mpi, torch, mixed: NAME the eager call without shape/dtype, "
                         "NAME:shape the eager call with them, NAME:program a Program constructed once")
    ap.add_argument("--mib", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--baselines", default="blocking,polite,direct",
                    help="comma list of: " + ", ".join(f"{k} ({v})" for k, v in BASELINES.items()))
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() not in MESHES:
        raise SystemExit("run with mpiexec -n 8 (2x2 src mesh -> 2x2 dst mesh, one device per process) "
                         "or -n 4 (2x1 -> 2x1)")
    src_mesh, dst_mesh = MESHES[comm.Get_size()]
    backends = args.backends.split(",")
    baselines = args.baselines.split(",")
    names = {b.partition(":")[0] for b in backends}
    ctx = mc.init(backend="mpi" if names == {"mpi"} else "mixed")
    rank = ctx.rank
    shape = shape_for(args.mib)
    x = global_array(shape, 0, "float32")
    rows = []
    if rank == 0:
        print(f"meshcomm.reshard vs allgather-then-slice: {comm.Get_size()} processes, "
              f"{'x'.join(map(str, src_mesh.shape))} -> {'x'.join(map(str, dst_mesh.shape))} meshes, "
              f"{shape} float32 ({x.nbytes / 2**20:.0f} MiB), median of {args.reps}")
        print(f"allgather ms: {' / '.join(BASELINES[n] for n in baselines)}; the speed-up is over "
              "the fastest")
        print(f"{'case':>4} {'src':>16} {'dst':>16} {'backend':>11} {'moved MiB':>9} "
              f"{'reshard ms':>10} {'allgather ms':>26} {'speed-up':>8} exact")
    for case, sspec, dspec in alpa_cases():
        src, dst = mc.Layout(src_mesh, sspec), mc.Layout(dst_mesh, dspec)
        tiles = mc.shard(x, src)
        mine = tiles.get(rank)
        base = AllgatherSlice(comm, shape, src, dst)
        arg = mine if mine is not None else np.empty(0, np.float32)
        inp = {rank: mine} if mine is not None else {}
        methods = [(n, lambda n=n: base(arg, polite=n == "polite", direct=n == "direct")) for n in baselines]
        methods += [(b, _reshard_fn(inp, src, dst, shape, b)) for b in backends]
        res = time_interleaved(comm, methods, args.reps, args.warmup)
        t_b = {n: res[n][0] for n in baselines}
        ok_ag = all([exact(comm, dst, shape, x, res[n][1]) for n in baselines])
        t_ag = min(t_b.values())            # the fastest baseline
        p = mc.plan(shape, "float32", src, dst)
        for b in backends:
            t_rs, got = res[b]
            ok = exact(comm, dst, shape, x, got) and ok_ag
            rows.append((case, b, t_rs, t_ag, ok))
            if rank == 0:
                print(f"{case:>4} {str(src.spec_str()):>16} {str(dst.spec_str()):>16} {b:>11} "
                      f"{p.bytes_moved / 2**20:>9.1f} {t_rs * 1e3:>10.2f} "
                      f"{' / '.join(f'{t_b[n] * 1e3:.1f}' for n in baselines):>26} "
                      f"{t_ag / t_rs:>7.2f}x {'yes' if ok else 'NO'}", flush=True)
    if rank == 0:
        for b in backends:
            r = [t_ag / t_rs for _, bb, t_rs, t_ag, _ in rows if bb == b]
            all_ok = all(ok for _, bb, *_, ok in rows if bb == b)
            print(f"geomean speed-up of reshard[{b}] over allgather-then-slice: {geomean(r):.2f}x "
                  f"over {len(r)} cases; all exact: {all_ok}")
    mc.finalize()


if __name__ == "__main__":
    main()
