"""`meshcomm log summary|trace|compare DIR`: read the files meshcomm.log writes.

    meshcomm log summary logs/run1 [--plot sizes.png]   # per op and message size
    meshcomm log trace logs/run1 -o trace.json           # open in ui.perfetto.dev or chrome://tracing
    meshcomm log compare logs/run1 --example moe          # against meshcomm.model.for_example

A call is the records of every rank with the same (group, call). For each call:
* size: the nccl-tests message size, the records' logical_bytes (their mean where ranks
  differ: all_to_all_v, whose size is each rank's send buffer);
* time: from the last rank's t_run to the last rank's t_end (on the shared clock): how long
  the call took once every rank had started it; neither waiting for late ranks nor an async
  call's wait behind earlier calls of its rank is counted;
* straggler: the slowest rank's t_end minus the fastest's;
* algbw = size / time; busbw = algbw times nccl-tests' bus factor (meshcomm.bandwidth, the
  one table) for the group's own size n (a record's group_size where given, else its
  group's), not the world's; a reshard has no such factor: its busbw is the busiest rank's
  wire bytes (max of sent and received) over the time.
Rows sum calls per (op, size bucket) (`--by tag`: per innermost tag): algbw and busbw there
are total bytes over total time.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

from meshcomm.bandwidth import bus_factor
from meshcomm.model.entries import SIZE_BUCKETS, format_bytes, size_bucket
from meshcomm.model.examples import EXAMPLES

from .common import UsageError, check_output, require, write_json

__all__ = ["Log", "Call", "Row", "read", "calls", "summary", "format_summary", "trace", "plot",
           "add_parser", "small_share"]

# ops logged under a name of their own, and the bus-factor table's entry they take
FACTOR_OF = {"all_to_all_v": "all_to_all"}


@dataclasses.dataclass(frozen=True)
class Log:
    directory: str
    headers: dict          # rank -> header
    records: tuple         # every rank's records, by rank then seq

    @property
    def world(self) -> int:
        return max([h.get("world", 1) for h in self.headers.values()] + [len(self.headers)])


def read(directory) -> Log:
    """Every `rank<r>.jsonl` of `directory` (UsageError when there is none or a line is not
    JSON, naming the file and line)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise UsageError(f"{directory}: no such folder")
    files = sorted((int(m.group(1)), f) for f in os.listdir(directory)
                   if (m := re.fullmatch(r"rank(\d+)\.jsonl", f)))
    if not files:
        raise UsageError(f"{directory}: no rank<r>.jsonl files (was meshcomm.log started?)")
    headers, records = {}, []
    for rank, name in files:
        with open(os.path.join(directory, name)) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UsageError(f"{name} line {i} is not JSON: {e}") from None
                if "header" in obj:
                    headers[rank] = obj["header"]
                else:
                    records.append(obj)
    records.sort(key=lambda r: (r["rank"], r["seq"]))
    return Log(directory, headers, tuple(records))


@dataclasses.dataclass(frozen=True)
class Call:
    """One call, matched across the ranks that logged it."""
    op: str
    group: tuple
    call: int
    n: int                 # group size for the bus factor
    size: int              # message bytes (nccl-tests' size)
    time: float
    straggler: float
    wire: int              # the busiest rank's max(sent, received)
    tag: str
    t_start: float
    records: tuple

    @property
    def bus_bytes(self) -> float:
        key = FACTOR_OF.get(self.op, self.op)
        try:
            return bus_factor(key, self.n) * self.size
        except ValueError:          # reshard, barrier, ...: no factor; the measured wire bytes
            return float(self.wire)


def _op_of(ops) -> str:
    ops = sorted(set(ops))
    if len(ops) == 1:
        return ops[0]
    if ops == ["recv", "send"]:
        return "send"
    return "/".join(ops)


def calls(records) -> list[Call]:
    """The calls of `records`, by start time."""
    by = {}
    for r in records:
        by.setdefault((tuple(r["group"]), r["call"]), []).append(r)
    out = []
    for (group, k), rs in by.items():
        last_start = max(r.get("t_run", r["t_start"]) for r in rs)
        ends = [r["t_end"] for r in rs]
        out.append(Call(
            op=_op_of(r["op"] for r in rs), group=group, call=k,
            n=int(rs[0].get("group_size", len(group))),
            size=round(sum(r["logical_bytes"] for r in rs) / len(rs)),
            time=max(0.0, max(ends) - last_start), straggler=max(ends) - min(ends),
            wire=max(max(r["sent_bytes"], r["recv_bytes"]) for r in rs),
            tag=rs[0].get("tag", ""), t_start=min(r["t_start"] for r in rs), records=tuple(rs)))
    out.sort(key=lambda c: (c.t_start, c.group, c.call))
    return out


@dataclasses.dataclass(frozen=True)
class Row:
    op: str
    bucket: str
    calls: int
    bytes: int
    bus_bytes: float
    time: float
    straggler: float       # summed over calls
    max_straggler: float

    @property
    def avg_time(self) -> float:
        return self.time / self.calls

    @property
    def algbw(self) -> float:
        return self.bytes / self.time if self.time > 0 else float("nan")

    @property
    def busbw(self) -> float:
        return self.bus_bytes / self.time if self.time > 0 else float("nan")


def summary(records, buckets=SIZE_BUCKETS, by: str = "op") -> list[Row]:
    """One row per (op, message-size bucket), ops in name order, buckets in size order;
    by="tag": per (innermost tag, bucket) instead (its `op` column holds the tag)."""
    if by not in ("op", "tag"):
        raise ValueError(f"by must be 'op' or 'tag', got {by!r}")
    acc: dict = {}
    for c in calls(records):
        key = (c.op if by == "op" else (c.tag.split("/")[-1] or "-"), size_bucket(c.size, buckets))
        a = acc.setdefault(key, [0, 0, 0.0, 0.0, 0.0, 0.0])
        a[0] += 1
        a[1] += c.size
        a[2] += c.bus_bytes
        a[3] += c.time
        a[4] += c.straggler
        a[5] = max(a[5], c.straggler)
    order = {label: i for i, (label, _, _) in enumerate(buckets)}
    return [Row(op, b, *a) for (op, b), a in sorted(acc.items(), key=lambda kv: (kv[0][0], order[kv[0][1]]))]


def small_share(rows, below: int = 64 << 10, buckets=SIZE_BUCKETS) -> float:
    """The share of the total call time spent in rows whose bucket lies below `below` bytes."""
    small = {label for label, lo, hi in buckets if hi <= below}
    total = sum(r.time for r in rows)
    return sum(r.time for r in rows if r.bucket in small) / total if total > 0 else float("nan")


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def _gbs(x: float) -> str:
    return "-" if x != x else f"{x / 1e9:.3g}"


def format_summary(rows, by: str = "op") -> str:
    """The rows as an aligned table, a total line, and the share of time under 64 KiB."""
    head = (by, "size", "calls", "bytes", "time ms", "avg ms", "algbw GB/s", "busbw GB/s",
            "straggler avg ms", "max ms")
    lines = [head]
    for r in rows:
        lines.append((r.op, r.bucket, str(r.calls), format_bytes(r.bytes), _ms(r.time), _ms(r.avg_time),
                      _gbs(r.algbw), _gbs(r.busbw), _ms(r.straggler / r.calls), _ms(r.max_straggler)))
    n, t = sum(r.calls for r in rows), sum(r.time for r in rows)
    lines.append(("total", "", str(n), format_bytes(sum(r.bytes for r in rows)), _ms(t), "", "", "", "", ""))
    widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(x, widths)))
            for x in lines]
    text.insert(1, "-" * len(text[0]))
    share = small_share(rows)
    if share == share:
        text.append(f"time in messages under 64 KiB: {share:.1%}")
    return "\n".join(text)


def trace(log: Log) -> dict:
    """A Chrome trace (Perfetto, chrome://tracing): one process per rank, one complete event
    ("ph": "X", ts/dur in microseconds from the first call) per record, its fields as args;
    calls that overlap on a rank (async) go to further threads of it."""
    recs = log.records
    t0 = min((r["t_start"] for r in recs), default=0.0)
    events = []
    for rank in sorted(set(log.headers) | {r["rank"] for r in recs}):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        lanes: list[float] = []
        for r in sorted((r for r in recs if r["rank"] == rank), key=lambda r: (r["t_start"], r["seq"])):
            lane = next((i for i, end in enumerate(lanes) if end <= r["t_start"]), len(lanes))
            if lane == len(lanes):
                lanes.append(0.0)
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": lane,
                               "args": {"name": "calls" if lane == 0 else f"overlapping calls {lane}"}})
            lanes[lane] = r["t_end"]
            name = r["op"] + (f" {r['tag']}" if r.get("tag") else "")
            events.append({"name": name, "cat": r["op"], "ph": "X", "pid": rank, "tid": lane,
                           "ts": (r["t_start"] - t0) * 1e6, "dur": max(0.0, r["t_end"] - r["t_start"]) * 1e6,
                           "args": dict(r)})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "meshcomm.log", "directory": log.directory,
                          "clock_error_s": {str(k): h.get("clock_error") for k, h in log.headers.items()}}}


def plot(log: Log, path) -> None:
    """Message-size histograms per op and time per op (matplotlib, the `tools` extra)."""
    require("matplotlib", "--plot")
    import math
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    cs = calls(log.records)
    ops = sorted({c.op for c in cs})
    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    top = max([math.ceil(math.log2(max(c.size, 1))) for c in cs] + [1])
    bins = [2.0 ** k for k in range(0, top + 2)]
    ax1.hist([[max(c.size, 1) for c in cs if c.op == op] for op in ops], bins=bins, label=ops, stacked=True)
    ax1.set_xscale("log", base=2)
    ax1.axvline(64 << 10, color="grey", linestyle=":", linewidth=1)
    ax1.set(xlabel="message size (bytes)", ylabel="calls", title="message sizes")
    ax1.legend(fontsize=8)
    times = [sum(c.time for c in cs if c.op == op) * 1e3 for op in ops]
    ax2.barh(ops, times)
    ax2.set(xlabel="time (ms, summed over calls)", title="time per operation")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- the command line ----------------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("log", help="read a communication log (meshcomm.log / MESHCOMM_LOG)",
                       description=__doc__.split("\n\n")[0])
    s = p.add_subparsers(dest="log_command", metavar="{summary,trace,compare}", required=True)
    a = s.add_parser("summary", help="per op and message size: calls, time, algbw, busbw, stragglers")
    a.add_argument("dir")
    a.add_argument("--by", choices=("op", "tag"), default="op", help="rows per op (default) or per tag")
    a.add_argument("--plot", metavar="FILE.png", help="also draw message-size histograms and time per op")
    a.set_defaults(func=_summary)
    t = s.add_parser("trace", help="write a Chrome/Perfetto trace of the log")
    t.add_argument("dir")
    t.add_argument("-o", "--output", default="trace.json", help="the trace file (default trace.json)")
    t.set_defaults(func=_trace)
    c = s.add_parser("compare", help="logged calls and bytes against meshcomm.model.for_example")
    c.add_argument("dir")
    c.add_argument("--example", required=True, help=" | ".join(EXAMPLES))
    c.add_argument("--steps", type=int, default=None, help="training steps logged (default: inferred)")
    c.add_argument("--set", action="append", default=[], metavar="FLAG=VALUE",
                   help="a flag the example ran with, e.g. --set micro=8 (dashes as underscores)")
    c.set_defaults(func=_compare)


def flights(directory) -> dict[int, list[dict]]:
    """The flight recorders a failed call wrote (`flight_rank<r>.jsonl`, meshcomm.runtime.control):
    {rank: its last calls, oldest first}."""
    out = {}
    for f in sorted(os.listdir(directory)):
        m = re.fullmatch(r"flight_rank(\d+)\.jsonl", f)
        if m:
            with open(os.path.join(directory, f)) as fh:
                out[int(m.group(1))] = [json.loads(line) for line in fh if line.strip()]
    return out


def _call(e: dict) -> str:
    if e["what"] == "construct":
        return f"constructing Program #{e['program']} ({e['label']})"
    return f"run {e['run']} of Program #{e['program']} ({e['label']})"


def format_flights(fl: dict[int, list[dict]]) -> str:
    """Who waited for whom in which call: each rank's last call, its state and the peers it
    still awaited; then the pairs of ranks waiting for each other in different calls."""
    lines = ["flight recorder (each rank's last call):"]
    last = {r: es[-1] for r, es in fl.items() if es}
    for r, e in sorted(last.items()):
        wait = f", waiting for rank(s) {e['awaiting']}" if e["awaiting"] else ""
        lines.append(f"  rank {r}: {_call(e)}: {e['state']}{wait}")
    for r, e in sorted(last.items()):
        for q in e["awaiting"]:
            f = last.get(q)
            if f is None:
                lines.append(f"  rank {r} waited for rank {q}, which wrote no record: it never arrived, froze or died")
            elif r < q and r in f["awaiting"] and (f["program"], f["what"], f["run"]) != (e["program"], e["what"], e["run"]):
                lines.append(f"  ranks {r} and {q} waited for each other in different calls: "
                             f"{_call(e)} / {_call(f)}")
    return "\n".join(lines)


def _summary(args) -> int:
    if args.plot:
        check_output(args.plot, "--plot")
        require("matplotlib", "--plot")
    if os.path.isdir(args.dir):
        fl = flights(args.dir)
        if fl:
            print(format_flights(fl))
            if not any(re.fullmatch(r"rank\d+\.jsonl", f) for f in os.listdir(args.dir)):
                return 0
    log = read(args.dir)
    print(f"{args.dir}: {len(log.records)} records from {len(log.headers)} rank(s)")
    print(format_summary(summary(log.records, by=args.by), by=args.by))
    if args.plot:
        plot(log, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _trace(args) -> int:
    check_output(args.output, "-o")
    write_json(args.output, trace(read(args.dir)))
    return 0


def _compare(args) -> int:
    from .log_compare import compare, parse_flags
    log = read(args.dir)
    try:
        cmp = compare(log.records, args.example, steps=args.steps, world=log.world, **parse_flags(args.set))
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    print(cmp.text())
    return 0 if cmp.ok else 1
