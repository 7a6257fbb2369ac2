"""meshcomm.tools.draw.draw_plan writes a readable PNG for small, per-node and degenerate plans."""
from __future__ import annotations

import pytest

import meshcomm as mc
from meshcomm import notation

pytest.importorskip("matplotlib")
from meshcomm.tools.draw import _edges, draw_plan  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plan(shape, src, dst, topology="flat", dtype="float32"):
    return mc.plan(shape, dtype, notation.parse_layout(src), notation.parse_layout(dst), topology=topology)


def _check_png(path, min_bytes=10_000):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > min_bytes
    import matplotlib.image as mpimg
    img = mpimg.imread(path)
    h, w = img.shape[:2]
    assert w >= 800 and h >= 400
    # not a blank canvas: a good share of pixels is not white
    rgb = img[..., :3]
    assert (rgb < 0.9).any(axis=-1).mean() > 0.01


@pytest.mark.parametrize("name,args", [
    ("alpa3", ((1024, 1024, 512), "2x4:-,x,-", "2x4@8:x,-,-", "p3.8xlarge")),
    ("partial_fanout", ((64, 64), "4x2:-,y;partial=x", "2x4@6:x,-", "p3.8xlarge")),
    ("overlap_copies", ((12, 4), "2x3:x.y", "3x2@2:y,x", "p3.8xlarge")),
    ("blocks_flat", ((10, 4), "4:x{1/0/6/3}", "2x2@4:y,x", "flat")),
])
def test_draw_writes_png(tmp_path, name, args):
    p = _plan(*args)
    out = tmp_path / f"{name}.png"
    assert draw_plan(p, out) == out
    _check_png(out)


def test_draw_per_node_for_big_meshes(tmp_path):
    p = _plan((512, 512), "8x16:x,y", "16x8@64:y,x", "dgx-a100")
    out = tmp_path / "big.png"
    draw_plan(p, out, max_devices=64)
    _check_png(out)


def test_draw_empty_plan(tmp_path):
    p = _plan((0, 4), "2x2:x,y", "4@1:x")
    assert not [t for t in p.transfers if t.kind != "copy"]
    out = tmp_path / "empty.png"
    draw_plan(p, out)
    _check_png(out, min_bytes=5_000)


def test_edges_follow_routes():
    """A chain broadcast is drawn hop by hop: one arrow into the first receiver, then arcs
    among the dst devices; the bytes per hop are the transfer's bytes."""
    p = _plan((1024, 1024, 512), "2x4:-,x,-", "2x4@8:x,-,-", "p3.8xlarge", dtype="int32")
    edges = _edges(p)
    hops = sum(len(t.hops) for t in p.transfers if t.kind != "copy")
    assert len(edges) == hops + sum(1 for t in p.transfers if t.kind == "copy")
    for t in p.transfers:
        if t.kind == "bcast":
            first = [e for e in edges if e[1] == t.srcs[0] and e[2] == t.dsts[0]]
            assert first and first[0][4:] == ("src", "dst")
    sides = {(e[4], e[5]) for e in edges}
    assert ("dst", "dst") in sides          # forwarding arcs inside the dst nodes
    assert sum(e[3] for e in edges) == p.bytes_moved + p.bytes_copied


def test_levels_group_nodes_for_huge_meshes(tmp_path):
    from meshcomm.tools.draw import _levels
    small = _plan((8, 8), "2x4:x,y", "2x4@8:y,x", "p3.8xlarge")
    assert _levels(small, 96, 48)[0] == 0                 # one marker per device
    mid = _plan((256, 256), "8x16:x,y", "16x8@64:y,x", "dgx-a100")
    g, key = _levels(mid, 96, 48)
    assert g == 1 and key(70) == 8                        # one marker per node
    flat = _plan((256, 256), "8x16:x,y", "16x8@64:y,x", "flat")
    g, key = _levels(flat, 96, 48)
    assert g == 4 and key(70) == 17                       # groups of 4 one-device nodes
    out = tmp_path / "flat128.png"
    draw_plan(flat, out)
    _check_png(out)
