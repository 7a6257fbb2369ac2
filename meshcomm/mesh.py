"""Device meshes: an n-d array of distinct global device ids with named axes."""
from __future__ import annotations

import functools
import operator
from typing import Any, Iterable, Sequence

import numpy as np

from .caches import memo

__all__ = ["Mesh", "as_int"]


def as_int(v: Any, what: str) -> int:
    """`v` as a Python int when it is an integer (Python, NumPy, a 0-d integer tensor: anything
    with __index__, bools excepted); else TypeError naming `what` and the value. Floats are
    refused even when integral, as torch refuses float sizes: nothing is silently truncated."""
    if not isinstance(v, (bool, np.bool_)):
        try:
            return operator.index(v)
        except TypeError:
            pass
    raise TypeError(f"{what} must be an integer, got {v!r} ({type(v).__name__})")


def _ragged_row(devices, path=()) -> tuple[int, ...]:
    """The shape of nested rows of device ids; ValueError naming the first row whose length
    differs from its first sibling's."""
    if isinstance(devices, (str, bytes)) or not isinstance(devices, (Sequence, np.ndarray)):
        return ()
    shapes = [_ragged_row(row, path + (i,)) for i, row in enumerate(devices)]
    for i, sh in enumerate(shapes):
        if sh != shapes[0]:
            def what(p, s):
                name = "row " + "".join(f"[{k}]" for k in p)
                if not s:
                    return f"{name} is a single id"
                return f"{name} has {s[0]} entr{'y' if s[0] == 1 else 'ies'}" if len(s) == 1 else \
                    f"{name} has shape {s}"
            raise ValueError(f"Mesh devices are ragged: {what(path + (i,), sh)} but "
                             f"{what(path + (0,), shapes[0])}; every row of a mesh has one length")
    return (len(shapes),) + (shapes[0] if shapes else ())


class Mesh:
    """An n-d grid of global device ids with one name per axis.

    >>> m = Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("x", "y"))
    >>> m.shape, m.size
    ((2, 4), 8)

    Meshes are immutable and hashable; two meshes with the same devices and axis names are
    equal. Two different meshes may share devices.
    """

    __slots__ = ("_devices", "_axis_names", "_shape", "_flat", "_hash", "_coords")

    def __init__(self, devices, axis_names: Sequence[str] | str):
        try:
            arr = np.asarray(devices)
        except ValueError:                   # NumPy refuses ragged nested lists
            _ragged_row(devices)
            raise
        if arr.dtype == object:
            _ragged_row(devices)
        if isinstance(axis_names, str):
            axis_names = (axis_names,)
        try:
            axis_names = tuple(axis_names)
        except TypeError:
            raise TypeError(f"Mesh axis names must be a string or a sequence of strings, "
                            f"got {axis_names!r}") from None
        if arr.ndim == 0:
            raise ValueError("Mesh devices must be an array with at least one dimension, "
                             f"got the scalar {devices!r}")
        if arr.size == 0:
            raise ValueError(f"Mesh devices must not be empty (shape {arr.shape})")
        if not np.issubdtype(arr.dtype, np.integer):
            raw = arr if isinstance(devices, np.ndarray) else np.asarray(devices, dtype=object)
            for i, v in enumerate(raw.reshape(-1).tolist()):     # as written, not as coerced
                try:
                    as_int(v, "")
                except TypeError:
                    where = tuple(int(c) for c in np.unravel_index(i, arr.shape))
                    raise TypeError(f"Mesh device ids must be integers, got {v!r} at index {where} "
                                    f"(dtype {arr.dtype})") from None
            arr = arr.astype(np.int64)       # an object array of ints
        if len(axis_names) != arr.ndim:
            raise ValueError(f"Mesh of shape {arr.shape} has {arr.ndim} dimension(s) but "
                             f"{len(axis_names)} axis name(s) {axis_names}")
        for name in axis_names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"Mesh axis names must be non-empty strings, got {name!r}")
        if len(set(axis_names)) != len(axis_names):
            dup = sorted({a for a in axis_names if axis_names.count(a) > 1})
            raise ValueError(f"Mesh axis names must be distinct; {dup} repeated in {axis_names}")
        flat = [int(d) for d in arr.reshape(-1)]
        if min(flat) < 0:
            raise ValueError(f"Mesh device ids must be non-negative, got {min(flat)}")
        if len(set(flat)) != len(flat):
            seen, dups = set(), []
            for d in flat:
                if d in seen:
                    dups.append(d)
                seen.add(d)
            raise ValueError(f"Mesh device ids must be distinct; device {dups[0]} appears "
                             f"more than once in mesh of shape {arr.shape}")
        self._shape = tuple(int(s) for s in arr.shape)
        self._axis_names = axis_names
        self._flat = tuple(flat)
        self._devices = None
        self._coords = None
        self._hash = hash((self._shape, self._axis_names, self._flat))

    # -- constructors ---------------------------------------------------------------
    @classmethod
    def grid(cls, shape: Iterable[int], axis_names: Sequence[str] | None = None,
             start: int = 0) -> "Mesh":
        """A mesh of consecutive device ids ``start, start+1, ...`` in row-major order."""
        shape = tuple(as_int(s, f"Mesh.grid shape dimension {i}") for i, s in enumerate(shape))
        start = as_int(start, "Mesh.grid start")
        if any(s < 0 for s in shape):
            raise ValueError(f"Mesh.grid shape must be non-negative, got {shape}")
        if axis_names is None:
            axis_names = default_axis_names(len(shape))
        n = int(np.prod(shape))
        return cls(np.arange(start, start + n).reshape(shape), axis_names)

    # -- properties -----------------------------------------------------------------
    @property
    def devices(self) -> np.ndarray:
        if self._devices is None:
            d = np.array(self._flat, dtype=np.int64).reshape(self._shape)
            d.setflags(write=False)
            self._devices = d
        return self._devices

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._axis_names

    @property
    def size(self) -> int:
        return len(self._flat)

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def device_ids(self) -> tuple[int, ...]:
        """All device ids, row-major."""
        return self._flat

    def axis_size(self, name: str) -> int:
        return self._shape[self.axis_index(name)]

    def axis_index(self, name: str) -> int:
        try:
            return self._axis_names.index(name)
        except ValueError:
            raise ValueError(f"unknown mesh axis {name!r}; mesh axes are {self._axis_names}") from None

    def coords(self, device: int) -> tuple[int, ...]:
        """Coordinates of a device id in the mesh."""
        if self._coords is None:
            self._coords = {d: tuple(int(c) for c in np.unravel_index(i, self._shape))
                            for i, d in enumerate(self._flat)}
        try:
            return self._coords[device]
        except KeyError:
            raise ValueError(f"device {device} is not in mesh {self}") from None

    def __contains__(self, device) -> bool:
        self.coords(self._flat[0])
        return device in self._coords

    # -- dunder ---------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return (isinstance(other, Mesh) and self._hash == other._hash and
                self._shape == other._shape and self._axis_names == other._axis_names and
                self._flat == other._flat)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (Mesh, (self.devices.tolist(), self._axis_names))

    def __str__(self) -> str:
        dims = "x".join(str(s) for s in self._shape)
        names = ",".join(self._axis_names)
        if self._flat == tuple(range(self._flat[0], self._flat[0] + self.size)):
            where = f"{self._flat[0]}" if self.size == 1 else f"{self._flat[0]}..{self._flat[-1]}"
        else:
            where = ",".join(map(str, self._flat)) if self.size <= 8 else \
                f"{self._flat[0]},{self._flat[1]},...,{self._flat[-1]}"
        return f"{dims}[{names}]@{where}"

    def __repr__(self) -> str:
        return f"Mesh({self.devices.tolist()!r}, {self._axis_names!r})"


@memo(maxsize=None)
def default_axis_names(ndim: int) -> tuple[str, ...]:
    base = ("x", "y", "z", "w", "v", "u")
    if ndim <= len(base):
        return base[:ndim]
    return tuple(f"a{i}" for i in range(ndim))
