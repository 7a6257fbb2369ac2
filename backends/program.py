"""A rank's part of a plan worked out once: the executor's hot path for host tiles.

`Execution` walks its steps and, per step and per call, works out slices, contiguity, the
backend and the buffers. For a plan whose steps are messages, broadcasts and local copies,
run on one backend that takes host (NumPy) buffers, all of that depends only on the plan,
the rank and the tile shapes, so `rank_program` computes it once (cached) and `run`
replays it: per stage, the receives (straight into the destination tile where the piece is
one contiguous run of it), the broadcasts in plan order, the sends (from a view of the
source tile where the piece is contiguous there, else packed once), then the local copies
(each box copied once, source tile -> destination tile, no staging), then one wait. Same
tags, same order, same bytes as the general path (base.issue_steps); plans with
reductions take the general path.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from meshcomm.planners.boxes import contiguous_in, local_slices

from . import buffers
from .pack import pack, unpack

__all__ = ["RankProgram", "rank_program", "fits", "run"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """The boxes of one transfer inside one tile: `slices` per box, `whole` the single
    slice when the message is one contiguous run of the tile (else None)."""

    out: bool                               # the tile is a dst tile (else a src tile)
    dev: int
    slices: tuple[tuple[slice, ...], ...]
    whole: tuple | None     # ends in Ellipsis: tile[whole] is a view, of a 0-d tile too


@dataclasses.dataclass(frozen=True)
class Stage:
    recvs: tuple        # (peer, tag, nbytes, direct Piece | None, (Piece, ...) to unpack into)
    bcasts: tuple       # (root, ranks, tag, nbytes, src Piece | None (not the root), own dst Pieces,
                        #  direct Piece | None, (Piece, ...) to unpack into), in plan order
    sends: tuple        # (peer, tag, Piece, (Piece, ...) of this rank's own dsts)
    copies: tuple       # (src Piece, (dst Piece, ...)): one box at a time, no staging
    messages: int       # point-to-point steps (recvs and sends)


@dataclasses.dataclass(frozen=True)
class RankProgram:
    stages: tuple[Stage, ...]
    src_shapes: tuple[tuple[int, tuple[int, ...]], ...]    # the src tiles it expects (C order)


def _piece(t, dev, origin, out: bool) -> Piece:
    slices = tuple(local_slices(b, origin) for b in t.boxes)
    # `+ (...,)`: indexing a 0-d tile by () gives a scalar copy, and a receive into that
    # would be lost; by (...,) a view of the tile itself
    whole = slices[0] + (...,) if len(slices) == 1 and contiguous_in(t.boxes[0], origin) else None
    return Piece(out, dev, slices, whole)


def rank_program(plan, steps: tuple, rank: int, devices_per_process: int) -> RankProgram | None:
    """`rank`'s `steps` (base.issue_steps order) of `plan` as a RankProgram, or None when a
    step is anything but a message, a broadcast or a local copy (reductions: the general
    path). Cached by the executor (base._rank_program)."""
    dpp = devices_per_process
    st, dt = plan.src.tiles(plan.shape), plan.dst.tiles(plan.shape)

    def shape_of(box):
        return tuple(b - a for a, b in box)

    def piece(t, dev, out: bool) -> Piece:
        if out:
            return _piece(t, dev, dt.boxes[dev], True)
        buf_out = t.src_buf != "src"
        return _piece(t, dev, (dt.boxes if buf_out else st.boxes)[dev], buf_out)
    stages, cur = [], None
    srcs = {}
    for s in steps:
        t = plan.transfers[s.index]
        if t.kind == "reduce" or s.prim not in ("p2p", "bcast", "local"):
            return None
        if cur is None or s.stage != cur[0]:
            cur = (s.stage, [], [], [], [])       # stage, recvs, bcasts, sends, copies
            stages.append(cur)
        mine = tuple(piece(t, d, True) for d in t.dsts if d // dpp == rank)
        src = None
        if s.prim == "local" or s.root == rank:
            src = piece(t, t.srcs[0], False)
            if not src.out:
                srcs[src.dev] = shape_of(st.boxes[src.dev])
            if s.prim == "local":
                cur[4].append((src, mine))
                continue
            if s.prim == "p2p":
                peer = s.ranks[0] if s.ranks[1] == rank else s.ranks[1]
                cur[3].append((peer, s.index, src, mine))
                continue
        direct = mine[0] if src is None and len(mine) == 1 and mine[0].whole is not None else None
        into = () if direct or src is not None else mine
        if s.prim == "bcast":
            cur[2].append((s.root, s.ranks, s.index, s.nbytes, src, mine if src is not None else (), direct, into))
        else:
            cur[1].append((s.root, s.index, s.nbytes, direct, into))
    return RankProgram(tuple(Stage(tuple(r), tuple(b), tuple(snd), tuple(c), len(r) + len(snd))
                             for _, r, b, snd, c in stages), tuple(sorted(srcs.items())))


def fits(prog: RankProgram, shards: Mapping) -> bool:
    """Whether this call's src tiles are what `prog` was worked out for: NumPy arrays of the
    planned shape in C order (anything else: the general path)."""
    for d, shape in prog.src_shapes:
        v = shards.get(d)
        if type(v) is not np.ndarray or v.shape != shape or not v.flags.c_contiguous:
            return False
    return True


def _bytes(v) -> np.ndarray:
    return v.reshape(-1).view(np.uint8)


def _message(tile, src: Piece) -> np.ndarray:
    """The bytes of `src` in `tile`: a view where it is one contiguous run, else packed."""
    if src.whole is not None:
        return _bytes(tile[src.whole])
    return pack(tile, src.slices).view(np.uint8)


def _copy_into(src_tile, src: Piece, out, dsts) -> None:
    for d in dsts:
        tile = out[d.dev]
        for ssl, dsl in zip(src.slices, d.slices):
            tile[dsl] = src_tile[ssl]


def run(prog: RankProgram, shards, out, backend, tags: tuple, wait, counts):
    """A generator: issues stage 0 and yields (nothing waits before that), then waits for
    each stage with `wait(works)` and issues the next. `out`: this rank's dst tiles (NumPy,
    C order, allocated by the caller); `counts`: base.issued (it counts this run and its
    messages); `tags`: (first tag, span) of the Program's tag space."""
    counts[("rank_program", backend.name)] += 1
    t0, span = tags
    started = False
    for stage in prog.stages:
        works, fins = [], []
        for peer, index, nbytes, direct, into in stage.recvs:
            if direct is not None:
                works.append(backend.irecv(_bytes(out[direct.dev][direct.whole]), peer, t0 + index % span))
                continue
            buf = buffers.empty(nbytes)
            works.append(backend.irecv(buf, peer, t0 + index % span))
            fins.append((buf, into))
        for root, ranks, index, nbytes, src, mine, direct, into in stage.bcasts:
            if src is not None:
                tile = (out if src.out else shards)[src.dev]
                works.append(backend.bcast(_message(tile, src), root, ranks, tag=t0 + index % span))
                if mine:
                    _copy_into(tile, src, out, mine)
            elif direct is not None:
                works.append(backend.bcast(_bytes(out[direct.dev][direct.whole]), root, ranks, tag=t0 + index % span))
            else:
                buf = buffers.empty(nbytes)
                works.append(backend.bcast(buf, root, ranks, tag=t0 + index % span))
                fins.append((buf, into))
        for peer, index, src, mine in stage.sends:
            tile = (out if src.out else shards)[src.dev]
            works.append(backend.isend(_message(tile, src), peer, t0 + index % span))
            if mine:
                _copy_into(tile, src, out, mine)
        for src, dsts in stage.copies:
            _copy_into((out if src.out else shards)[src.dev], src, out, dsts)
        if stage.messages:
            counts[(backend.name, "p2p")] += stage.messages
        if stage.bcasts:
            counts[(backend.name, "bcast")] += len(stage.bcasts)
        if not started:
            started = True
            yield
        wait(works)
        for buf, into in fins:
            for d in into:
                tile = out[d.dev]
                unpack(buf.view(tile.dtype), tile, d.slices)
    if not started:
        yield

