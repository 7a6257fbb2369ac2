"""`meshcomm advise`: the shape guidelines (vocab 50257 -> 50304, heads, head dim, tp and pp
divisibility, GEMM tiles), the wave arithmetic, its exit codes and the printed communication."""
from __future__ import annotations

import subprocess
import sys

import pytest

from meshcomm.tools import advise

GOOD = ["--hidden", "1024", "--heads", "16", "--vocab", "50304", "--seq", "2048", "--micro-batch", "4",
        "--layers", "24", "--tp", "2", "--pp", "2"]


def flags(args: list[str], **over) -> list[str]:
    a = list(args)
    for k, v in over.items():
        flag = "--" + k.replace("_", "-")
        if flag in a:
            a[a.index(flag) + 1] = str(v)
        else:
            a += [flag, str(v)]
    return a


def run(capsys, argv):
    code = advise.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_gpt2_vocab_is_padded_to_50304(capsys):
    code, out, _ = run(capsys, flags(GOOD, vocab=50257, tp=1, pp=1))
    assert code == 1
    assert "vocab 50257: not a multiple of 64 -> 50304" in out
    assert "vocab/tp" not in out                       # tp = 1: one rule
    code, out, _ = run(capsys, flags(GOOD, vocab=50257))       # tp = 2: 50304 = 128 * 393 serves both
    assert "vocab/tp = 25128.5 is not a multiple of 64 -> 50304" in out
    code, out, _ = run(capsys, flags(GOOD, vocab=50304, tp=8, heads=16, hidden=4096))
    assert code == 1 and "vocab/tp = 6288 is not a multiple of 64 -> 50688" in out


def test_good_shape_exits_0_and_prints_the_communication(capsys):
    code, out, _ = run(capsys, GOOD)
    assert code == 0, out
    assert "no violation" in out
    # rank 0 of tp 2, pp 2, 2 micro-batches: 2*12+1 forward all-reduces per micro-batch of 4*2048*1024*2 bytes
    row = next(line for line in out.splitlines() if line.startswith("tp.fwd"))
    assert row.split()[1:5] == ["all_reduce", "2", str(2 * 25), "16"]       # no "via" column: it is the op
    assert "by message size:" in out and ">=16MiB" in out
    assert "stage 0:" in out and "stage 1:" in out
    assert "wave efficiency" in out


@pytest.mark.parametrize("over, expect", [
    (dict(hidden=1000, heads=10, tp=1),
     "hidden 1000: head dim hidden/heads = 100 is not a multiple of 8 (bf16 tensor cores) -> 960 or 1040"),
    (dict(hidden=1024, heads=12, tp=1), "hidden 1024: not divisible by heads 12 -> 1020 or 1032 (or heads 8 or 16)"),
    (dict(hidden=1000, heads=8, tp=1), "hidden 1000: not a multiple of 64 -> 960 or 1024"),
    (dict(hidden=2880, heads=24), "hidden 2880: hidden/tp = 1440 is not a multiple of 64 -> 2816 or 2944"),
    (dict(hidden=1024, heads=16, tp=1, ffn=3000), "ffn 3000: not a multiple of 64 -> 2944 or 3008"),
    (dict(hidden=1024, heads=16, tp=3, ffn=4032, vocab=50304 * 3),
     "heads 16: not divisible by tp 3 -> 15 or 18 (or tp 2 or 4)"),
    (dict(layers=25), "layers 25: not divisible by pp 2 -> 24 or 26"),
    (dict(seq=100, micro_batch=2), "seq 100: micro-batch*seq = 200 is not a multiple of 64 (GEMM tiles) -> 96 or 128"),
])
def test_each_guideline(capsys, over, expect):
    code, out, _ = run(capsys, flags(GOOD, **over))
    assert code == 1
    assert expect in out, out


def test_sequence_parallel_needs_seq_divisible_by_tp(capsys):
    sp = flags(GOOD, hidden=1152, heads=12, seq=1000, micro_batch=1, tp=3, pp=4, vocab=50304 * 3) + ["--sp"]
    code, out, _ = run(capsys, sp)
    assert code == 1
    assert "seq 1000: not divisible by tp 3 (sequence parallelism) -> 960 or 1152" in out
    assert "seq 1000: micro-batch*seq = 1000 is not a multiple of 64 (GEMM tiles) -> 960 or 1152" in out
    assert "1024" not in out.split("suggested:")[0]                  # a multiple of 64, not of 3
    assert " --seq 960 " in out
    code, out, _ = run(capsys, sp[:-1])                               # without --sp seq/tp does not matter
    assert "not divisible by tp" not in out and "-> 960 or 1024" in out
    assert advise.check_shape(1152, 12, 50304 * 3, 960, 1, 24, tp=3, sp=True) == []
    assert [v.what for v in advise.check_shape(1152, 12, 50304 * 3, 1024, 1, 24, tp=3, sp=True)] == ["seq"]


def suggested(out: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith("suggested: "))
    return line[len("suggested: "):].split("  (")[0].split()


@pytest.mark.parametrize("extra", [[], ["--dp", "4", "--dtype", "fp32", "--micro-batches", "8", "--zero", "1",
                                        "--sp", "--sms", "132"]])
def test_the_suggested_line_pasted_back_analyses_the_same_set_up(capsys, extra):
    argv = flags(GOOD, hidden=1000, heads=12, vocab=50257, seq=100, micro_batch=3, layers=25, tp=4, pp=3) + extra
    code, out, _ = run(capsys, argv)
    assert code == 1
    again = suggested(out)
    for flag in ["--tp", "--pp", "--dp", "--dtype"] + [f for f in extra if f.startswith("--")]:
        assert flag in again, flag
    code2, out2, _ = run(capsys, again)
    assert code2 == 0, out2
    tail = out.split("; tp ")[1].splitlines()[0]                      # tp, pp, dp, dtype of the shape line
    assert out2.split("; tp ")[1].splitlines()[0] == tail
    head = next(x for x in out.splitlines() if x.startswith("communication per iteration"))
    assert head in out2                                               # micro-batches, zero, sp, dtype


def test_bubble_warning_and_plurals(capsys):
    code, out, _ = run(capsys, flags(GOOD, micro_batches=1))           # pp 2
    assert "warning: 1 micro-batch on 2 pipeline stages: the bubble (pp-1)/(m+pp-1) idles 50% of the step" in out
    assert "(1 micro-batch, zero 0" in out and "micro-batches," not in out
    code, out, _ = run(capsys, GOOD)                                  # micro-batches = pp by default
    assert "warning" not in out and "(2 micro-batches, zero 0" in out
    code, out, _ = run(capsys, flags(GOOD, layers=25))
    assert "\n1 violation:\n" in out and "(s)" not in out
    assert "= 1 wave," in run(capsys, flags(GOOD, seq=64, micro_batch=1))[1]
    assert [advise.plural(n, w) for n, w in ((1, "micro-batch"), (2, "micro-batch"), (3, "wave"))] \
        == ["1 micro-batch", "2 micro-batches", "3 waves"]


def test_check_shape_and_suggestion_agree():
    shapes = [dict(hidden=1000, heads=12, vocab=50257, seq=100, micro_batch=3, layers=10, tp=8, pp=4, ffn=3000),
              dict(hidden=5120, heads=40, vocab=32000, seq=4096, micro_batch=1, layers=40, tp=4, pp=3),
              dict(hidden=2560, heads=20, vocab=50257, seq=2048, micro_batch=1, layers=32, tp=8, pp=1),
              dict(hidden=1152, heads=12, vocab=50304, seq=1000, micro_batch=1, layers=24, tp=3, pp=1, sp=True),
              dict(hidden=1536, heads=12, vocab=50304, seq=2050, micro_batch=2, layers=24, tp=6, pp=1, sp=True)]
    for s in shapes:
        assert advise.check_shape(**s)
        good = advise.suggest(**s)
        assert advise.check_shape(**{**good, "tp": s["tp"], "pp": s["pp"], "sp": s.get("sp", False)}) == [], good
    assert advise.check_shape(hidden=4096, heads=32, vocab=50304, seq=2048, micro_batch=1, layers=32,
                              tp=8, pp=4) == [v for v in advise.check_shape(
                                  hidden=4096, heads=32, vocab=50304, seq=2048, micro_batch=1, layers=32,
                                  tp=8, pp=4) if v.what == "vocab"]
    assert advise.check_shape(4096, 32, 50304, 2048, 1, 32, dtype="fp32") == []
    assert [v.rule[:8] for v in advise.check_shape(4092, 62, 50304, 2048, 1, 32, ffn=16384, dtype="fp32")] \
        == ["head dim", "not a mu"]                        # 66 is not a multiple of 4 (tf32); 4092 of 64
    assert not [v for v in advise.check_shape(1088, 17, 50304, 2048, 4, 24) if v.what == "hidden"]  # 17 * 64


def test_wave_arithmetic():
    # (2048 x 4096) by (4096 x 12288): 16 * 48 = 768 tiles of 128x256; 108 SMs -> 8 waves, the last 12 tiles
    w = advise.wave_note(hidden=4096, seq=2048, micro_batch=1, tp=1)
    assert (w["tiles"], w["waves"], w["last_wave_tiles"]) == (768, 8, 12)
    assert w["wave_efficiency"] == pytest.approx(768 / 864) and w["tile_efficiency"] == 1
    w = advise.wave_note(hidden=1000, seq=100, micro_batch=1, tp=8, sms=132)
    assert (w["n"], w["tiles"], w["waves"]) == (375, 2, 1)
    assert w["tile_efficiency"] == pytest.approx(100 * 375 / (128 * 512))


@pytest.mark.parametrize("argv", [
    [],                                                              # required flags missing
    flags(GOOD, hidden=-4),
    flags(GOOD, heads="x"),
    flags(GOOD, dtype="fp64"),
    flags(GOOD, zero=5),
    GOOD + ["--bogus"],
])
def test_bad_arguments_exit_2(capsys, argv):
    code, out, err = run(capsys, argv)
    assert code == 2
    assert "meshcomm advise" in err and out == ""


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "meshcomm.tools.advise"] + flags(GOOD, vocab=50257),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "-> 50304" in r.stdout and "communication per iteration" in r.stdout
    r = subprocess.run([sys.executable, "-m", "meshcomm.tools.advise", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--micro-batch" in r.stdout
