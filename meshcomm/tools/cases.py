"""The benchmark cases every tool shares: Alpa's resharding cases (package data
meshcomm/data/alpa_resharding_cases.json, read through importlib.resources so it works from a
wheel) at full size and scaled to a few local processes, meshcomm's own cases, and the
seeded global tensor each case is checked against.

* `alpa_cases()`, `own_cases()`: full-size cases for `meshcomm bench sim` (p3.8xlarge numbering).
* `scaled_alpa_cases(procs, mib)`, `extra_cases(procs, mib)`: the same on `procs` local
  processes ("nodes" of 2 devices, ~`mib` MiB), for `make demo` and `meshcomm bench run`.
* `run_cases(procs, mib)`: those plus same-mesh cases where DTensor's redistribute applies.
"""
from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources

import numpy as np

from meshcomm.layout import Blocks, Layout
from meshcomm.mesh import Mesh

__all__ = ["Case", "load_alpa", "alpa_spec", "alpa_cases", "own_cases", "all_cases",
           "scaled_alpa_cases", "extra_cases", "run_cases", "global_array"]

XY = ("x", "y")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    src: Layout
    dst: Layout
    dtype: str = "float32"
    group: str = "own"          # "alpa n-to-m" | "alpa 1-to-m" | "alpa" | "own" | "same-mesh"
    note: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def global_array(shape, seed: int, dtype: str = "float32") -> np.ndarray:
    """The seeded global tensor of a case: standard normal floats, or ints in [-1000, 1000)."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
    return rng.integers(-1000, 1000, size=shape, dtype=dtype)


# -- Alpa's cases, full size ------------------------------------------------------------------

def load_alpa() -> dict:
    """The package data: {"n_to_m": [...], "one_to_m": {...}, "topology": ..., "about": ...}."""
    text = resources.files("meshcomm").joinpath("data/alpa_resharding_cases.json").read_text()
    return json.loads(text)


def alpa_spec(entries) -> tuple:
    """A spec from the JSON (lists of axis names become tuples)."""
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


def alpa_cases() -> list[Case]:
    """Alpa's resharding benchmark cases (int32, p3.8xlarge device numbering)."""
    data = load_alpa()
    out = []
    for c in data["n_to_m"]:
        src = Layout(Mesh(c["src_mesh"], XY), alpa_spec(c["src_spec"]))
        dst = Layout(Mesh(c["dst_mesh"], XY), alpa_spec(c["dst_spec"]))
        out.append(Case(f"alpa-n2m-{c['case']}", tuple(c["shape"]), src, dst, "int32", "alpa n-to-m"))
    o = data["one_to_m"]
    src = Layout(Mesh(o["src_mesh"], XY), alpa_spec(o["src_spec"]))
    for dm in o["dst_meshes"]:
        dst = Layout(Mesh(dm, XY), alpa_spec(o["dst_spec"]))
        rows, cols = np.asarray(dm).shape
        out.append(Case(f"alpa-1tm-{rows}x{cols}", tuple(o["shape"]), src, dst, "int32", "alpa 1-to-m"))
    return out


def own_cases() -> list[Case]:
    """meshcomm's own cases on 4-device nodes (device d on node d // 4)."""
    g = Mesh.grid
    m24 = g((2, 4), XY)                       # nodes 0, 1
    m24b = g((2, 4), XY, start=8)             # nodes 2, 3
    m34 = g((3, 4), XY, start=8)              # nodes 2, 3, 4
    m24s = g((2, 4), XY, start=4)             # nodes 1, 2: overlaps m24 on node 1
    xyz = ("x", "y", "z")
    c3a = g((2, 2, 4), xyz)                   # nodes 0..3
    c3b = g((2, 2, 4), xyz, start=16)         # nodes 4..7
    L = Layout

    def case(name, shape, dtype, src, dst, note):
        return Case(name, shape, src, dst, dtype, "own", note)
    return [
        case("uneven-2x4-to-3x4", (1000, 1000, 300), "int32",
             L(m24, ("x", "y")), L(m34, (("x", "y"),)), "torch.chunk splits of 1000 by 4 and 12"),
        case("blocks-2x4-to-2x4", (1000, 1000, 256), "int32",
             L(m24, (Blocks("x", [300, 700]),)), L(m24b, ("x", "y")), "explicit uneven Blocks"),
        case("partial-reduce-2x4-to-2x4", (8192, 8192), "float32",
             L(m24, (None, "y"), partial=("x",)), L(m24b, ("x", "y")), "pending sum over x reduced"),
        case("partial-keep-2x4-to-2x4", (8192, 8192), "float32",
             L(m24, ("y",), partial=("x",)), L(m24b, (None, "y"), partial=("x",)), "pending sum kept"),
        case("mesh3d-2x2x4-to-2x2x4", (1024, 1024, 256), "float32",
             L(c3a, ("x", "z", None)), L(c3b, (("y", "z"), "x", None)), "3-d meshes"),
        case("moe-a2a-cross-2x4-to-2x4", (8, 8192, 2048), "float32",
             L(m24, (None, ("x", "y"), None)), L(m24b, (("x", "y"), None, None)),
             "MoE dispatch: tokens -> experts, two meshes"),
        case("overlap-2x4-to-2x4-shifted", (4096, 4096, 16), "float32",
             L(m24, ("x", "y")), L(m24s, ("y", "x")), "meshes share node 1"),
        case("same-moe-a2a-2x4", (8, 8192, 2048), "float32",
             L(m24, (None, ("x", "y"), None)), L(m24, (("x", "y"), None, None)),
             "MoE dispatch within one mesh (all-to-all)"),
        case("same-transpose-2x4", (8192, 8192), "float32",
             L(m24, ("x", "y")), L(m24, ("y", "x")), "within one mesh"),
        case("same-allgather-2x4", (4096, 8192), "float32",
             L(m24, (("x", "y"),)), L(m24, ()), "FSDP-style all-gather within one mesh"),
        case("same-reduce-scatter-2x4", (8192, 8192), "float32",
             L(m24, (None,), partial=("x", "y")), L(m24, (("x", "y"),)),
             "gradient reduce-scatter within one mesh"),
        case("same-partial-to-replicate-2x4", (4096, 4096), "float32",
             L(m24, ("y",), partial=("x",)), L(m24, ("y",)), "all-reduce over x within one mesh"),
    ]


def all_cases() -> list[Case]:
    return alpa_cases() + own_cases()


# -- scaled to a few local processes -----------------------------------------------------------

def _scale_mesh(devs, start: int, gpus_per_node: int) -> Mesh:
    """Keep the node count, shrink GPUs per node; devices numbered from `start`."""
    arr = np.asarray(devs)
    rows = arr.shape[0] if arr.ndim == 2 else 1
    cols = min(arr.shape[-1], gpus_per_node)
    return Mesh(np.arange(start, start + rows * cols).reshape(rows, cols), XY)


def _scale_shape(shape, target_elems: int, divisors) -> tuple[int, ...]:
    """Scale `shape` down by a common power of two per dimension so that the element count is
    close to target_elems, keeping every dimension divisible by what the layouts split it."""
    shape = list(shape)
    while math.prod(shape) > target_elems:
        i = int(np.argmax(shape))
        if shape[i] % 2 or (shape[i] // 2) % divisors[i]:
            # try the next biggest dimension that can be halved
            order = sorted(range(len(shape)), key=lambda j: -shape[j])
            for j in order:
                if shape[j] % 2 == 0 and (shape[j] // 2) % divisors[j] == 0:
                    i = j
                    break
            else:
                break
        shape[i] //= 2
    return tuple(shape)


def _ways(layout: Layout, dim: int) -> int:
    e = layout.spec[dim] if dim < len(layout.spec) else None
    if e is None:
        return 1
    return math.prod(layout.mesh.axis_size(a) for a in e)


def scaled_alpa_cases(procs: int = 8, mib: float = 16.0) -> list[Case]:
    """Alpa's n-to-m and 1-to-m cases scaled to `procs` devices and ~`mib` MiB float32."""
    data = load_alpa()
    target = int(mib * 2**20 / 4)
    gpn = max(1, procs // 4)              # 2 devices per "node" on 8 processes
    cases = []
    for c in data["n_to_m"]:
        src_m = _scale_mesh(c["src_mesh"], 0, gpn)
        dst_m = _scale_mesh(c["dst_mesh"], src_m.size, gpn)
        if src_m.size + dst_m.size > procs:
            # too many nodes for this machine: shrink the src mesh to one device per node
            src_m = Mesh(np.arange(len(c["src_mesh"])).reshape(-1, 1), XY)
            dst_m = _scale_mesh(c["dst_mesh"], src_m.size, gpn)
            if src_m.size + dst_m.size > procs:
                continue
        src = Layout(src_m, alpa_spec(c["src_spec"]))
        dst = Layout(dst_m, alpa_spec(c["dst_spec"]))
        divs = [math.lcm(_ways(src, d), _ways(dst, d)) for d in range(len(c["shape"]))]
        shape = _scale_shape(c["shape"], target, divs)
        cases.append(Case(f"alpa{c['case']}", shape, src, dst, group="alpa"))
    one = data["one_to_m"]
    for dm in one["dst_meshes"]:
        rows, cols = np.asarray(dm).shape
        if 1 + rows * cols > procs:
            continue
        src = Layout(Mesh([[0]], XY), (None,))
        dst = Layout(Mesh(np.arange(1, 1 + rows * cols).reshape(rows, cols), XY), (None,))
        cases.append(Case(f"1to{rows * cols}" + (f"({rows}x{cols})" if rows > 1 else ""),
                          (target,), src, dst, group="alpa"))
    return cases


def extra_cases(procs: int = 8, mib: float = 16.0) -> list[Case]:
    """Cases outside Alpa's reach: uneven splits, explicit Blocks, a pending sum."""
    if procs < 8:
        return []
    n = int(mib * 2**20 / 4)
    rows = max(7, n // 1000)
    shape = (rows - rows % 2 + 1, 1000)    # odd: uneven 4-way split
    a = Mesh([[0, 1], [2, 3]], XY)
    b = Mesh([[4, 5], [6, 7]], XY)
    c = Mesh([[2, 3, 4, 5]], XY)
    r0 = shape[0]
    return [
        Case("uneven", shape, Layout(a, (("x", "y"), None)), Layout(b, (None, ("y", "x")))),
        Case("blocks", shape, Layout(a, ("x", "y")),
             Layout(c, (Blocks("y", [r0 // 8, r0 // 4, r0 // 2, r0 - r0 // 8 - r0 // 4 - r0 // 2]), None))),
        # int32 so that the random addends of the pending sum add up exactly
        Case("partial", shape, Layout(a, (None, "y"), partial=("x",)), Layout(b, ("x", "y")), "int32"),
    ]


def run_cases(procs: int = 8, mib: float = 16.0) -> list[Case]:
    """Alpa's cases scaled to `procs` processes (as `make demo` scales them), uneven / Blocks
    / partial ones, and same-mesh cases where DTensor's redistribute applies."""
    out = scaled_alpa_cases(procs, mib) + extra_cases(procs, mib)
    if procs >= 8:
        m = Mesh.grid((2, 4), XY)
        elems = int(mib * 2**20 / 4)
        n = max(8, int(math.isqrt(elems)) // 8 * 8)
        t = max(8, elems // (8 * 512) // 8 * 8)
        out += [
            Case("same-transpose", (n, n), Layout(m, ("x", "y")), Layout(m, ("y", "x")),
                 group="same-mesh"),
            Case("same-moe-a2a", (8, t, 512), Layout(m, (None, ("x", "y"), None)),
                 Layout(m, (("x", "y"), None, None)), group="same-mesh"),
            Case("same-allgather", (n // 2, n), Layout(m, (("x", "y"),)), Layout(m, ()),
                 group="same-mesh"),
            Case("same-reduce-scatter", (n, n), Layout(m, (None,), partial=("x", "y")),
                 Layout(m, (("x", "y"),)), "int32", "same-mesh"),
            Case("same-allreduce-x", (n, n), Layout(m, ("y",), partial=("x",)),
                 Layout(m, ("y",)), "int32", "same-mesh"),
            Case("same-replicate-to-shard", (n, n), Layout(m, ()), Layout(m, (("x", "y"),)),
                 group="same-mesh"),        # no data moves: each device slices its own copy
        ]
    return out
