"""The `meshcomm` command line. Each subcommand lives in its own module of meshcomm.tools and
registers itself through `add_parser(subparsers)`; this file only wires them together and
turns a UsageError (a missing optional dependency, a missing output folder), or a ValueError
or TypeError naming bad input, into one line on stderr and exit status 2."""
from __future__ import annotations

import argparse
import importlib
import sys

from .common import UsageError

# module -> subcommand it provides
SUBCOMMANDS = [
    "meshcomm.tools.plan",    # meshcomm plan
    "meshcomm.tools.tune",    # meshcomm tune
    "meshcomm.tools.bench",   # meshcomm bench {sim,run,plan}
    "meshcomm.tools.demo",    # meshcomm demo (what `make demo` runs)
    "meshcomm.tools.advise",  # meshcomm advise (transformer shapes for the hardware)
    "meshcomm.tools.log_cmd",  # meshcomm log {summary,trace,compare}
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshcomm",
        description="Plan, run, tune and benchmark cross-mesh resharding of sharded tensors.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `meshcomm COMMAND --help` for each command's options.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for mod in SUBCOMMANDS:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:
                continue
            raise
        m.add_parser(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "takes_rest", False):      # a subcommand with a parser of its own
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, TypeError) as e:
        # meshcomm's own ValueError/TypeError name the bad input (a topology, a file type):
        # one line, as argparse's own errors
        print(f"meshcomm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
