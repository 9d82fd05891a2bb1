"""Accelerator figures the simulator's cost formulas read.

All bandwidths are bytes per second and all compute rates FLOP per second, per GPU. A preset
holds public datasheet figures; a scenario can override any field (see `HardwareChoice` in
`gcore_rl.sim.scenario`).

Sources (vendor datasheets and product pages; the figures are the dense, i.e. non-sparse, ones):

- A100-SXM4-80GB: NVIDIA A100 Tensor Core GPU datasheet (312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e,
  80 GB, NVLink 600 GB/s, PCIe Gen4 x16 = 32 GB/s nominal per direction).
- H100-SXM5-80GB: NVIDIA H100 Tensor Core GPU datasheet (989 TFLOP/s BF16 dense, 3.35 TB/s HBM3,
  80 GB, NVLink 900 GB/s, PCIe Gen5 x16 = 64 GB/s nominal per direction).
- H200-SXM-141GB: NVIDIA H200 Tensor Core GPU product page / datasheet (989 TFLOP/s BF16 dense,
  4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s, PCIe Gen5).
- H20 (96 GB): NVIDIA's China-market Hopper part; NVIDIA publishes no English datasheet, the figures
  (148 TFLOP/s BF16 dense, 4.0 TB/s HBM3, 96 GB, NVLink 900 GB/s, PCIe Gen5) are those of the
  OEM spec sheets and press coverage of its launch.

The datasheets' NVLink figures (600 / 900 GB/s) add both directions; a GPU receiving gathered
weights gets one direction, so the presets use half (300 / 450 GB/s).
Effective host-link figures are about 75-80 % of the PCIe nominal rate (pinned-memory copies):
~25 GB/s on Gen4, ~50 GB/s on Gen5. The inter-node network is one 400 Gb/s NIC per GPU
(InfiniBand NDR / 400 GbE, the usual HGX layout) = 50 GB/s per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from gcore_rl.errors import ConfigError

GB = 1e9
TB = 1e12
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One GPU model and the links around it.

    Attributes:
        name: label shown in reports.
        peak_flops: dense bf16 tensor-core FLOP/s of one GPU.
        hbm_bandwidth: device memory bandwidth of one GPU, B/s.
        memory_bytes: device memory of one GPU, bytes.
        host_link_bandwidth: effective host <-> device bandwidth of one GPU (PCIe), B/s; engines
            offload to and reload from host memory over it.
        interconnect_bandwidth: intra-node GPU <-> GPU bandwidth of one GPU (NVLink), B/s.
        network_bandwidth: inter-node bandwidth of one GPU (its NIC), B/s.
        gpus_per_node: GPUs that share one NVLink domain.
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float
    host_link_bandwidth: float
    interconnect_bandwidth: float
    network_bandwidth: float
    gpus_per_node: int = 8

    def link_bandwidth(self, devices: int) -> float:
        """Per-GPU bandwidth of a collective over `devices` GPUs: NVLink inside a node, else the NIC."""
        return self.interconnect_bandwidth if devices <= self.gpus_per_node else self.network_bandwidth

    def with_overrides(self, **overrides: float | int | str | None) -> Hardware:
        """A copy with the given fields replaced (None values are ignored)."""
        names = {f.name for f in fields(self)}
        changes = {}
        for key, value in overrides.items():
            if key not in names:
                raise ConfigError(key, f"not a hardware field; fields are {', '.join(sorted(names))}")
            if value is not None:
                changes[key] = value
        return replace(self, **changes)


_NETWORK_400G = 50 * GB

HARDWARE: dict[str, Hardware] = {
    "A100": Hardware("A100-SXM4-80GB", peak_flops=312 * TFLOPS, hbm_bandwidth=2.039 * TB, memory_bytes=80 * GB,
                     host_link_bandwidth=25 * GB, interconnect_bandwidth=300 * GB, network_bandwidth=_NETWORK_400G),
    "H100": Hardware("H100-SXM5-80GB", peak_flops=989 * TFLOPS, hbm_bandwidth=3.35 * TB, memory_bytes=80 * GB,
                     host_link_bandwidth=50 * GB, interconnect_bandwidth=450 * GB, network_bandwidth=_NETWORK_400G),
    "H200": Hardware("H200-SXM-141GB", peak_flops=989 * TFLOPS, hbm_bandwidth=4.8 * TB, memory_bytes=141 * GB,
                     host_link_bandwidth=50 * GB, interconnect_bandwidth=450 * GB, network_bandwidth=_NETWORK_400G),
    # This project's CPU machines (2 cores): peak = the measured 2048x2048 fp32 matmul rate (BENCHMARKS.md,
    # roofline); memory bandwidth and copies are typical DDR4 figures for 2 cores; "interconnect" is gloo over
    # loopback. Used to calibrate against the CPU recipes, where fixed per-step overheads dominate.
    "cpu": Hardware("CPU-2core", peak_flops=0.15 * TFLOPS, hbm_bandwidth=10 * GB, memory_bytes=24 * GB,
                    host_link_bandwidth=5 * GB, interconnect_bandwidth=2 * GB, network_bandwidth=2 * GB, gpus_per_node=2),
    "H20": Hardware("H20-96GB", peak_flops=148 * TFLOPS, hbm_bandwidth=4.0 * TB, memory_bytes=96 * GB,
                    host_link_bandwidth=50 * GB, interconnect_bandwidth=450 * GB, network_bandwidth=_NETWORK_400G),
}
"""Presets by short name (see the module docstring for sources)."""


def hardware_preset(name: str) -> Hardware:
    """The preset called `name` (raises `ConfigError("preset", ...)` for an unknown name)."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise ConfigError("preset", f"unknown hardware {name!r}; presets are {', '.join(HARDWARE)}") from None
