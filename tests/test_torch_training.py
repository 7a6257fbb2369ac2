"""Torch training through meshcomm (meshcomm.adapters.torch_training): the DDP communication
hook and FSDP2's custom all-gather / reduce-scatter.

* One `mpiexec -n 4` launch (tests/workers_training/training_worker.py) trains a small MLP
  with torch's own DDP and FSDP2 (gloo), then with use_meshcomm on the mpi and torch
  backends (a 1-d and a 2-d mesh for DDP, one bucket per parameter; FSDP with explicit async
  unshards and without). Losses and final parameters must match torch's runs within rtol
  1e-5, atol 1e-6: the gradient averages are the same sums of 4 float32 addends, but gloo and
  meshcomm may add them in another order, which moves a result by an ulp or so (the
  runs differ by at most 3e-8 here: one ulp of the larger weights), and a few SGD steps
  carry that along without growing it by orders of magnitude. The worker prints every
  thread's stack and exits if it hangs (--stacks-after, below the launch timeout). Mesh groups that are not torch's group are refused, naming both.
* In this process: the mapping of torch's reduce ops and the input checks.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import meshcomm as mc  # noqa: E402
from meshcomm.adapters import torch_training as tt  # noqa: E402

WORKER = Path(__file__).resolve().parent / "workers_training" / "training_worker.py"
RUNS = ("ddp_mpi", "ddp_torch_2d", "fsdp_mpi_prefetch", "fsdp_torch", "fsdp_mpi_permuted")


@pytest.mark.mpi
def test_ddp_and_fsdp2_through_meshcomm_match_torch(tmp_path):
    from test_distributed import MPIEXEC, launch
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    res = launch([MPIEXEC, "-n", "4", sys.executable, str(WORKER), "4"],
                 {"MESHCOMM_TIMEOUT": "60"}, 300, tmp_path / "out")
    assert [r["rank"] for r in res] == [0, 1, 2, 3], res
    for r in res:
        for name in RUNS:
            run = r[name]
            assert len(run["loss"]) == 4 and run["param_diff"] <= 1e-5, (r["rank"], name, run)
            backend = "torch" if "torch" in name else "mpi"
            assert run["ops"][backend] > 0, (r["rank"], name, run["ops"])
        # ddp_mpi: the hook registered by hand on small buckets, several all-reduces per step
        assert r["ddp_mpi"]["hook_calls"] > 4, r["ddp_mpi"]     # 4 steps
        mine = "[0, 1]" if r["rank"] < 2 else "[2, 3]"
        assert f"holds ranks {mine}, but torch's process group holds ranks [0, 1, 2, 3]" in r["err_ddp"], r
        assert "(in this order)" in r["err_fsdp"]
    # every rank trains on its own data: the losses differ between ranks, the parameters do not
    assert len({tuple(r["ddp_mpi"]["loss"]) for r in res}) == 4


def test_reduce_op_names():
    R = dist.ReduceOp
    assert tt.reduce_op_name(R.SUM) == ("sum", None)
    assert tt.reduce_op_name(R.AVG) == ("avg", None)
    assert tt.reduce_op_name(R.PRODUCT) == ("prod", None)
    assert tt.reduce_op_name(R.MIN) == ("min", None)
    assert tt.reduce_op_name(R.MAX) == ("max", None)
    assert tt.reduce_op_name(R.PREMUL_SUM(0.25)) == ("sum", 0.25)
    with pytest.raises(ValueError, match="BAND"):
        tt.reduce_op_name(R.BAND)


def test_input_checks_without_a_launch():
    mesh = mc.Mesh([0, 1, 2, 3], "dp")
    with pytest.raises(TypeError, match="neither DistributedDataParallel nor"):
        tt.use_meshcomm(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        tt.use_meshcomm(object())
    with pytest.raises(TypeError, match="mesh must be a meshcomm.Mesh"):
        tt.MeshcommAllGather([0, 1], "dp")
    with pytest.raises(ValueError, match="'tp' is not an axis of mesh"):
        tt.MeshcommReduceScatter(mesh, "tp")
    with pytest.raises(ValueError, match="unknown compression 'no-such-codec'"):
        tt.MeshcommAllGather(mesh, "dp", compression="no-such-codec")
    with pytest.raises(RuntimeError, match=r"meshcomm.init"):
        tt.HookState()
    assert "dp" in repr(tt.MeshcommAllGather(mesh, "dp", backend="mpi"))
