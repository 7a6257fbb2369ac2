"""`meshcomm advise`: check a transformer's shape against the GPU-efficiency guidelines, name
the nearest good values, and print the model's communication per iteration.

    meshcomm advise --hidden 4096 --heads 32 --vocab 50257 --seq 2048 --micro-batch 1 \
        --layers 32 --tp 8 --pp 4 [--ffn F] [--dp D] [--dtype bf16]

Guidelines ("The Case for Co-Designing Model Architectures with Hardware", and NVIDIA's
"Matrix Multiplication Background User's Guide" for the tile and wave arithmetic):
- vocab a multiple of 64, and vocab/tp too (padding the embedding; only up is offered);
- hidden divisible by heads; head dim (hidden/heads) a multiple of 8 elements for 16-bit
  types (16 bytes: tensor cores; 4 for fp32/tf32), 64 or 128 best (a note);
- hidden a multiple of 64, and hidden/tp too; ffn a multiple of 64 and of tp;
- heads divisible by tp; layers divisible by pp; micro-batch*seq a multiple of 64;
- with --sp (sequence parallelism) seq divisible by tp (each tp rank holds seq/tp tokens);
- wave quantisation (a note): the QKV GEMM (b*s x h) by (h x 3h/tp) is cut into 128x256
  output tiles (the largest 16-bit tile of cuBLAS/CUTLASS on A100), one per SM at a time;
  tiles = ceil(b*s/128) * ceil(3h/tp/256), waves = ceil(tiles/SMs) with 108 SMs on an A100
  (--sms); the last wave runs tiles - (waves-1)*SMs tiles, and tiles/(waves*SMs) of the
  GPU's tile slots do work.
- pipeline bubble (a warning): with m micro-batches and pp stages, (pp-1)/(m+pp-1) of the
  step idles (1F1B and GPipe alike), half or more when m < pp.
The suggested line repeats every flag given, so pasting it back analyses the same set-up.
Exit status: 0 no violation, 1 violations (printed), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from meshcomm import model as M
from meshcomm.tools.common import positive

__all__ = ["main", "Violation", "check_shape", "wave_note", "suggest", "build_parser", "bubble"]

ALIGN = {"bf16": 8, "fp16": 8, "fp32": 4}          # elements in 16 bytes (fp32: tf32 tensor cores)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TILE_M, TILE_N, A100_SMS = 128, 256, 108


@dataclasses.dataclass(frozen=True)
class Violation:
    what: str          # the flag, e.g. "vocab"
    value: int
    rule: str
    suggestions: tuple = ()
    how: str = ""      # extra advice, e.g. "or heads 8, 16"

    def __str__(self) -> str:
        s = f"{self.what} {self.value}: {self.rule}"
        if self.suggestions:
            s += " -> " + " or ".join(str(v) for v in self.suggestions)
        return s + (f" ({self.how})" if self.how else "")


def nearest_multiples(x: int, k: int) -> tuple[int, ...]:
    """The multiples of k just below and just above x (below omitted when it would be 0)."""
    lo, hi = x // k * k, -(-x // k) * k
    return tuple(v for v in dict.fromkeys((lo, hi)) if v > 0)


def nearest_divisors(n: int, x: int, of: int = 1) -> tuple[int, ...]:
    """Divisors d of n that are multiples of `of`, nearest to x: the one below and above."""
    ds = [d for d in range(of, n + 1, of) if n % d == 0]
    lo = [d for d in ds if d <= x]
    hi = [d for d in ds if d >= x]
    return tuple(dict.fromkeys(([lo[-1]] if lo else []) + ([hi[0]] if hi else [])))


def seq_step(micro_batch: int, tp: int = 1, sp: bool = False) -> int:
    """The seq values that break no seq rule are the multiples of this: micro-batch*seq a
    multiple of 64, and with sp seq a multiple of tp."""
    k = 64 // math.gcd(64, micro_batch)
    return math.lcm(k, tp) if sp else k


def check_shape(hidden, heads, vocab, seq, micro_batch, layers, tp=1, pp=1, ffn=None,
                dtype="bf16", sp=False) -> list[Violation]:
    """Every guideline the shape breaks (module docstring), with the nearest good values."""
    ffn = 4 * hidden if ffn is None else ffn
    align = ALIGN[dtype]
    v: list[Violation] = []
    if vocab % 64:
        v.append(Violation("vocab", vocab, "not a multiple of 64", (-(-vocab // 64) * 64,), "pad the embedding"))
    if tp > 1 and vocab % (64 * tp):
        v.append(Violation("vocab", vocab, f"vocab/tp = {vocab / tp:g} is not a multiple of 64",
                           (-(-vocab // (64 * tp)) * 64 * tp,), f"pad to a multiple of 64*tp = {64 * tp}"))
    if hidden % heads:
        v.append(Violation("hidden", hidden, f"not divisible by heads {heads}", nearest_multiples(hidden, heads),
                           "or heads " + " or ".join(map(str, nearest_divisors(hidden, heads)))))
    elif (hidden // heads) % align:
        hd = hidden // heads
        v.append(Violation("hidden", hidden, f"head dim hidden/heads = {hd} is not a multiple of {align} "
                           f"({dtype} tensor cores)", tuple(heads * d for d in nearest_multiples(hd, align)),
                           "head dim " + " or ".join(map(str, nearest_multiples(hd, align)))))
    if hidden % 64:
        v.append(Violation("hidden", hidden, "not a multiple of 64", nearest_multiples(hidden, 64)))
    if tp > 1 and hidden % (64 * tp):
        v.append(Violation("hidden", hidden, f"hidden/tp = {hidden / tp:g} is not a multiple of 64",
                           nearest_multiples(hidden, 64 * tp)))
    if ffn % 64:
        v.append(Violation("ffn", ffn, "not a multiple of 64", nearest_multiples(ffn, 64)))
    if ffn % tp:
        v.append(Violation("ffn", ffn, f"not divisible by tp {tp}", nearest_multiples(ffn, math.lcm(64, tp))))
    if heads % tp:
        v.append(Violation("heads", heads, f"not divisible by tp {tp}", nearest_multiples(heads, tp),
                           "or tp " + " or ".join(map(str, nearest_divisors(heads, tp)))))
    if layers % pp:
        v.append(Violation("layers", layers, f"not divisible by pp {pp}", nearest_multiples(layers, pp)))
    step = seq_step(micro_batch, tp, sp)
    if (micro_batch * seq) % 64:
        v.append(Violation("seq", seq, f"micro-batch*seq = {micro_batch * seq} is not a multiple of 64 (GEMM tiles)",
                           nearest_multiples(seq, step), f"with micro-batch {micro_batch}"
                           + (f"; divisible by tp {tp} for sp" if sp and tp > 1 else "")))
    if sp and seq % tp:
        v.append(Violation("seq", seq, f"not divisible by tp {tp} (sequence parallelism)",
                           nearest_multiples(seq, step), f"multiples of {step}: micro-batch*seq stays "
                           "a multiple of 64"))
    return v


def wave_note(hidden, seq, micro_batch, tp=1, sms=A100_SMS) -> dict:
    """Tile and wave quantisation of the QKV GEMM (module docstring)."""
    m_, n_ = micro_batch * seq, -(-3 * hidden // tp)
    tiles = -(-m_ // TILE_M) * -(-n_ // TILE_N)
    waves = -(-tiles // sms)
    last = tiles - (waves - 1) * sms
    return dict(m=m_, n=n_, k=hidden, tiles=tiles, waves=waves, last_wave_tiles=last,
                wave_efficiency=tiles / (waves * sms),
                tile_efficiency=m_ * n_ / (-(-m_ // TILE_M) * TILE_M * -(-n_ // TILE_N) * TILE_N))


def suggest(hidden, heads, vocab, seq, micro_batch, layers, tp=1, pp=1, ffn=None, dtype="bf16",
            sp=False) -> dict:
    """One shape near the given one that breaks no guideline."""
    def near(x, k):
        lo, hi = x // k * k, -(-x // k) * k
        return hi if lo == 0 or hi - x <= x - lo else lo
    heads2 = heads if heads % tp == 0 else near(heads, tp)
    hidden2 = near(hidden, math.lcm(64 * tp, heads2 * ALIGN[dtype]))
    ffn2 = 4 * hidden2 if ffn is None else near(ffn, math.lcm(64, tp))
    step = seq_step(micro_batch, tp, sp)
    seq2 = seq if (micro_batch * seq) % 64 == 0 and (not sp or seq % tp == 0) else near(seq, step)
    return dict(hidden=hidden2, heads=heads2, vocab=-(-vocab // (64 * tp)) * 64 * tp, seq=seq2,
                micro_batch=micro_batch, layers=near(layers, pp), ffn=ffn2)


def bubble(micro_batches: int, pp: int) -> float:
    """The share of a step a pipeline of pp stages idles with this many micro-batches."""
    return (pp - 1) / (micro_batches + pp - 1)


def plural(n: int, word: str) -> str:
    """'1 micro-batch', '2 micro-batches', '3 waves'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith(('ch', 'sh', 's', 'x')) else 's'}"


def command_line(shape: dict, a: argparse.Namespace, p: argparse.ArgumentParser) -> str:
    """`shape`'s flags, then --tp, --pp, --dp, --dtype and every other flag `a` sets to other
    than its default: pasted back, it analyses the same set-up."""
    out = [f"--{k.replace('_', '-')} {v}" for k, v in shape.items()]
    out += [f"--{k} {getattr(a, k)}" for k in ("tp", "pp", "dp", "dtype")]
    for k in ("micro_batches", "zero", "sms", "sp"):
        v = getattr(a, k)
        if v != p.get_default(k):
            out.append(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}"))
    return " ".join(out)



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshcomm advise", description="Check a transformer's shape against the GPU-efficiency "
                                "guidelines, name the nearest good values, print its communication per iteration.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[5:]))
    for flag in ("--hidden", "--heads", "--vocab", "--seq", "--micro-batch", "--layers"):
        p.add_argument(flag, type=positive, required=True)
    p.add_argument("--tp", type=positive, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=positive, default=1, help="pipeline-parallel degree")
    p.add_argument("--dp", type=positive, default=1, help="data-parallel degree")
    p.add_argument("--ffn", type=positive, default=None, help="MLP width (default 4*hidden)")
    p.add_argument("--dtype", choices=sorted(ALIGN), default="bf16")
    p.add_argument("--micro-batches", type=positive, default=None,
                   help="micro-batches per iteration (default: pp)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--sms", type=positive, default=A100_SMS, help="SMs for the wave note (A100: 108)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    try:
        a = p.parse_args(argv)
    except SystemExit as e:          # --help (0) or a bad argument (2)
        return int(e.code or 0)
    shape = dict(hidden=a.hidden, heads=a.heads, vocab=a.vocab, seq=a.seq, micro_batch=a.micro_batch,
                 layers=a.layers, tp=a.tp, pp=a.pp, ffn=a.ffn, dtype=a.dtype, sp=a.sp)
    violations = check_shape(**shape)
    out = [f"shape: hidden {a.hidden}, heads {a.heads}, ffn {a.ffn or 4 * a.hidden}, vocab {a.vocab}, "
           f"seq {a.seq}, micro-batch {a.micro_batch}, layers {a.layers}; tp {a.tp}, pp {a.pp}, dp {a.dp}, {a.dtype}"]
    if violations:
        out.append(f"\n{plural(len(violations), 'violation')}:")
        out += [f"  {v}" for v in violations]
        s = suggest(**shape)
        gpt = M.Transformer(a.hidden, a.heads, a.layers, a.seq, a.vocab, a.micro_batch, a.ffn)
        good = M.Transformer(s["hidden"], s["heads"], s["layers"], s["seq"], s["vocab"], s["micro_batch"], s["ffn"])
        out.append("suggested: " + command_line(s, a, p)
                   + f"  ({good.params / 1e6:,.1f}M parameters; given {gpt.params / 1e6:,.1f}M)")
    else:
        out.append("\nno violation")
    out.append("\nnotes:")
    if a.hidden % a.heads == 0 and a.hidden // a.heads not in (64, 128):
        out.append(f"  head dim {a.hidden // a.heads}: 64 or 128 run best")
    w = wave_note(a.hidden, a.seq, a.micro_batch, a.tp, a.sms)
    out.append(f"  QKV GEMM ({w['m']} x {w['k']}) by ({w['k']} x {w['n']}): {w['tiles']} tiles of "
               f"{TILE_M}x{TILE_N} on {a.sms} SMs = {plural(w['waves'], 'wave')}, the last {w['last_wave_tiles']}/{a.sms} "
               f"full; wave efficiency {w['wave_efficiency']:.0%}, tile efficiency {w['tile_efficiency']:.0%}")
    try:
        gpt = M.Transformer(a.hidden, a.heads, a.layers, a.seq, a.vocab, a.micro_batch, a.ffn)
        par = M.Parallel(dp=a.dp, tp=a.tp, pp=a.pp, zero=a.zero, sp=a.sp, micro_batches=a.micro_batches or a.pp)
    except ValueError as e:
        print(f"meshcomm advise: {e}", file=sys.stderr)
        return 2
    if par.micro_batches < a.pp:
        out.append(f"  warning: {plural(par.micro_batches, 'micro-batch')} on {a.pp} pipeline stages: the bubble "
                   f"(pp-1)/(m+pp-1) idles {bubble(par.micro_batches, a.pp):.0%} of the step; use --micro-batches "
                   f"{a.pp} or more (several times pp)")
    nbytes = DTYPE_BYTES[a.dtype]
    out.append(f"\ncommunication per iteration of rank 0 ({plural(par.micro_batches, 'micro-batch')}, zero {a.zero}"
               f"{', sp' if a.sp else ''}, {a.dtype}; meshcomm.model):")
    out.append(M.table(M.comm_per_iteration(gpt, par, nbytes, rank=0)))
    if a.pp > 1:
        out.append("\nper pipeline stage (one rank each):")
        for st in range(a.pp):
            t = M.summary(M.comm_per_iteration(gpt, par, nbytes, rank=st * a.dp * a.tp)).total
            out.append(f"  stage {st}: {t.calls} calls, {M.format_bytes(t.bytes)} per rank, "
                       f"{M.format_bytes(t.wire_bytes)} on the wire")
    print("\n".join(out))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())


def add_parser(sub) -> None:
    """`meshcomm advise ...`: the arguments go to this module's own parser."""
    s = sub.add_parser("advise", add_help=False, help="check a transformer's shape for the hardware "
                       "and print its communication per iteration")
    s.set_defaults(func=lambda a: main(a.rest), takes_rest=True)
