"""`meshcomm plan`: print (and optionally draw) the schedule for one resharding."""
from __future__ import annotations

import argparse
import sys

from meshcomm import notation

from .common import check_output, require

HELP = """\
Print the schedule meshcomm would run to move a SHAPE/DTYPE tensor from layout SRC to DST.

Layout notation  MESH:SPEC[;partial=AXES]
  MESH  2x4 (devices 0..7, axes x,y)   2x4@8 (devices 8..15)   2x4(a,b)@8 (axis names)
  SPEC  one entry per dimension: - (not split)  x  x.y (x major)  x{3/5} (explicit Blocks)
examples
  meshcomm plan --shape 1024,1024 --src "2x4:x,-" --dst "2x4@8:-,x.y" --topology p3.8xlarge
  meshcomm plan --shape 8,6 --src "2x2:-,y;partial=x" --dst "4@4:x" --dtype int32
"""


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="print the transfer schedule for one resharding",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, help="global shape, e.g. 1024,1024")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--src", required=True, help="source layout, e.g. '2x4:x,-'")
    p.add_argument("--dst", required=True, help="destination layout, e.g. '2x4@8:-,x.y'")
    p.add_argument("--topology", default="flat",
                   help="p3.8xlarge | dgx-a100 | dgx-h100 | flat (default flat)")
    p.add_argument("--limit", type=int, default=40, help="rows of the table to print (0: all)")
    p.add_argument("--verify", action="store_true", help="also run the plan verifier")
    p.add_argument("--draw", metavar="FILE.png", help="draw the plan's transfer graph to a PNG")
    p.set_defaults(func=run)


def run(args) -> int:
    import meshcomm as mc
    if args.draw:
        check_output(args.draw, "--draw")
        require("matplotlib", "--draw")
    try:
        shape = notation.parse_shape(args.shape)
        src = notation.parse_layout(args.src, len(shape))
        dst = notation.parse_layout(args.dst, len(shape))
        if args.limit < 0:
            raise ValueError(f"--limit must be 0 (all rows) or more, got {args.limit}")
        p = mc.plan(shape, args.dtype, src, dst, topology=args.topology)
    except (ValueError, TypeError) as e:
        print(f"meshcomm plan: error: {e}", file=sys.stderr)
        return 2
    print(p.explain(limit=args.limit or None))
    print(f"simulated time on {p.topology.name}: {p.simulate() * 1e3:.3f} ms   "
          f"planned in {p.plan_seconds * 1e3:.1f} ms")
    if args.verify:
        mc.verify(p)
        print("verified: every dst element written once from the right source; no deadlock")
    if args.draw:
        from .draw import draw_plan
        draw_plan(p, args.draw)
        print(f"wrote {args.draw}")
    return 0
