"""A communication log against the analytic model: calls and bytes of each example's phases
(`meshcomm log compare`, and what the examples print with --log).

    cmp = compare(records, "moe", steps=5, world=4, batch=16)   # flags: the example's
    print(cmp.text()); cmp.ok

Rows are (phase, via): the phase is the innermost name of a record's tag (the examples tag
their calls with the model's phases: "tp.fwd", "pp.bwd", "emb.fwd", "ep.ids", "dp.grad",
"fsdp.gather", ...), via its op ("reshard", "all_to_all_v", or a collective). A record's
bytes are those of the tile the rank passed to the call (in_bytes), or of the tile it got
back where it passed none (out_bytes of a rank outside src_ranks); a collective's (a record
with a group_size) are its logical_bytes, nccl-tests' size: each is what the model's
message_bytes is (meshcomm.model.examples). Left out: records tagged "check" at any level (the --check
comparison after training), and what the model does not count either: the count exchange
inside all_to_all_v (its ctl_*_bytes, not records of their own) and the agreement check
(never logged). A row matches when every rank's calls equal the model's times the steps, and
so do its bytes, except that where the model gives a mean over the group's ranks
(all_to_all_v whose counts depend on the routing) only the sum over ranks must equal.
"""
from __future__ import annotations

import dataclasses

__all__ = ["CompareRow", "Comparison", "compare", "record_bytes", "parse_flags"]


@dataclasses.dataclass(frozen=True)
class CompareRow:
    phase: str
    via: str
    model_calls: int        # summed over ranks, all steps
    logged_calls: int
    model_bytes: int
    logged_bytes: int
    mean: bool              # the model's bytes are exact only summed over ranks
    bad_ranks: tuple        # ranks whose own calls (or bytes, unless mean) differ

    @property
    def ok(self) -> bool:
        return (self.model_calls == self.logged_calls and self.model_bytes == self.logged_bytes
                and not self.bad_ranks)


@dataclasses.dataclass(frozen=True)
class Comparison:
    example: str
    steps: int
    world: int
    rows: tuple
    excluded: int           # records left out (tagged "check")

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def text(self) -> str:
        head = ("phase", "via", "model calls", "logged", "model bytes", "logged", "match")
        lines = [head] + [(r.phase, r.via, str(r.model_calls), str(r.logged_calls), str(r.model_bytes),
                           str(r.logged_bytes), ("yes" if r.ok else "NO") + (" (sum over ranks)" if r.mean else "")
                           + (f" ranks {list(r.bad_ranks)[:8]} differ" if r.bad_ranks else ""))
                          for r in self.rows]
        w = [max(len(x[i]) for x in lines) for i in range(len(head))]
        out = [f"{self.example}: {self.world} rank(s), {self.steps} step(s), logged vs meshcomm.model "
               f"(calls and bytes summed over ranks; {self.excluded} check record(s) left out)"]
        out += ["  ".join(c.ljust(w[i]) if i in (0, 1, 6) else c.rjust(w[i]) for i, c in enumerate(x))
                for x in lines]
        out.append("all match" if self.ok else "MISMATCH")
        return "\n".join(out)


def record_bytes(rec: dict) -> int:
    """The bytes of the tile the rank passed, or got back where it passed none; a
    collective's nccl-tests size."""
    if "group_size" in rec:
        return int(rec["logical_bytes"])
    if rec["rank"] in rec.get("src_ranks", (rec["rank"],)):
        return int(rec["in_bytes"])
    return int(rec["out_bytes"])


def parse_flags(items) -> dict:
    """["micro=8", "widths=8,16"] -> {"micro": 8, "widths": "8,16"} (ints where they parse)."""
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ValueError(f"--set wants FLAG=VALUE, got {it!r}")
        try:
            out[k.replace("-", "_")] = int(v)
        except ValueError:
            out[k.replace("-", "_")] = v
    return out


def compare(records, example: str, *, steps: int | None = None, world: int | None = None,
            exclude=("check",), **flags) -> Comparison:
    """Compare `records` (meshcomm.log's, of every rank) with `meshcomm.model.for_example
    (example, world=world, **flags)` times `steps` (inferred from the call counts when None)."""
    from meshcomm import model
    kept = [r for r in records if not set(r.get("tag", "").split("/")) & set(exclude)]
    if world is None:
        world = 1 + max([r["rank"] for r in records] + [0])
    try:
        per_rank = model.for_example(example, world=world, **flags)
    except (ValueError, TypeError) as e:
        words = [f"{k}={v}" for k, v in flags.items() if isinstance(v, str)]
        raise ValueError(f"{e}" + (f" (from --set {', '.join(words)}: not a number)" if words else "")) from e
    want: dict = {}                     # (phase, via) -> rank -> [calls, bytes, mean]
    for rank, entries in per_rank.items():
        for e in entries:
            w = want.setdefault((e.phase, e.via), {}).setdefault(rank, [0, 0, False])
            w[0] += e.calls
            w[1] += e.bytes_per_rank
            w[2] = w[2] or e.mean
    got: dict = {}
    for r in kept:
        g = got.setdefault((r.get("tag", "").split("/")[-1], r["op"]), {}).setdefault(r["rank"], [0, 0])
        g[0] += 1
        g[1] += record_bytes(r)
    if steps is None:
        per_step = sum(w[0] for ranks in want.values() for w in ranks.values())
        logged = sum(g[0] for key, ranks in got.items() if key in want for g in ranks.values())
        steps = max(1, round(logged / per_step)) if per_step else 1
    rows = []
    for key in list(want) + [k for k in got if k not in want]:
        wr, gr = want.get(key, {}), got.get(key, {})
        mean = any(w[2] for w in wr.values())
        bad = []
        for rank in sorted(set(wr) | set(gr)):
            w, g = wr.get(rank, [0, 0, False]), gr.get(rank, [0, 0])
            if w[0] * steps != g[0] or (not mean and w[1] * steps != g[1]):
                bad.append(rank)
        rows.append(CompareRow(key[0], key[1], steps * sum(w[0] for w in wr.values()),
                               sum(g[0] for g in gr.values()), steps * sum(w[1] for w in wr.values()),
                               sum(g[1] for g in gr.values()), mean, tuple(bad)))
    return Comparison(example, steps, world, tuple(rows), len(records) - len(kept))
