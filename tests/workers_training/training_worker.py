"""Run under `mpiexec -n 4`: train a small MLP a few steps with torch's own DDP and FSDP2
(gloo) and again with their communication routed through meshcomm
(meshcomm.adapters.torch_training.use_meshcomm), and compare losses and final parameters.

meshcomm.init(backend="mixed") sets up MPI and torch.distributed (gloo); meshcomm's calls are
forced to "mpi" or "torch" per run. Every run starts from the same seeded model and the same
per-rank batches. Checked per run: losses and parameters against torch's own run within
RTOL/ATOL (the sums of 4 float32 addends may be added in another order: a few ulps per step),
that meshcomm issued operations on the backend asked for and none on the other one, and that
torch's default comms are replaced. Then the error paths: a DDP mesh whose group is not DDP's,
an FSDP mesh whose group order differs from the process group's.

argv: steps. Writes rank<r>.json into --out DIR.
"""
import argparse
import faulthandler
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import meshcomm as mc
from meshcomm.adapters.torch_training import (FSDPComms, HookState, MeshcommAllGather,
                                              MeshcommReduceScatter, allreduce_hook, use_meshcomm)
from meshcomm.backends import base

RTOL, ATOL = 1e-5, 1e-6

ap = argparse.ArgumentParser()
ap.add_argument("steps", type=int)
ap.add_argument("--out", required=True)
ap.add_argument("--stacks-after", type=float, default=240,
                help="seconds after which every thread's stack is printed and the process exits")
args = ap.parse_args()
faulthandler.dump_traceback_later(args.stacks_after, exit=True)     # a hang becomes a report

t0 = time.perf_counter()
ctx = mc.init(backend="mixed")
rank, world = dist.get_rank(), dist.get_world_size()
assert (ctx.rank, ctx.world_size, world) == (rank, 4, 4)
torch.set_num_threads(1)
res = {"rank": rank, "t_init": time.perf_counter() - t0}


def model():
    torch.manual_seed(0)     # the same start on every rank and in every run
    # 13 and 7 rows are not multiples of 4: FSDP pads its shards
    return nn.Sequential(nn.Linear(10, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 3))


TEACHER = torch.randn(10, 3, generator=torch.Generator().manual_seed(1)) / 3
g = torch.Generator().manual_seed(100 + rank)       # each rank its own inputs, one target function
DATA = [(x, torch.tanh(x @ TEACHER)) for x in (torch.randn(8, 10, generator=g) for _ in range(args.steps))]


STEP_SECONDS = []        # per train() call: seconds per step


def train(m, params, before_step=None):
    opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
    losses = []
    t = time.perf_counter()
    for x, y in DATA:
        opt.zero_grad()
        if before_step is not None:
            before_step()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    STEP_SECONDS.append((time.perf_counter() - t) / len(DATA))
    return losses


def full_params(m):
    out = []
    for p in m.parameters():
        p = p.detach()
        out.append((p.full_tensor() if hasattr(p, "full_tensor") else p).clone())
    return out


def _backend_of(key):
    """The backend a meshcomm.backends.base.issued key counts for: (backend, primitive) for a
    planned call's steps, ("native_" + backend, op) for a collective run natively."""
    name = str(key[0])
    return name[len("native_"):] if name.startswith("native_") else name


def counts():
    return {k: v for k, v in base.issued.items() if _backend_of(k) in ("mpi", "torch")}


def ops_since(before):
    now = counts()
    return {b: sum(v - before.get(k, 0) for k, v in now.items() if _backend_of(k) == b) for b in ("mpi", "torch")}


def compare(name, ref, got, backend, ops):
    (l0, p0), (l1, p1) = ref, got
    assert np.allclose(l1, l0, rtol=RTOL, atol=ATOL), (name, l0, l1)
    assert len(p0) == len(p1)
    worst = 0.0
    for a, b in zip(p0, p1):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.allclose(b, a, rtol=RTOL, atol=ATOL), (name, (b - a).abs().max().item())
        worst = max(worst, (b - a).abs().max().item())
    other = "torch" if backend == "mpi" else "mpi"
    assert ops[backend] > 0 and ops[other] == 0, (name, backend, ops)
    res[name] = {"loss_diff": float(np.max(np.abs(np.array(l1) - np.array(l0)))), "param_diff": worst,
                 "ops": ops, "loss": l1, "step_s": STEP_SECONDS[-1]}


# -- DDP -------------------------------------------------------------------------------
t = time.perf_counter()
m = DDP(model())
ref = train(m, m.parameters()), full_params(m.module)
res["ddp_torch_step_s"] = STEP_SECONDS[-1]
X = torch.randn(64, 10, generator=torch.Generator().manual_seed(2))      # held out, every rank


def held_out(module):
    with torch.no_grad():
        return nn.functional.mse_loss(module(X), torch.tanh(X @ TEACHER)).item()


res["held_out"] = (held_out(model()), held_out(m.module))
assert res["held_out"][1] < res["held_out"][0], res["held_out"]        # it learns something
HOOK_CALLS = [0]


def counting_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    HOOK_CALLS[0] += 1
    return allreduce_hook(state, bucket)


# ddp_mpi: the hook registered by hand, with about one bucket per parameter (several
# all-reduces in flight at once); ddp_torch_2d: use_meshcomm on a 2-d mesh, one bucket
for name, backend, mesh, axes in (("ddp_mpi", "mpi", None, None),
                                  ("ddp_torch_2d", "torch", mc.Mesh([[0, 1], [2, 3]], ("a", "b")), ("a", "b"))):
    if backend == "mpi":
        m = DDP(model(), bucket_cap_mb=1e-4)
        state = HookState(backend=backend)
        m.register_comm_hook(state, counting_hook)
    else:
        m = DDP(model())
        state = use_meshcomm(m, mesh, axes, backend=backend)
    assert isinstance(state, HookState) and sorted(state.ranks) == [0, 1, 2, 3], state
    before = counts()
    got = train(m, m.parameters()), full_params(m.module)
    compare(name, ref, got, backend, ops_since(before))
res["ddp_mpi"]["hook_calls"] = HOOK_CALLS[0]
res["t_ddp"] = time.perf_counter() - t

# -- FSDP2 -----------------------------------------------------------------------------
t = time.perf_counter()


def sharded(mesh=None):
    m = model()
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


m = sharded()
ref = train(m, m.parameters()), full_params(m)
res["fsdp_torch_step_s"] = STEP_SECONDS[-1]
for name, backend, prefetch in (("fsdp_mpi_prefetch", "mpi", True), ("fsdp_torch", "torch", False)):
    m = sharded()
    comms = use_meshcomm(m, backend=backend)
    assert isinstance(comms, FSDPComms) and len(comms.modules) == 3, comms    # the root owns no parameter
    for fm in comms.modules:
        pg = fm._get_fsdp_state()._fsdp_param_groups[0]
        assert isinstance(pg._all_gather_comm, MeshcommAllGather), pg._all_gather_comm
        assert isinstance(pg._reduce_scatter_comm, MeshcommReduceScatter), pg._reduce_scatter_comm
    layers = [layer for layer in m if isinstance(layer, nn.Linear)]

    def unshard_all(layers=layers):     # explicit async all-gathers: the Work path FSDP waits on
        for layer in layers:
            layer.unshard(async_op=True)
            work = layer._get_fsdp_state()._fsdp_param_groups[0]._all_gather_result.all_gather_work
            assert isinstance(work, dist.Work) and not work.is_completed(), work
    before = counts()
    got = train(m, m.parameters(), unshard_all if prefetch else None), full_params(m)
    compare(name, ref, got, backend, ops_since(before))
# a DeviceMesh whose ranks are not in order: the default mesh follows torch's groups (it was
# built in the DeviceMesh's order, and the first forward raised "torch's process group holds")
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
dm = DeviceMesh("cpu", torch.tensor([2, 0, 3, 1]), mesh_dim_names=("p",))
m = sharded(dm)
ref_p = train(m, m.parameters()), full_params(m)
m = sharded(dm)
use_meshcomm(m, backend="mpi")
before = counts()
compare("fsdp_mpi_permuted", ref_p, (train(m, m.parameters()), full_params(m)), "mpi", ops_since(before))
res["t_fsdp"] = time.perf_counter() - t

# -- errors: a mesh that does not match torch's group ------------------------------------
try:
    use_meshcomm(DDP(model()), mesh=mc.Mesh([[0, 1], [2, 3]], ("a", "b")), axes="b")
    raise AssertionError("a DDP mesh group of 2 ranks was accepted")
except ValueError as e:
    assert "torch's process group holds ranks [0, 1, 2, 3]" in str(e), e
    res["err_ddp"] = str(e)
m = sharded()
use_meshcomm(m, mesh=mc.Mesh([3, 2, 1, 0], "r"))
try:
    m(DATA[0][0])
    raise AssertionError("an FSDP mesh in another rank order was accepted")
except ValueError as e:
    assert "holds ranks [3, 2, 1, 0], but torch's process group holds ranks [0, 1, 2, 3]" in str(e), e
    res["err_fsdp"] = str(e)

res["t_total"] = time.perf_counter() - t0
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump(res, f)
mc.finalize()
if dist.is_initialized():
    dist.destroy_process_group()
