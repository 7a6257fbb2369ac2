"""What the tools share: their optional dependencies (tqdm, matplotlib) imported lazily, with a
plain fallback or a one-line error naming the extra; checks of output paths; geomean.

The library never imports this module (nor tqdm or matplotlib)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os

__all__ = ["UsageError", "EXTRA", "geomean", "progress", "importable", "require", "check_output", "write_json",
           "script_parser"]

EXTRA = "pip install meshcomm[tools]"


def positive(s: str) -> int:
    """An argparse type: an int of at least 1."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


class UsageError(Exception):
    """A command cannot run as asked (a missing optional dependency, an output folder that
    does not exist): the command line prints it as one line and exits with status 2."""


def geomean(xs) -> float:
    """Geometric mean of the positive finite values of `xs` (None and others skipped); nan if none."""
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


class _Plain:
    """Stands in for a tqdm bar when tqdm is not installed: iterates, ignores the rest."""

    def __init__(self, iterable=None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress(iterable=None, **kwargs):
    """A tqdm progress bar over `iterable` (tqdm's keyword arguments), or, without tqdm, the
    plain iterable (and no bar)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Plain(iterable)
    return tqdm(iterable, **kwargs)


def importable(module: str) -> bool:
    """Whether `module` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, what: str, extra: str = "tools") -> None:
    """UsageError naming the extra to install when `module` cannot be imported."""
    if not importable(module):
        hint = EXTRA if extra == "tools" else f"pip install meshcomm[{extra}]"
        raise UsageError(f"{what} needs {module}, which is not installed: {hint}")


def check_output(path, option: str) -> None:
    """UsageError naming the folder when the file `path` (given with `option`) cannot be
    written because its folder does not exist."""
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path}: the folder {folder} does not exist")


def write_json(path, obj, say: bool = True) -> None:
    """Write `obj` to `path` as indented JSON (and print "wrote PATH" when `say`)."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    if say:
        print(f"wrote {path}")


def script_parser(doc: str, reps: int) -> argparse.ArgumentParser:
    """The parser of a benchmarks/ script: its docstring's first line as the description,
    --reps (timed repeats per figure, default `reps`) and --json FILE."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--reps", type=int, default=reps, help=f"timed repeats per figure (default {reps})")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return ap
