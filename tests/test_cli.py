"""The `meshcomm` command line (run as a real subprocess) and the compact layout notation."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import meshcomm as mc
from meshcomm import notation
from strategies import layouts, mesh_shapes, shapes

TIMEOUT = 120


def meshcomm_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "meshcomm"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "meshcomm"]


def run(*args, cmd=None):
    return subprocess.run((cmd or meshcomm_cmd()) + list(args), capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, "PYTHONHASHSEED": "0"})


def test_help():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    assert "usage: meshcomm" in r.stdout and "plan" in r.stdout


def test_no_command_prints_help():
    r = run()
    assert r.returncode == 2
    assert "COMMAND" in r.stdout


def test_plan_help_explains_notation():
    r = run("plan", "--help")
    assert r.returncode == 0, r.stderr
    for word in ("MESH:SPEC", "partial", "--topology", "--draw", "x{3/5}"):
        assert word in r.stdout, word


def test_python_dash_m():
    r = run("--help", cmd=[sys.executable, "-m", "meshcomm"])
    assert r.returncode == 0, r.stderr
    assert "plan" in r.stdout


def test_plan_prints_the_api_plan():
    args = ["plan", "--shape", "1024,1024", "--src", "2x4:x,-", "--dst", "2x4@8:-,x.y",
            "--topology", "p3.8xlarge", "--limit", "0", "--verify"]
    r = run(*args)
    assert r.returncode == 0, r.stderr
    p = mc.plan((1024, 1024), "float32", mc.Layout(mc.Mesh.grid((2, 4)), ("x", None)),
                mc.Layout(mc.Mesh.grid((2, 4), start=8), (None, ("x", "y"))), topology="p3.8xlarge")
    assert p.explain(limit=None) in r.stdout
    assert "verified" in r.stdout
    assert "simulated time on p3.8xlarge" in r.stdout


def test_plan_partial_int32_and_limit():
    r = run("plan", "--shape", "8x6", "--src", "2x2:-,y;partial=x", "--dst", "4@4:x", "--dtype",
            "int32", "--limit", "2")
    assert r.returncode == 0, r.stderr
    assert "P(x)" in r.stdout and "int32" in r.stdout
    assert "more" in r.stdout                     # the table was cut after 2 rows
    assert "reduce" in r.stdout


def test_plan_draw(tmp_path):
    out = tmp_path / "plan.png"
    r = run("plan", "--shape", "64,64", "--src", "4x2:-,y;partial=x", "--dst", "2x4@6:x,-",
            "--topology", "p3.8xlarge", "--draw", str(out))
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize("args,msg", [
    (["--src", "2x2:q", "--dst", "4@4:x"], "unknown mesh axis 'q'"),
    (["--src", "2x2", "--dst", "4@4:x"], "expected MESH:SPEC"),
    (["--src", "2x2:x", "--dst", "4@4:x", "--topology", "p9"], "unknown topology preset 'p9'"),
    (["--src", "2x2:x", "--dst", "4@4:x", "--dtype", "float17"], "unknown dtype 'float17'"),
    (["--src", "2x2:x{1/2}", "--dst", "4@4:x"], "sum to 3"),
    (["--src", "2x2:x,-,-", "--dst", "4@4:x"], "has 3 spec entries but the tensor has 2 dimension(s)"),
    (["--src", "2x2:x", "--dst", "4@4:x", "--limit", "-1"], "--limit must be 0 (all rows) or more"),
])
def test_plan_bad_input(args, msg):
    r = run("plan", "--shape", "8,6", *args)
    assert r.returncode == 2
    assert msg in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,msg", [
    (["bench", "sim", "--topology", "nope"], "unknown topology preset 'nope'"),   # a ValueError traceback
    (["bench", "plan", "--repeats", "0"], "expected a positive integer, got '0'"),  # an AttributeError
    (["bench", "refit", "--layers", "-1"], "expected a positive integer"),        # ran "-1 layers"
    (["demo", "--cases", "nope"], "unknown case(s) ['nope']"),                    # ran nothing, exit 0
    (["demo", "--backends", "nope", "--local"], "unknown backend(s) ['nope']"),
    (["plan", "--shape", "8,6", "--src", "2x2:x", "--dst", "4@4:x", "--draw", "p.foo"], "foo"),
])
def test_commands_refuse_bad_arguments_in_one_line(args, msg):
    r = run(*args)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_verify_takes_a_plan():
    for v in ("x", None):
        with pytest.raises(TypeError, match="verify takes a Plan"):
            mc.verify(v)


def test_plan_draw_into_missing_folder(tmp_path):
    missing = tmp_path / "no" / "such"
    r = run("plan", "--shape", "8,6", "--src", "2x2:x", "--dst", "4@4:x", "--draw", str(missing / "p.png"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]           # one line
    assert str(missing) in r.stderr and "does not exist" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


# the tools' optional dependencies (the `tools` extra) made unimportable in a fresh interpreter
NO_TOOLS = ("import sys; sys.modules['matplotlib'] = sys.modules['tqdm'] = None; "
            "from meshcomm.tools.cli import main; sys.exit(main(sys.argv[1:]))")


def test_commands_without_tqdm_and_matplotlib(tmp_path):
    cmd = [sys.executable, "-c", NO_TOOLS]
    r = run("bench", "sim", "--only", "alpa-1tm-1x2", cmd=cmd)      # progress bar: plain iteration
    assert r.returncode == 0, r.stderr
    assert "alpa-1tm-1x2" in r.stdout and "geomean speedup" in r.stdout
    assert r.stderr == ""
    for args in (["plan", "--shape", "8,6", "--src", "2x2:x", "--dst", "4@4:x", "--draw",
                  str(tmp_path / "p.png")],
                 ["bench", "sim", "--only", "alpa-1tm-1x2", "--plot", str(tmp_path / "s.png")]):
        r = run(*args, cmd=cmd)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr.strip().splitlines() == [r.stderr.strip()]
        assert "matplotlib" in r.stderr and "pip install meshcomm[tools]" in r.stderr
        assert "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())


def test_demo_subcommand_help():
    r = run("demo", "--help")
    assert r.returncode == 0, r.stderr
    for word in ("--procs", "--local", "--backends", "ag+slice"):
        assert word in r.stdout, word


@pytest.mark.parametrize("shape", ["8,six", "8,x", "8,,6", "8,"])
def test_plan_bad_shape(shape):
    r = run("plan", "--shape", shape, "--src", "2x2:x", "--dst", "4@4:x")
    assert r.returncode == 2 and "bad shape" in r.stderr


# -- notation --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,spec,partial,ids,names", [
    ("2x4:x,-,-", ("x", None, None), (), range(8), ("x", "y")),
    ("2x4@8:-,x.y", (None, ("x", "y")), (), range(8, 16), ("x", "y")),
    ("4:x{1/2/3/4}", (mc.Blocks("x", [1, 2, 3, 4]),), (), range(4), ("x",)),
    ("2x2:-,y;partial=x", (None, "y"), ("x",), range(4), ("x", "y")),
    ("2x2(a,b)@3:b.a", (("b", "a"),), (), range(3, 7), ("a", "b")),
    ("2x2x2:z,x.y{1/0/2/5}", ("z", mc.Blocks(("x", "y"), [1, 0, 2, 5])), (), range(8), ("x", "y", "z")),
    ("8:", (), (), range(8), ("x",)),
    ("2x2:-;partial=x.y", (None,), ("x", "y"), range(4), ("x", "y")),
])
def test_parse_examples(text, spec, partial, ids, names):
    lay = notation.parse_layout(text)
    assert lay.mesh.device_ids == tuple(ids) and lay.mesh.axis_names == names
    assert lay == mc.Layout(lay.mesh, spec, partial=partial)
    assert notation.parse_layout(notation.format_layout(lay)) == lay


@pytest.mark.parametrize("text,canonical", [
    ("2x4:x,-,-", "2x4:x"),             # trailing replicated entries mean nothing: dropped
    (" 2x4 @ 8 : - , x.y ", "2x4@8:-,x.y"),
    ("2x4:R,None,x", "2x4:-,-,x"),
    ("2x2:-,y;p=x", "2x2:-,y;partial=x"),
    ("2x2(x,y):x", "2x2:x"),
])
def test_format_is_canonical(text, canonical):
    assert notation.format_layout(notation.parse_layout(text)) == canonical


def test_format_refuses_non_grid_meshes():
    with pytest.raises(ValueError, match="not a consecutive grid"):
        notation.format_layout(mc.Layout(mc.Mesh([3, 1, 2], "x"), ("x",)))


def test_parse_shape():
    assert notation.parse_shape("1024,1024") == (1024, 1024)
    assert notation.parse_shape("2x3x4") == (2, 3, 4)
    assert notation.parse_shape(" 7 ") == (7,)


@settings(max_examples=150)
@given(data=st.data())
def test_notation_round_trip(data):
    mshape = data.draw(mesh_shapes(max_devices=16))
    start = data.draw(st.integers(0, 40))
    custom = data.draw(st.booleans())
    names = ("dp", "tp", "pp")[:len(mshape)] if custom else None
    mesh = mc.Mesh.grid(mshape, names, start=start)
    shape = data.draw(st.integers(1, 3).flatmap(lambda n: shapes(n)))
    lay = data.draw(layouts(mesh, shape))
    text = notation.format_layout(lay)
    back = notation.parse_layout(text)
    assert back == lay, text
    assert notation.format_layout(back) == text
    assert back.index_map(shape) == lay.index_map(shape)
