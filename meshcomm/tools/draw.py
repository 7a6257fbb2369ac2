"""Draw a plan as a picture: src devices on the left, dst devices on the right, grouped by
node, one arrow per hop of every transfer's route (a chain broadcast or reduction shows
as arcs along its chain), so arrows show what each link carries.

    from meshcomm.tools.draw import draw_plan
    draw_plan(mc.plan(shape, dtype, src, dst, topology="p3.8xlarge"), "plan.png")

or ``meshcomm plan ... --draw plan.png``. Colour shows the kind of transfer (send, bcast,
reduce, copy), line width the bytes. Hops between two dst tiles (chain forwarding, fan-out
after a reduction) are arcs on the right side; hops between src devices (a reduction chain)
arcs on the left. Plans with more than
``max_devices`` devices on a side are drawn per node or per group of nodes (edges summed).
Needs matplotlib (the ``tools`` extra).
"""
from __future__ import annotations

from collections import defaultdict

from meshcomm.planners.schedule import fmt_bytes

from .common import require

__all__ = ["draw_plan", "KIND_COLORS"]

KIND_COLORS = {"send": "#1f77b4", "bcast": "#ff7f0e", "reduce": "#2ca02c", "copy": "#7f7f7f"}
_SIDE_X = {"src": 0.0, "dst": 1.0}


def _edges(plan):
    """(kind, sender, receiver, nbytes, sender side, receiver side) for every hop to draw.

    Hops follow each transfer's route, so the picture shows the bytes each link carries: a
    chain broadcast r -> d1 -> d2 is one arrow into d1 and forwarding arcs among the dst
    devices; a chain reduction a1 -> a2 -> r has arcs among the src devices and one arrow
    into r.
    """
    out = []
    for t in plan.transfers:
        first = "dst" if t.src_buf == "dst" else "src"
        if t.kind == "copy":
            out.append(("copy", t.srcs[0], t.dsts[0], t.nbytes, first, "dst"))
            continue
        route = t.route
        if t.kind == "reduce":
            # contributors pass partial sums along; the last hop lands in r's dst tile
            hops = list(zip(route[:-1], route[1:]))
            for i, (u, v) in enumerate(hops):
                last = i == len(hops) - 1
                out.append(("reduce", u, v, t.nbytes, first, "dst" if last else first))
        else:
            for i, (u, v) in enumerate(zip(route[:-1], route[1:])):
                out.append((t.kind, u, v, t.nbytes, first if i == 0 else "dst", "dst"))
    return out


def _positions(devices, node_of, gap=0.8):
    """y position per device (top to bottom), grouped by node, and each node's span."""
    ys, spans = {}, {}
    y = 0.0
    by_node = defaultdict(list)
    for d in sorted(devices):
        by_node[node_of(d)].append(d)
    for node in sorted(by_node):
        top = y
        for d in by_node[node]:
            ys[d] = y
            y -= 1.0
        spans[node] = (top, y + 1.0)
        y -= gap
    return ys, spans


def _levels(plan, max_devices: int, max_groups: int):
    """How to draw: one marker per device, or per group of g nodes (g a power of two)."""
    topo = plan.topology
    src, dst = plan.src.mesh.device_ids, plan.dst.mesh.device_ids
    if max(len(src), len(dst)) <= max_devices:
        return 0, (lambda d: d)
    nodes = max(len({topo.node_of(d) for d in src}), len({topo.node_of(d) for d in dst}))
    g = 1
    while -(-nodes // g) > max_groups:
        g *= 2
    return g, (lambda d: topo.node_of(d) // g)


def draw_plan(plan, path, *, max_devices: int = 96, max_groups: int = 48, title: str | None = None,
              dpi: int = 120):
    """Write a PNG (or any format matplotlib knows from the suffix) of `plan` to `path`.

    Up to `max_devices` devices per side each get a marker; beyond that markers stand for
    nodes (or groups of 2, 4, ... nodes, at most `max_groups` per side) and edges are summed.
    Without matplotlib it raises meshcomm.tools.common.UsageError naming the extra to install.
    """
    require("matplotlib", "drawing a plan")
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    topo = plan.topology
    g, key = _levels(plan, max_devices, max_groups)
    per_node = g > 0
    if per_node:
        group = lambda k: k // 8                                           # noqa: E731
        item_name = (lambda k: f"n{k}") if g == 1 else (lambda k: f"n{k * g}-{k * g + g - 1}")  # noqa: E731
        group_name = lambda b: f"nodes {b * 8 * g}-{(b + 1) * 8 * g - 1}"  # noqa: E731
    else:
        group = topo.node_of
        item_name = str
        group_name = lambda b: f"node {b}"                                 # noqa: E731
    boxes = per_node or topo.devices_per_node > 1     # one device per node: no node boxes

    sides = {"src": sorted({key(d) for d in plan.src.mesh.device_ids}),
             "dst": sorted({key(d) for d in plan.dst.mesh.device_ids})}
    pos, spans = {}, {}
    for side, items in sides.items():
        pos[side], spans[side] = _positions(items, group if boxes else (lambda d: 0),
                                            gap=0.8 if not per_node else 0.4)

    # hops, summed per (kind, sender, receiver, sides) when markers stand for nodes
    agg = defaultdict(int)
    for kind, u, v, nb, su, sv in _edges(plan):
        ku, kv = key(u), key(v)
        if per_node and su == sv and ku == kv:
            continue                      # forwarding inside one marker: not drawn
        agg[(kind, ku, kv, su, sv)] += nb
    max_nb = max(agg.values(), default=1) or 1

    rows = max(len(sides["src"]) + 0.8 * len(spans["src"]), len(sides["dst"]) + 0.8 * len(spans["dst"]))
    height = min(max(4.5, 0.32 * rows + 2.2), 40)
    fig = Figure(figsize=(11, height), dpi=dpi)
    ax = fig.add_axes((0.02, 0.02, 0.96, 0.86 if height < 8 else 1 - 1.5 / height))
    ax.set_axis_off()

    # node boxes and markers
    for side, x in _SIDE_X.items():
        label_x = x - 0.13 if side == "src" else x + 0.13
        for b, (top, bottom) in (spans[side].items() if boxes else ()):
            ax.add_patch(FancyBboxPatch((x - 0.05, bottom - 0.42), 0.1, top - bottom + 0.84,
                                        boxstyle="round,pad=0.01,rounding_size=0.02",
                                        fc="#f3f3f3", ec="#9a9a9a", lw=0.8, zorder=1))
            ax.text(label_x, (top + bottom) / 2, group_name(b), ha="right" if side == "src" else "left",
                    va="center", fontsize=9, color="#555555")
        for item, y in pos[side].items():
            name = item_name(item)
            ax.text(x, y, name, ha="center", va="center", zorder=4,
                    fontsize=7.5 if len(name) <= 3 else 6.5,
                    bbox=dict(boxstyle="circle,pad=0.25" if len(name) <= 3 else "round,pad=0.25",
                              fc="white", ec="#333333", lw=1.0))
        head = "src" if side == "src" else "dst"
        mesh = plan.src.mesh if side == "src" else plan.dst.mesh
        top = max(pos[side].values(), default=0)
        ax.text(x, top + 1.1, f"{head}: {mesh}" if len(str(mesh)) < 40 else head, ha="center",
                va="bottom", fontsize=9.5, fontweight="bold")

    # edges: thin ones first so heavy ones stay on top; many straight edges as one collection
    wmax = 4.4 if len(agg) <= 40 else max(1.0, 4.4 * (40 / len(agg)) ** 0.5)
    alpha = 0.75 if len(agg) <= 100 else 0.5 if len(agg) <= 400 else 0.3
    bulk = len(agg) > 400
    segs, seg_w, seg_c = [], [], []
    for (kind, u, v, su, sv), nb in sorted(agg.items(), key=lambda kv: kv[1]):
        width = 0.5 + wmax * nb / max_nb
        color = KIND_COLORS[kind]
        if su == sv:                      # forwarding along a chain on one side: an arc
            dx = 0.012 if su == "dst" else -0.012
            p0, p1 = (_SIDE_X[su] + dx, pos[su][u]), (_SIDE_X[sv] + dx, pos[sv][v])
            bulge = 0.9 if abs(pos[su][u] - pos[sv][v]) <= 1.5 else 0.45
            style = f"arc3,rad={-bulge if (su == 'dst') == (pos[su][u] > pos[sv][v]) else bulge}"
        else:
            p0 = (_SIDE_X[su] + 0.035, pos[su][u])
            p1 = (_SIDE_X[sv] - 0.035, pos[sv][v])
            style = "arc3,rad=0.0"
            if bulk:
                segs.append((p0, p1))
                seg_w.append(width)
                seg_c.append(color)
                continue
        ax.add_patch(FancyArrowPatch(p0, p1, arrowstyle="-|>", mutation_scale=7 + 2 * width,
                                     lw=width, color=color, alpha=alpha, connectionstyle=style,
                                     linestyle="--" if kind == "copy" else "-", zorder=2,
                                     shrinkA=7, shrinkB=7))
    if segs:
        ax.add_collection(LineCollection(segs, linewidths=seg_w, colors=seg_c, alpha=alpha, zorder=2))

    ys = [y for side in pos.values() for y in side.values()] or [0.0]
    ax.set_xlim(-0.35, 1.35)
    ax.set_ylim(min(ys) - 1.0, max(ys) + 2.0)

    counts = plan.counts
    handles = [Line2D([0], [0], color=KIND_COLORS[k], lw=3, ls="--" if k == "copy" else "-",
                      label=f"{k} ({counts.get(k, 0)})") for k in ("send", "bcast", "reduce", "copy")]
    handles.append(Line2D([0], [0], color="black", lw=0.6, label=f"width: bytes (max {fmt_bytes(max_nb)})"))
    ax.legend(handles=handles, loc="lower center", ncol=5, fontsize=8.5, frameon=False,
              bbox_to_anchor=(0.5, -0.02))

    shape = "x".join(map(str, plan.shape)) or "scalar"
    head = title or f"reshard {shape} {plan.dtype}:  {plan.src.spec_str()}" + \
        (f" P({','.join(plan.src.partial)})" if plan.src.partial else "") + \
        f"  ->  {plan.dst.spec_str()}" + (f" P({','.join(plan.dst.partial)})" if plan.dst.partial else "")
    level = "" if not per_node else "; drawn per node" if g == 1 else f"; drawn per {g} nodes"
    sub = (f"{len(plan.transfers)} transfers, {plan.messages} messages, "
           f"{fmt_bytes(plan.bytes_moved)} moved, busiest NIC {fmt_bytes(plan.max_link_bytes(level='nic'))}; "
           f"topology {topo.name} ({topo.devices_per_node} dev/node){level}")
    fig.suptitle(head, fontsize=11.5, fontweight="bold", y=1 - 0.25 / height)
    fig.text(0.5, 1 - 0.62 / height, sub, ha="center", va="top", fontsize=9.5, color="#333333")
    fig.savefig(path, dpi=dpi)
    return path
