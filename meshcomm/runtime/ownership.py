"""Which process owns which device: device d belongs to rank d // devices_per_process."""
from __future__ import annotations

import dataclasses
import os

from ..caches import memo
from ..layout import Layout
from ..mesh import Mesh

__all__ = ["Ownership", "launcher_world_size"]


@dataclasses.dataclass(frozen=True)
class Ownership:
    rank: int
    world_size: int
    devices_per_process: int

    def rank_of(self, device: int) -> int:
        return int(device) // self.devices_per_process

    def owned(self, mesh_or_devices) -> tuple[int, ...]:
        """The devices of a Mesh, Layout or iterable of ids that this process owns."""
        if isinstance(mesh_or_devices, Layout):
            mesh_or_devices = mesh_or_devices.mesh
        if isinstance(mesh_or_devices, Mesh):
            return _owned(mesh_or_devices, self.rank, self.devices_per_process)
        return tuple(d for d in (int(d) for d in mesh_or_devices) if self.rank_of(d) == self.rank)

    def check_mesh(self, mesh: Mesh, what: str = "the") -> None:
        """Every device of `mesh` must have a process."""
        self.check_devices(mesh.device_ids, f"{what} mesh device(s)")

    def check_devices(self, devices, what: str = "device(s)") -> None:
        n = self.world_size * self.devices_per_process
        bad = [d for d in devices if d >= n]
        if bad:
            raise ValueError(f"{what} {bad[:8]} have no process: with {self.world_size} "
                             f"processes and devices_per_process={self.devices_per_process}, device d "
                             f"belongs to rank d // {self.devices_per_process}, so ids must be < {n}")

    def participants(self, *meshes) -> tuple[int, ...]:
        """The processes owning a device of these meshes (sorted ranks); a device without a
        process is a ValueError (the same on every process: no agreement needed)."""
        return _participants(frozenset(meshes), self.world_size, self.devices_per_process)


@memo(maxsize=1024)
def _participants(meshes, world_size: int, dpp: int) -> tuple[int, ...]:
    for m in meshes:
        Ownership(0, world_size, dpp).check_mesh(m)
    return tuple(sorted({d // dpp for m in meshes for d in m.device_ids}))


@memo(maxsize=1024)
def _owned(mesh, rank: int, dpp: int) -> tuple[int, ...]:
    return tuple(d for d in mesh.device_ids if d // dpp == rank)


def launcher_world_size() -> int:
    """How many processes a launcher (mpiexec, torchrun) started with this one (1: none)."""
    for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE"):
        try:
            n = int(os.environ.get(v, "1"))
        except ValueError:
            continue
        if n > 1:
            return n
    return 1
