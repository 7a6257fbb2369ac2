"""Run several examples in one process (one launch pays the torch/MPI start-up once).

argv: one or more "NAME ARG ARG ..." strings, e.g. "moe --check --steps 2". Each example
runs as __main__ with those arguments; its exit code is printed as
"RESULT <index> <rank> <code>". Under a launcher every process runs the same list.
"""
import os
import runpy
import sys
import traceback
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def main():
    rank = next((int(os.environ[v]) for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK")
                 if v in os.environ), 0)       # MPICH's, Open MPI's, PMIx's, torchrun's
    for k, spec in enumerate(sys.argv[1:]):
        name, *args = spec.split()
        sys.argv = [str(EXAMPLES / f"{name}.py")] + args
        code = 0
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            code = 2
        print(f"RESULT {k} {rank} {code}", flush=True)
        if code == 2:            # a crashed example may leave peers waiting: stop here
            sys.exit(2)


if __name__ == "__main__":
    main()
