"""The batch executor of a Program's plan (backends/batch.py `Runner`, a batch of one): what it
works out ahead for each rank; a kernel's common run (runtime/tiles.py common_run).

Its results are checked bitwise across real processes in tests/test_distributed.py and the
batch tests; here, what it works out."""
from __future__ import annotations

import numpy as np
import pytest

import meshcomm as mc
from meshcomm import Layout, Mesh
from meshcomm.backends.base import Backend
from meshcomm.backends.batch import Runner
from meshcomm.planners.boxes import contiguous_in, local_slices


def test_contiguous_in_says_what_numpy_says():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        nd = int(rng.integers(1, 5))
        shape = tuple(int(rng.integers(1, 5)) for _ in range(nd))
        origin = tuple((0, n) for n in shape)
        box = []
        for n in shape:
            a = int(rng.integers(0, n))
            box.append((a, int(rng.integers(a + 1, n + 1))))
        tile = np.empty(shape, np.int8)
        view = tile[local_slices(tuple(box), origin)]
        assert contiguous_in(tuple(box), origin) == view.flags.c_contiguous, (shape, box)


def _runner(shape, src, dst, rank, dpp=1, dtype="float32"):
    return Runner([mc.plan(shape, dtype, src, dst)], rank=rank, devices_per_process=dpp, backend=_Host())


class _Host(Backend):
    """A backend the Runner is built for (no communication here): broadcasts point to point."""

    name = "host"

    def bcast_group(self, ranks, device_kind="cpu"):
        return False


def test_all_to_all_is_one_message_per_peer_sent_from_views_received_into_the_tile():
    m = Mesh.grid((2, 4), ("x", "y"))
    src = Layout(m, (None, ("x", "y"), None))
    dst = Layout(m, (("x", "y"), None, None))
    for r in range(8):
        (local, sends, recvs, _, colls), = _runner((8, 64, 2048), src, dst, r).rounds   # one stage, one bucket
        assert set(sends) == set(recvs) == set(range(8)) - {r} and len(local) == 1
        assert not colls
        for peer, (parts, offs, n, _, own) in list(sends.items()) + list(recvs.items()):
            assert not parts and n == 0 and len(own) == 1      # 64 KiB pieces: messages of their own
        # received straight into the dst tile: one contiguous run of it
        assert all(own[0][0][3] is not None for *_, own in recvs.values())
        assert all(own[0][0][4] is not None for *_, own in sends.values())    # sent from a view


def test_small_pieces_coalesce_large_ones_travel_alone_the_same_split_on_both_sides():
    a = Mesh([0, 1], ("x",))
    b = Mesh([2, 3], ("x",))
    big = Runner.__init__.__globals__["OWN_MESSAGE"] // 4           # float32 elements
    src, dst = Layout(a, ("x", None)), Layout(b, (None, "x"))
    for rows, tensors in ((8, 1), (8, 3), (big, 1), (big, 2)):  # pieces of 128 B, of 64 KiB
        plans = [mc.plan((rows, 8), "float32", src, dst)] * tensors
        (_, sends, _, _, _), = Runner(plans, rank=0, devices_per_process=1, backend=_Host()).rounds
        (_, _, recvs, _, _), = Runner(plans, rank=2, devices_per_process=1, backend=_Host()).rounds
        s_parts, s_offs, s_n, _, s_own = sends[2]
        r_parts, r_offs, r_n, _, r_own = recvs[0]
        s_own, r_own = [p for p, _ in s_own], [p for p, _ in r_own]
        assert (s_offs, s_n) == (r_offs, r_n)
        assert [(p[0], p[1]) for p in s_parts] == [(p[0], p[1]) for p in r_parts]
        assert [(p[0], p[1]) for p in s_own] == [(p[0], p[1]) for p in r_own]
        # small pieces of several tensors: one message; a lone or large piece: its own
        assert (len(s_parts), len(s_own)) == ((3, 0) if tensors == 3 else (0, tensors))
        for sp, rp in zip(s_own, r_own):    # rows -> columns: strided in the src tile (packed),
            assert sp[4] is None and rp[3] is not None      # one run of the dst tile


def test_a_sum_across_processes_sends_each_addend_to_the_root_in_src_order():
    m = Mesh.grid((2, 2), ("x", "y"))
    src = Layout(m, (None,), partial=("x",))
    dst = Layout(m, ("y",))
    p = mc.plan((16,), "float32", src, dst)
    sums = [t for t in p.transfers if t.kind == "reduce" and len({d for d in t.srcs}) > 1]
    assert sums
    made = 0
    for r, (_, sends, recvs, mine, _) in [(r, rd) for r in range(4)
                                       for rd in Runner([p], rank=r, devices_per_process=1, backend=_Host()).rounds]:
        made += len(mine)
        for i, t in mine:                                   # the sums this rank makes
            assert r == t.dsts[0]
            got = [part[4] for q in recvs for part in recvs[q][0] + [p for p, _ in recvs[q][4]] if part[1] is t]
            assert got == [d for d in t.srcs if d != r]     # every other addend, in the plan's order
        for q, (parts, _, _, _, own) in sends.items():
            for part in parts + [p for p, _ in own]:
                if part[1].kind == "reduce":
                    assert part[5] == r and part[3] == [] and q == part[1].dsts[0]
    assert made == len(sums)


def test_common_run_takes_exact_host_tiles_only():
    """A kernel's fast check (runtime/program.py common_run, the eager call's test of "the
    same call" too): anything it refuses is checked in full, so it must refuse every tile
    the full check would treat differently."""
    from meshcomm.runtime.tiles import common_run, fit_of
    fit = fit_of("numpy", "cpu", "float32")
    want = {3: (4, 6)}
    t = np.zeros((4, 6), np.float32)
    assert common_run(t, want, fit, True) == ({3: t}, True, "numpy")
    assert common_run({3: t}, want, fit, True)[1:] == (False, "numpy")
    assert common_run(t, want, fit, False) is None                      # owns several dst devices
    assert common_run({2: t}, want, fit, True) is None                  # another device
    assert common_run({3: t, 4: t}, want, fit, True) is None
    assert common_run({3: t.astype(np.float64)}, want, fit, True) is None
    assert common_run({3: t.astype(">f4")}, want, fit, True) is None    # byte-swapped: full check
    assert common_run({3: np.zeros((6, 4), np.float32)}, want, fit, True) is None
    assert common_run(None, want, fit, True) is None and common_run({}, want, fit, True) is None
    assert common_run(None, {}, fit, True) == ({}, False, None) == common_run({}, {}, fit, True)
    assert common_run([t], want, fit, True) is None
    assert fit_of("numpy", "cuda", "float32") == {} and fit_of("jax", "cpu", "float32") == {}
    torch = pytest.importorskip("torch")
    assert common_run({3: torch.zeros(4, 6)}, want, fit, True) is None  # a NumPy Program
    tt = torch.zeros(4, 6)
    for f in (fit_of("torch", "cpu", "float32"), fit_of(None, None, "float32")):
        assert common_run(tt, want, f, True) == ({3: tt}, True, "torch")
        assert common_run({3: tt.double()}, want, f, True) is None
        assert common_run({3: torch.nn.Parameter(tt)}, want, f, True) is None
    assert common_run({3: t}, want, fit_of("torch", "cpu", "float32"), True) is None
    assert common_run({3: t}, want, fit_of(None, None, "float32"), True)[2] == "numpy"


class _Recorder(Backend):
    """An MPI-like backend that records what is posted (no communication): the executor's
    messages through isend/irecv, the lean run's through `comm`."""

    name, wire = "mpi", "numpy"

    def __init__(self):
        self.log, self.comm = [], self

    def bcast_group(self, ranks, device_kind="cpu"):
        return False

    def _post(self, op, buf, peer, tag):
        b = np.asarray(buf).reshape(-1).view(np.uint8)
        self.log.append((op, peer, tag, b.nbytes, b.tobytes() if op == "send" else None))
        if op == "recv":                # arrives at once: bytes that depend on the message's place
            b[...] = np.random.default_rng(len(self.log)).integers(0, 256, b.nbytes, dtype=np.uint8)

        class Done:
            peers, op_ = (peer,), op

            def test(self):
                return True
        return Done()

    def isend(self, buf, peer, tag):
        return self._post("send", buf, peer, tag)

    def irecv(self, buf, peer, tag):
        return self._post("recv", buf, peer, tag)

    def Isend(self, buf, dest, tag):
        return self._post("send", buf, dest, tag)

    def Irecv(self, buf, source, tag):
        return self._post("recv", buf, source, tag)

    def wait_all(self, works, deadline):
        pass


def test_the_lean_run_posts_the_executors_messages_in_its_order():
    """backends/lean.py: a process on the lean run and a peer on the general one (the Runner)
    must match each other's messages, so for every rank of random plans the lean post makes
    the Runner's messages (peer, tag, bytes, payload) in the Runner's order, and its result
    tile holds what the Runner's does, byte for byte, once the same bytes are received."""
    import sys
    from pathlib import Path
    pytest.importorskip("mpi4py")
    from meshcomm.backends.batch import BatchItem
    from meshcomm.backends.base import part
    from meshcomm.backends.lean import lean
    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    from cases import random_case, random_data
    rng = np.random.default_rng(5)
    leaned = 0
    tags = (1 << 18, 1 << 18)           # a Program's (program.tags_of): a run takes a part of them
    for i in range(300):
        seq = i % 130                   # its place in the call sequence: the lean post's tag is the Runner's
        dpp = 1 + i % 2                 # two devices per process: a piece sent and kept, too
        shape, src, dst, dtype, _ = random_case(rng, 4 * dpp)
        if dtype == "bfloat16" or src.is_partial or dst.is_partial:
            continue
        x = random_data(rng, shape, dtype, "numpy")
        shards = mc.shard(x, src)
        p = mc.plan(shape, dtype, src, dst)
        for r in range(4):
            owned = [d for d in src.mesh.device_ids if d // dpp == r]
            general, quick = _Recorder(), _Recorder()
            run = Runner([p], rank=r, devices_per_process=dpp, backend=general)
            specs = run.out_shapes[0]
            if len(owned) > 1 or len(specs) > 1:
                continue
            fns = lean(Runner([p], rank=r, devices_per_process=dpp, backend=quick), owned[0] if owned else None,
                       specs[0] if specs else None, p.fill_op, x.dtype, tags)
            if fns is None:
                continue
            tile = shards[owned[0]] if owned else None
            out = run.run([BatchItem(p, {d: shards[d] for d in owned}, tile if owned else np.empty(0, x.dtype))],
                          part(tags, seq), None)[0][0]
            post, result, _, _ = fns[seq & 1]
            post(tile, seq)
            assert quick.log == general.log, (i, r, src, dst)
            got = result()
            if specs:
                assert got.shape == out[specs[0][0]].shape and got.tobytes() == out[specs[0][0]].tobytes(), (i, r)
            else:
                assert got is None and out == {}
            leaned += 1
    assert leaned > 50
