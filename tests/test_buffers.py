"""The pool of reused host memory for result tiles (backends/buffers.py): a block comes back
only once no array over it is left, results of successive calls never share memory, and
the budget holds."""
from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

import meshcomm as mc
from meshcomm.backends import buffers
from meshcomm.backends.local import aligned_numpy

MB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh_pool():
    buffers.clear()
    yield
    os.environ.pop("MESHCOMM_BUFFER_POOL_MB", None)
    buffers.clear()


def test_a_block_is_reused_once_every_array_over_it_is_gone():
    a = aligned_numpy((MB // 4,), np.float32)
    addr = a.ctypes.data
    assert addr % buffers.ALIGN == 0
    a[:] = 7
    view = a[100:200]                   # a view keeps the block in use
    del a
    gc.collect()
    b = aligned_numpy((MB // 4,), np.float32)
    assert b.ctypes.data != addr, "a block still viewed was handed out again"
    b[:] = 1
    assert (view == 7).all()
    del view, b
    gc.collect()
    before = buffers.stats["reused"]
    c = aligned_numpy((MB // 4,), np.float32, zero=True)
    assert buffers.stats["reused"] == before + 1
    assert not c.any(), "a reused block asked for zeros was not zeroed"


def test_torch_and_numpy_views_keep_the_block():
    a = buffers.empty(MB, np.uint8)
    a[:] = 3
    t = torch.from_numpy(a)
    addr = a.ctypes.data
    del a
    gc.collect()
    b = buffers.empty(MB, np.uint8)
    assert b.ctypes.data != addr
    b[:] = 9
    assert int(t.sum()) == 3 * MB


def test_small_tiles_and_a_zero_budget_bypass_the_pool():
    before = dict(buffers.stats)
    aligned_numpy((100,), np.float32)
    assert buffers.stats["taken"] == before["taken"]
    os.environ["MESHCOMM_BUFFER_POOL_MB"] = "0"
    aligned_numpy((MB,), np.float32)
    assert buffers.stats["taken"] == before["taken"]


def test_the_budget_drops_the_oldest_idle_blocks():
    os.environ["MESHCOMM_BUFFER_POOL_MB"] = "3"
    blocks = [buffers.take(MB, False) for _ in range(5)]
    del blocks
    gc.collect()
    assert buffers.idle_bytes() <= 3 * MB
    assert buffers.stats["dropped"] >= 2


def test_successive_reshards_never_share_result_memory():
    m = mc.Mesh(np.arange(4), ("x",))
    src, dst = mc.Layout(m, ("x",)), mc.Layout(m, (None,))
    xs = [np.full((MB // 2,), k, np.float32) for k in range(4)]
    outs = []
    for x in xs:
        outs.append(mc.reshard(mc.shard(x, src), src, dst))
        gc.collect()
    for k, out in enumerate(outs):          # every result still holds its own values
        for d, v in out.items():
            assert (v == k).all(), f"result {k} device {d} was overwritten"
    del outs
    gc.collect()
    before = buffers.stats["reused"]
    again = mc.reshard(mc.shard(xs[0], src), src, dst)
    assert buffers.stats["reused"] > before, "dropped results' memory was not reused"
    assert all((v == 0).all() for v in again.values())


def test_jax_results_keep_their_memory():
    jax = pytest.importorskip("jax")
    from meshcomm.adapters.jax import reshard_jax, sharding_from_layout
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 JAX CPU devices (XLA_FLAGS in conftest.py)")
    m = mc.Mesh(np.arange(4), ("x",))
    src, dst = mc.Layout(m, ("x",)), mc.Layout(m, (None, "x"))
    shape = (512, 2048)
    outs = []
    for k in range(3):
        x = jax.device_put(np.full(shape, k, np.float32), sharding_from_layout(src, shape))
        outs.append(reshard_jax(x, sharding_from_layout(dst, shape)))
        del x
        gc.collect()
    for k, y in enumerate(outs):
        assert (np.asarray(y) == k).all(), f"JAX result {k} was overwritten"
