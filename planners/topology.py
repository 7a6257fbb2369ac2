"""Cluster topology for the planner and cost model: nodes of devices, two link classes."""
from __future__ import annotations

import dataclasses

__all__ = ["Topology", "PRESETS"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Devices grouped into nodes; device d sits on node ``d // devices_per_node``.

    Bandwidths are in gigabits per second, per direction (links are full duplex):
    ``intra_node_gbps`` per device (NVLink-class), ``inter_node_gbps`` per node (its NICs
    together). Latencies are seconds per message.

    NICs (rails): a node has ``nics_per_node`` NICs, each carrying ``inter_node_gbps /
    nics_per_node``; device d uses NIC ``(d % devices_per_node) % nics_per_node`` of its node
    (a rail-optimised fabric: GPU i of every node on rail i). A hop between two nodes loads
    the sender's NIC out and the receiver's NIC in (``nic_of``); traffic is not re-routed
    over NVLink to another GPU's NIC (no PXN). NIC ids are global ints, ``node *
    nics_per_node + rail``, so with one NIC per node (the default) a NIC id is the node id.
    ``devices_per_node`` must be a multiple of ``nics_per_node`` (every rail has as many
    GPUs).
    """

    devices_per_node: int = 1
    intra_node_gbps: float = 800.0
    inter_node_gbps: float = 100.0
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 20e-6
    name: str = "custom"
    nics_per_node: int = 1

    def __post_init__(self):
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(f"devices_per_node must be a positive int, got {self.devices_per_node!r}")
        n = self.nics_per_node
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"nics_per_node must be a positive int, got {n!r}")
        if self.devices_per_node % n:
            raise ValueError(f"nics_per_node {n} must divide devices_per_node {self.devices_per_node} "
                             f"(device d uses NIC (d % devices_per_node) % nics_per_node)")
        for f in ("intra_node_gbps", "inter_node_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)!r}")
        for f in ("intra_node_latency_s", "inter_node_latency_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be non-negative, got {getattr(self, f)!r}")

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def nic_of(self, device: int) -> int:
        """The global id of the NIC `device` sends and receives through (the node id when a
        node has one NIC)."""
        n = self.nics_per_node
        if n == 1:
            return device // self.devices_per_node
        node, local = divmod(device, self.devices_per_node)
        return node * n + local % n

    def node_of_nic(self, nic: int) -> int:
        return nic // self.nics_per_node

    @property
    def nic_bytes_per_s(self) -> float:
        """Bytes per second of one NIC, each direction."""
        return self.inter_bytes_per_s / self.nics_per_node

    @property
    def intra_bytes_per_s(self) -> float:
        return self.intra_node_gbps * 1e9 / 8

    @property
    def inter_bytes_per_s(self) -> float:
        return self.inter_node_gbps * 1e9 / 8

    @classmethod
    def preset(cls, name: str) -> "Topology":
        try:
            return PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown topology preset {name!r}; known: {sorted(PRESETS)}") from None

    @classmethod
    def coerce(cls, topology) -> "Topology":
        if topology is None:
            return PRESETS["flat"]
        if isinstance(topology, str):
            return cls.preset(topology)
        if isinstance(topology, Topology):
            return topology
        raise TypeError(f"topology must be a Topology, a preset name or None, got {type(topology).__name__}")

    def __str__(self) -> str:
        nics = f" ({self.nics_per_node} NICs)" if self.nics_per_node > 1 else ""
        return (f"{self.name}: {self.devices_per_node} dev/node, intra {self.intra_node_gbps:g} Gb/s, "
                f"inter {self.inter_node_gbps:g} Gb/s{nics}")


PRESETS = {
    # AWS p3.8xlarge: 4x V100 (NVLink), 10 Gb/s network; the Alpa resharding benchmark's hardware.
    "p3.8xlarge": Topology(4, intra_node_gbps=8 * 100.0, inter_node_gbps=10.0,
                           intra_node_latency_s=5e-6, inter_node_latency_s=50e-6, name="p3.8xlarge"),
    # DGX A100: 8x A100, NVLink3 ~600 GB/s per GPU, 8x 200 Gb/s HDR per node.
    "dgx-a100": Topology(8, intra_node_gbps=8 * 600.0, inter_node_gbps=8 * 200.0,
                         intra_node_latency_s=3e-6, inter_node_latency_s=10e-6, name="dgx-a100"),
    # DGX H100: 8x H100, NVLink4 ~900 GB/s per GPU, 8x 400 Gb/s NDR per node, one NIC per
    # GPU (rails).
    "dgx-h100": Topology(8, intra_node_gbps=8 * 900.0, inter_node_gbps=8 * 400.0,
                         intra_node_latency_s=3e-6, inter_node_latency_s=8e-6, name="dgx-h100",
                         nics_per_node=8),
    # Every device its own node with one 100 Gb/s link: processes on one host, or a flat fabric.
    "flat": Topology(1, intra_node_gbps=800.0, inter_node_gbps=100.0,
                     intra_node_latency_s=5e-6, inter_node_latency_s=10e-6, name="flat"),
}
