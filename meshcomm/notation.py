"""Compact text notation for layouts, used by the CLI, the demo and the benchmarks.

    MESH:SPEC[;partial=AXES]

MESH   ``2x4`` (devices 0..7 row-major, axes x,y), ``2x4@8`` (devices 8..15),
       ``2x4(a,b)@8`` (axis names a,b)
SPEC   one entry per tensor dimension, comma-separated:
       ``-`` not split, ``x`` split over x, ``x.y`` over x then y (x major),
       ``x{3/5}`` explicit Blocks sizes over x
AXES   pending-sum axes joined by ``.``, e.g. ``;partial=x``

Examples: ``2x4:x,-,-``   ``2x4@8:-,x.y``   ``4:x{1/2/3/4}``   ``2x2:-,y;partial=x``
"""
from __future__ import annotations

import re

from .layout import Blocks, Layout
from .mesh import Mesh, default_axis_names

__all__ = ["parse_layout", "format_layout", "parse_shape"]

_MESH = re.compile(r"^\s*(\d+(?:x\d+)*)\s*(?:\(([^)]*)\))?\s*(?:@\s*(\d+))?\s*$")


def parse_shape(text: str) -> tuple[int, ...]:
    parts = re.split(r"[x,]", text.strip())
    if not all(re.fullmatch(r"\s*\d+\s*", t) for t in parts):    # "8,x" and "8,,6" too
        raise ValueError(f"bad shape {text!r}: use e.g. 1024,1024 or 1024x1024")
    return tuple(int(t) for t in parts)


def parse_layout(text: str, ndim: int | None = None) -> Layout:
    """`MESH:SPEC[;partial=AXES]` as a Layout; `ndim`: the tensor's, which the spec may not
    exceed (one entry per dimension)."""
    if ":" not in text:
        raise ValueError(f"bad layout {text!r}: expected MESH:SPEC, e.g. '2x4:x,-'")
    mesh_part, rest = text.split(":", 1)
    m = _MESH.match(mesh_part)
    if not m:
        raise ValueError(f"bad mesh {mesh_part!r}: expected e.g. '2x4', '2x4@8' or '2x4(a,b)@8'")
    dims = tuple(int(d) for d in m.group(1).split("x"))
    names = tuple(a.strip() for a in m.group(2).split(",")) if m.group(2) else default_axis_names(len(dims))
    start = int(m.group(3) or 0)
    mesh = Mesh.grid(dims, names, start=start)
    partial = ()
    if ";" in rest:
        rest, opt = rest.split(";", 1)
        key, _, val = opt.partition("=")
        if key.strip() not in ("partial", "p"):
            raise ValueError(f"bad option {opt!r}: only ';partial=AXES' is known")
        partial = tuple(a for a in val.strip().split(".") if a)
    spec = []
    if rest.strip():
        for entry in rest.split(","):
            entry = entry.strip()
            if entry in ("-", "", "None", "R"):
                spec.append(None)
                continue
            bm = re.match(r"^([\w.]+)\{([\d/\s]+)\}$", entry)
            if bm:
                axes = tuple(bm.group(1).split("."))
                sizes = [int(s) for s in bm.group(2).split("/")]
                spec.append(Blocks(axes if len(axes) > 1 else axes[0], sizes))
                continue
            if not re.match(r"^[\w.]+$", entry):
                raise ValueError(f"bad spec entry {entry!r} in {text!r}")
            axes = tuple(entry.split("."))
            spec.append(axes if len(axes) > 1 else axes[0])
    if ndim is not None and len(spec) > ndim:
        raise ValueError(f"layout {text!r} has {len(spec)} spec entries but the tensor has {ndim} "
                         "dimension(s): one entry per dimension")
    return Layout(mesh, tuple(spec), partial=partial)


def format_layout(layout: Layout) -> str:
    mesh = layout.mesh
    ids = mesh.device_ids
    if ids != tuple(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"mesh {mesh} is not a consecutive grid; the notation cannot express it")
    s = "x".join(map(str, mesh.shape))
    if mesh.axis_names != default_axis_names(mesh.ndim):
        s += "(" + ",".join(mesh.axis_names) + ")"
    if ids[0]:
        s += f"@{ids[0]}"
    entries = []
    for e in layout.spec:
        if e is None:
            entries.append("-")
        elif isinstance(e, Blocks):
            entries.append(".".join(e.axes) + "{" + "/".join(map(str, e.sizes)) + "}")
        else:
            entries.append(".".join(e))
    s += ":" + ",".join(entries)
    if layout.partial:
        s += ";partial=" + ".".join(layout.partial)
    return s
