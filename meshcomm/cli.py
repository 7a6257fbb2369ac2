"""The `meshcomm` command line. Each subcommand lives in its own module and registers
itself through `add_parser(subparsers)`; this file only wires them together."""
from __future__ import annotations

import argparse
import importlib
import sys

# module -> subcommand it provides
SUBCOMMANDS = [
    "meshcomm.cli_plan",      # meshcomm plan
    "meshcomm.tune",          # meshcomm tune
    "meshcomm.bench",         # meshcomm bench {sim,run,plan}
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
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
