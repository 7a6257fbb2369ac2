"""`meshcomm tune`: measure each backend's primitives and write the tuning table `mixed` reads.

    mpiexec -n 8 meshcomm tune --out tuning.json
    MESHCOMM_TUNING=tuning.json python my_training.py      # mixed now picks per measurement

Run under the launcher (every process runs it). For each backend available in this launch
(mpi and torch/gloo under mpiexec; torch alone under torchrun), each operation and each
message size (powers of two, `--min-bytes` .. `--max-bytes`), it runs warm-up iterations,
then timed trials (each starts after a barrier; a trial's time is the slowest process's),
and keeps the median. Operations are the primitives of meshcomm.backends.base.Backend, the
ones `reshard` issues:

* ``send``: every rank isend()s SIZE bytes to rank+1 and irecv()s from rank-1 (a ring, as
  nccl-tests' sendrecv); busbw = algbw = SIZE / time.
* ``bcast``: bcast() of SIZE bytes from rank 0 over the group; busbw = algbw.
* ``reduce``: reduce() (sum) of SIZE bytes of float32 to rank 0; busbw = algbw.

and the backends' native collectives (one MPI / torch.distributed call each, backends/base.py),
SIZE being nccl-tests' size (busbw factors: meshcomm.backends.tuning.bus_factor):

* ``allreduce``: allreduce() (sum) of SIZE bytes of float32; busbw = algbw * 2(n-1)/n.
* ``allgather``: allgatherv() of SIZE/n bytes per rank into SIZE; busbw = algbw * (n-1)/n.
* ``reduce_scatter``: reduce_scatterv() (sum) of SIZE bytes of float32, SIZE/n to each
  rank; busbw = algbw * (n-1)/n.
* ``alltoall``: alltoall() of SIZE bytes per rank (SIZE/n to each); busbw = algbw * (n-1)/n.
  (all_to_all_v's point-to-point exchange follows the same rule.)
* ``gather`` / ``scatter``: gatherv() / scatterv() of SIZE bytes at rank 0, SIZE/n from / to
  each rank; busbw = algbw.

(The definitions of nccl-tests' PERFORMANCE.md.) Group sizes of the collectives default to
the world; `--groups 2,4,8` measures groups of the first k ranks. The table printed on rank 0
lists median time, algbw and busbw per backend and the faster one; the JSON written to
`--out` (format meshcomm-tuning-v1, backends/tuning.py) has one rule per (op, size range,
group range) naming the faster backend on CPU tensors, followed by the built-in defaults
(CUDA tensors -> torch, else mpi), and every measurement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from meshcomm.backends.tuning import OPS, bus_factor

from . import codec_tune
from .common import check_output, importable, progress, require

__all__ = ["add_parser", "run", "parse_bytes", "derive_rules", "busbw_factor", "OPS"]

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20,
          "MIB": 2**20, "G": 2**30, "GB": 2**30, "GIB": 2**30}

HELP = __doc__


def parse_bytes(text: str) -> int:
    """'1K' -> 1024, '64M' -> 67108864, '4096' -> 4096."""
    t = str(text).strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"bad size {text!r}: use e.g. 4096, 1K, 64M")
    try:
        v = float(num) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"bad size {text!r}: use e.g. 4096, 1K, 64M") from None
    if v < 1 or v != int(v):
        raise ValueError(f"size {text!r} must be a positive whole number of bytes")
    return int(v)


def size_label(n: int) -> str:
    """The inverse of parse_bytes for the table: 1024 -> '1K', 65536 -> '64K', 1000 -> '1000B'."""
    for unit, k in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return f"{n}B"


def sizes_between(lo: int, hi: int) -> list[int]:
    if lo > hi:
        raise ValueError(f"--min-bytes {lo} is larger than --max-bytes {hi}")
    out, s = [], 1 << max(0, (lo - 1).bit_length())
    while s <= hi:
        out.append(s)
        s *= 2
    return out or [lo]


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests: busbw = algbw * factor (the table in meshcomm.backends.tuning)."""
    return bus_factor(op, n)


# -- the measurements ---------------------------------------------------------------------

class _Bench:
    def __init__(self, ctx, backend, deadline_s: float):
        self.ctx = ctx
        self.b = backend
        self.rank, self.n = backend.rank, backend.world_size
        self.deadline_s = deadline_s
        self._tag = 0

    def deadline(self):
        return time.monotonic() + self.deadline_s

    def tag(self):
        from meshcomm.backends.base import TAG_MOD
        self._tag = (self._tag + 1) % TAG_MOD
        return self._tag

    def buf(self, nbytes: int, typed: bool = False):
        from meshcomm.backends.base import empty_wire
        like = np.empty(0, dtype=np.float32)
        if typed:
            b = empty_wire(0, self.b.wire, like, typed_elems=max(1, nbytes // 4))
        else:
            b = empty_wire(nbytes, self.b.wire, like)
        b[:] = 1
        return b

    def one(self, op: str, nbytes: int, group: tuple[int, ...], bufs) -> None:
        """One iteration of `op` on this rank (returns when its part is complete)."""
        b, me, n = self.b, self.rank, self.n
        works = []
        if op == "send":
            tag = self.tag()
            works.append(b.irecv(bufs["recv"], (me - 1) % n, tag))
            works.append(b.isend(bufs["send"], (me + 1) % n, tag))
        elif op == "bcast":
            if me in group:
                works.append(b.bcast(bufs["send"], group[0], group))
        elif op == "reduce":
            if me in group:
                works.append(b.reduce(bufs["send"], group[0], group))
        elif me in group:
            works.append(self.native(op, group, bufs))
        b.wait_all(works, self.deadline())

    def native(self, op: str, group: tuple[int, ...], bufs):
        """One native collective over `group` (blocks of bufs["counts"] elements)."""
        b, c, root = self.b, bufs["counts"], group[0]
        if op == "allreduce":
            return b.allreduce(bufs["whole"], "sum", group)
        if op == "allgather":
            return b.allgatherv(bufs["part"], bufs["whole"], c, group)
        if op == "reduce_scatter":
            return b.reduce_scatterv(bufs["whole"], bufs["part"], c, "sum", group)
        if op == "alltoall":
            return b.alltoall(bufs["whole"], bufs["out"], group)
        if op == "gather":
            return b.gatherv(bufs["part"], bufs["whole"], c, root, group)
        return b.scatterv(bufs["whole"], bufs["part"], c, root, group)

    def measure(self, op: str, nbytes: int, group: tuple[int, ...], warmup: int, trials: int):
        if op not in ("send", "bcast", "reduce"):       # native: SIZE/g per member
            typed = op in ("allreduce", "reduce_scatter")
            g, unit = len(group), 4 if typed else 1
            e = max(1, nbytes // unit // g)
            bufs = {"counts": [e] * g, "part": self.buf(e * unit, typed), "out": self.buf(e * g * unit, typed),
                    "whole": self.buf(e * g * unit, typed)}
        elif op == "reduce":
            bufs = {"send": self.buf(nbytes, typed=True)}
        else:
            bufs = {"send": self.buf(nbytes), "recv": self.buf(nbytes)}
        for _ in range(warmup):
            self.one(op, nbytes, group, bufs)
        times = []
        for _ in range(trials):
            self.b.barrier(self.deadline())
            t0 = time.perf_counter()
            self.one(op, nbytes, group, bufs)
            times.append(time.perf_counter() - t0)
        every = self.b.allgather_obj(times, self.deadline())
        worst = [max(ts[i] for ts in every) for i in range(trials)]
        return statistics.median(worst), worst


# -- rules ----------------------------------------------------------------------------------

def derive_rules(measurements: list[dict], device: str = "cpu") -> list[dict]:
    """Per (op, group): the faster backend at each measured size, merged into size ranges.

    A size s_i measured between s_{i-1} and s_{i+1} covers (s_{i-1}, s_i]; the first range
    starts at 0 and the last is unbounded. Group sizes likewise: a measured group g_j covers
    (g_{j-1}, g_j], the largest is unbounded. send and alltoall rules match any group size.
    """
    by: dict[tuple[str, int], dict[int, dict[str, float]]] = {}
    for m in measurements:
        by.setdefault((m["op"], m["group"]), {}).setdefault(m["bytes"], {})[m["backend"]] = m["seconds"]
    rules = []
    for op in OPS:
        groups = sorted(g for (o, g) in by if o == op)
        for gi, g in enumerate(groups):
            if op == "send":
                gmin, gmax = 0, None
            else:
                gmin = 0 if gi == 0 else groups[gi - 1] + 1
                gmax = None if gi == len(groups) - 1 else g
            sizes = sorted(by[(op, g)])
            winners = [min(by[(op, g)][s].items(), key=lambda kv: (kv[1], kv[0]))[0] for s in sizes]
            start = 0
            for i, (s, w) in enumerate(zip(sizes, winners)):
                last = i == len(sizes) - 1
                if last or winners[i + 1] != w:
                    rule = {"op": op, "min_bytes": start, "max_bytes": None if last else s,
                            "min_group": gmin, "max_group": gmax, "backend": w}
                    if device:
                        rule["device"] = device
                    rules.append(rule)
                    start = s + 1
            if op == "send":
                break           # one group size matters for it
    return rules


# -- CLI ------------------------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure the backends' primitives, write a tuning table (under mpiexec)",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="meshcomm-tuning.json", help="JSON table to write (rank 0)")
    p.add_argument("--backends", default="auto",
                   help="comma-separated: mpi,torch (default: every backend this launch can run)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--min-bytes", default="1K", help="smallest message (default 1K)")
    p.add_argument("--max-bytes", default="64M", help="largest message (default 64M)")
    p.add_argument("--sizes", default="", help="explicit comma-separated sizes (overrides min/max)")
    p.add_argument("--groups", default="",
                   help="group sizes of the collectives, comma-separated (default: the world)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per size (default 2)")
    p.add_argument("--trials", type=int, default=5, help="timed trials per size (median; default 5)")
    p.add_argument("--json-only", action="store_true", help="do not print the table")
    p.add_argument("--codecs", default=codec_tune.DEFAULT,
                   help="codecs whose throughput the compression cost model needs, every process coding at once "
                        f"(default {codec_tune.DEFAULT}; 'none' skips)")
    p.set_defaults(func=run)


def _init_context(names: list[str]):
    import meshcomm as mc
    from meshcomm.backends.torch_dist import under_torchrun
    ctx = mc.runtime.current()
    if ctx is not None:
        return ctx
    if names == ["auto"]:
        if under_torchrun() and not _mpi_world():
            names = ["torch"]
        else:
            names = ["mpi", "torch"] if importable("torch") else ["mpi"]
    for name, module in (("mpi", "mpi4py"), ("torch", "torch")):
        if name in names:
            require(module, f"the {name} backend", extra=name)
    if set(names) == {"mpi", "torch"}:
        return mc.init(backend="mixed")
    if len(names) == 1 and names[0] in ("mpi", "torch"):
        return mc.init(backend=names[0])
    raise ValueError(f"--backends must name mpi and/or torch, got {','.join(names)}")


def _mpi_world() -> bool:
    from meshcomm.backends.torch_dist import under_mpi_launcher
    return under_mpi_launcher()


def run(args) -> int:
    try:
        sizes = ([parse_bytes(s) for s in args.sizes.split(",") if s.strip()] if args.sizes
                 else sizes_between(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)))
        ops = [o.strip() for o in args.ops.split(",") if o.strip()]
        bad = [o for o in ops if o not in OPS]
        if bad:
            raise ValueError(f"unknown op(s) {bad}; choose from {OPS}")
        if args.trials < 1 or args.warmup < 0:
            raise ValueError("--trials must be >= 1 and --warmup >= 0")
        names = [b.strip() for b in args.backends.split(",") if b.strip()]
        check_output(args.out, "--out")
        codec_list = codec_tune.parse_codecs(args.codecs)
    except ValueError as e:
        print(f"meshcomm tune: error: {e}", file=sys.stderr)
        return 2
    import meshcomm as mc
    ctx = _init_context(names)
    n = ctx.world_size
    if n < 2:
        print("meshcomm tune: error: run it under a launcher with at least 2 processes, e.g. "
              "`mpiexec -n 4 meshcomm tune`", file=sys.stderr)
        mc.finalize()
        return 2
    backends = [ctx.get_backend(b) for b in ("mpi", "torch") if b in ctx._backends]
    try:
        groups = sorted({int(g) for g in args.groups.split(",") if g.strip()}) if args.groups else [n]
    except ValueError:
        print(f"meshcomm tune: error: bad --groups {args.groups!r}", file=sys.stderr)
        return 2
    if any(not 2 <= g <= n for g in groups):
        print(f"meshcomm tune: error: group sizes must be in 2..{n}, got {groups}", file=sys.stderr)
        return 2
    rank = ctx.rank
    configs = []
    for op in ops:
        for g in ([2] if op == "send" else groups):
            for s in sizes:
                configs.append((op, g, s))
    measurements = []
    bar = progress(total=len(configs) * len(backends), disable=rank != 0, desc="meshcomm tune",
                   unit="size", file=sys.stderr, dynamic_ncols=True)
    try:
        for b in backends:
            bench = _Bench(ctx, b, ctx.timeout)
            subgroups = [tuple(range(g)) for g in groups if g < n]
            b.prepare_groups(subgroups, bench.deadline())
            for op, g, s in configs:
                bar.set_postfix_str(f"{b.name} {op} {size_label(s)}", refresh=False)
                med, trials = bench.measure(op, s, tuple(range(g)), args.warmup, args.trials)
                alg = s / med / 1e9 if med > 0 else float("inf")
                measurements.append({"op": op, "backend": b.name, "bytes": s, "group": g,
                                     "seconds": med, "trials": trials, "algbw_GBps": alg,
                                     "busbw_GBps": alg * busbw_factor(op, g)})
                bar.update(1)
    finally:
        bar.close()
    codecs = codec_tune.measure_codecs(backends[0], codec_list, timeout=ctx.timeout)
    if rank == 0:
        from meshcomm.backends import tuning
        rules = derive_rules(measurements, device="cpu") + [r.to_dict() for r in tuning.default_table().rules]
        table = {"format": tuning.FORMAT, "rules": rules,
                 "measurements": [dict(m, world=n) for m in measurements], "codecs": codecs}
        tuning.from_dict(table, "meshcomm tune")        # validate before writing
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
            f.write("\n")
        if not args.json_only:
            print(format_table(measurements, [b.name for b in backends], n))
            print(codec_tune.format_codecs(codecs))
        print(f"wrote {args.out}: {len(rules)} rules from {len(measurements)} measurements "
              f"({n} processes); use it with MESHCOMM_TUNING={args.out}")
    mc.finalize()
    return 0


def format_table(measurements: list[dict], names: list[str], n: int) -> str:
    """nccl-tests style: one block per op, one row per (group, size), per backend the median
    time (us), algbw and busbw (GB/s), then the faster backend."""
    lines = []
    by = {}
    for m in measurements:
        by.setdefault((m["op"], m["group"], m["bytes"]), {})[m["backend"]] = m
    head = f"{'op':<14s} {'group':>5s} {'size':>8s}"
    for nm in names:
        head += f" | {nm + ' us':>11s} {'algbw':>7s} {'busbw':>7s}"
    head += " | best"
    lines.append(f"# {n} processes; time = median over trials of the slowest process; GB/s")
    lines.append(head)
    lines.append("-" * len(head))
    for (op, g, s) in sorted(by, key=lambda k: (OPS.index(k[0]), k[1], k[2])):
        row = by[(op, g, s)]
        line = f"{op:<14s} {g:>5d} {size_label(s):>8s}"
        for nm in names:
            m = row.get(nm)
            if m is None:
                line += f" | {'-':>11s} {'-':>7s} {'-':>7s}"
            else:
                line += f" | {m['seconds'] * 1e6:11.1f} {m['algbw_GBps']:7.3f} {m['busbw_GBps']:7.3f}"
        best = min(row.values(), key=lambda m: (m["seconds"], m["backend"]))["backend"]
        lines.append(line + f" | {best}")
    return "\n".join(lines)
