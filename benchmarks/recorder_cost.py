"""What the flight recorder costs: a 1 KiB all_reduce Program run with the recorder (always on,
meshcomm.runtime.control.RECORDER) against the same runs with a recorder that records nothing,
alternating, median of the rounds' per-call times, ratio in one run.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/recorder_cost.py [--calls 2000] [--rounds 11]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import meshcomm as mc
from meshcomm.runtime import control


class _Off(control.Recorder):
    """Records nothing (the baseline)."""

    def start(self, call):
        return [0, call, "", (), 0.0, None]

    @staticmethod
    def waiting(e, peers):
        pass

    @staticmethod
    def done(e, state="done"):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=11)
    a = ap.parse_args()
    ctx = mc.init(backend="mpi")
    mesh = mc.Mesh(np.arange(ctx.world_size), "x")
    prog = mc.Program.all_reduce(mesh, "x", shape=(256,), dtype="float32")
    x = np.ones(256, np.float32)
    on, off = control.RECORDER, _Off()
    times = {"on": [], "off": []}
    from mpi4py import MPI
    for r in range(a.rounds):
        for name, rec in (("on", on), ("off", off)) if r % 2 else (("off", off), ("on", on)):
            control.RECORDER = rec
            MPI.COMM_WORLD.Barrier()
            t0 = time.perf_counter()
            for _ in range(a.calls):
                prog(x)
            times[name].append((time.perf_counter() - t0) / a.calls)
    control.RECORDER = on
    if ctx.rank == 0:
        m_on, m_off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"1 KiB all_reduce Program, {ctx.world_size} processes, median of {a.rounds} rounds of "
              f"{a.calls} calls: recorder on {m_on * 1e6:.2f} us, off {m_off * 1e6:.2f} us per call, "
              f"on/off {m_on / m_off:.3f}")
    mc.finalize()


if __name__ == "__main__":
    main()
