"""The device catalog: datasheet figures for the accelerators Partita plans for.

Every number is a vendor datasheet figure (dense, i.e. without structured sparsity), with
its source named beside it. They feed the analytic (roofline) cost model when no measured
profile exists; a measured profile (``partita profile``) overrides them.

Memory is what the driver reports as the device's total (nvidia-smi's "Total", in MiB), which is
what an allocator can see — not the datasheet's marketing GB (an "80 GB" H100 shows 81,559 MiB,
a "24 GB" L4 23,034 MiB).

Bandwidths are per GPU and per direction, in GB/s (1e9 bytes/s):
  * ``intra_node_gbps``: what one GPU can push to its peers inside a node (NVLink, or PCIe);
  * ``network_gbps``: the usual inter-node network share of one GPU (e.g. one 400 Gb/s
    InfiniBand NIC per GPU = 50 GB/s). A cluster spec may override both.
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.errors import PartitaError
from partita.units import GiB, MiB

LINKS = ("nvlink", "pcie", "xgmi", "loopback")

# Where the catalog's default prices come from. A snapshot of a moving market: a cluster YAML's
# node group overrides it with ``price_per_gpu_hour`` (what you actually pay).
PRICE_SOURCE = ("on-demand cloud list prices, May 2026: midpoint of the specialty-provider tier in "
                "mercatus-ai.com/blog/cloud-gpu-pricing (A100 80GB $1.10-1.50, H100 SXM5 $2.50-3.50, "
                "H200 SXM5 $3.50-4.50 per GPU-hour)")


@dataclass(frozen=True, kw_only=True)
class DeviceType:
    name: str
    memory_bytes: int
    bf16_tflops: float  # dense tensor-core peak; 0 where the chip has no bf16 (V100: use fp16)
    fp16_tflops: float
    fp32_tflops: float
    hbm_gbps: float
    intra_link: str  # one of LINKS
    intra_node_gbps: float
    network_gbps: float
    gpus_per_node: int  # the usual node size, the default for a short-form cluster
    source: str
    # On-demand price of one device for one hour, US dollars (None: no public figure the catalog
    # cites; give ``price_per_gpu_hour`` in the cluster YAML). See PRICE_SOURCE.
    price_per_gpu_hour: float | None = None
    # The memory the datasheet names the device by, in its marketing GB (80 for an H100, whose
    # driver reports 79.65 GiB): a cluster YAML that writes it means ``memory_bytes``.
    datasheet_gb: float | None = None
    # The board power the datasheet's peaks are specified at (W), and the limit a machine runs it
    # at where that is lower (None: the design power): the time model slows a power-limited
    # Hopper's tensor cores (``search.roofline.sustained_tensor_fraction``).
    tdp_w: float | None = None
    power_limit_w: float | None = None
    # Dense FP8 tensor-core peak (TFLOP/s) where FP8 products are priced (Hopper parts: the share
    # they reach, roofline.FP8_OVER_BF16_SHARE, is an H100's); 0 elsewhere. ``Plan.fp8`` needs it.
    fp8_tflops: float = 0.0

    def memory_from_gib(self, memory_gib: float) -> int:
        """A node group's ``memory_gib`` in bytes. The datasheet's figure (``datasheet_gb``) and a
        figure within 0.1 % of the catalog's (the driver's total, rounded) are the catalog's own,
        so ``memory_gib: 80`` for an H100 is the hardware of the short form ``8xH100``; any other
        figure (a MIG slice, memory held back) is taken as written."""
        if memory_gib == self.datasheet_gb or abs(memory_gib * GiB - self.memory_bytes) <= 1e-3 * self.memory_bytes:
            return self.memory_bytes
        return int(round(memory_gib * GiB))

    def peak_tflops(self, dtype: str) -> float:
        if dtype == "fp8":
            return self.fp8_tflops
        if dtype == "bf16":
            return self.bf16_tflops or self.fp16_tflops
        if dtype == "fp16":
            return self.fp16_tflops
        if dtype == "fp32":
            return self.fp32_tflops
        raise PartitaError(f"unknown dtype {dtype!r}; valid: bf16, fp16, fp32, fp8")

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"


CATALOG: dict[str, DeviceType] = {
    d.name: d
    for d in [
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, BF16 989 TFLOPS dense
        # (1,979 with sparsity), FP8 1,979 dense (3,958 with sparsity), FP32 67 TFLOPS, NVLink 900 GB/s bidirectional, up to 700 W (PCIe:
        # 300-350 W); DGX H100: 8x 400 Gb/s NDR.
        DeviceType(name="H100", memory_bytes=81559 * MiB, bf16_tflops=989, fp16_tflops=989, fp32_tflops=67,
                   hbm_gbps=3350, intra_link="nvlink", intra_node_gbps=450, network_gbps=50, gpus_per_node=8,
                   source="NVIDIA H100 datasheet, SXM5", datasheet_gb=80, price_per_gpu_hour=3.00, tdp_w=700,
                   fp8_tflops=1979),
        # Same datasheet, PCIe card: 80 GB HBM2e, 2.0 TB/s, BF16 756 dense, FP8 1,513 dense, FP32 51; PCIe Gen5 x16 128 GB/s bidir.
        DeviceType(name="H100-PCIe", memory_bytes=81559 * MiB, bf16_tflops=756, fp16_tflops=756, fp32_tflops=51,
                   hbm_gbps=2000, intra_link="pcie", intra_node_gbps=64, network_gbps=25, gpus_per_node=8,
                   source="NVIDIA H100 datasheet, PCIe", datasheet_gb=80, tdp_w=350, fp8_tflops=1513),
        # NVIDIA H200 datasheet (SXM): 141 GB HBM3e (about 139 GiB usable, as this project's H200 reports), 4.8 TB/s, BF16 989 dense, FP8 1,979 dense, FP32 67, NVLink 900 GB/s bidir, up to 700 W.
        DeviceType(name="H200", memory_bytes=int(139 * GiB), bf16_tflops=989, fp16_tflops=989, fp32_tflops=67,
                   hbm_gbps=4800, intra_link="nvlink", intra_node_gbps=450, network_gbps=50, gpus_per_node=8,
                   source="NVIDIA H200 datasheet, SXM", datasheet_gb=141, price_per_gpu_hour=4.00, tdp_w=700,
                   fp8_tflops=1979),
        # NVIDIA A100 datasheet (SXM4 80GB): HBM2e 2,039 GB/s, BF16 312 dense, FP32 19.5,
        # NVLink 600 GB/s bidir; DGX A100: 8x 200 Gb/s HDR.
        DeviceType(name="A100-80GB", memory_bytes=81920 * MiB, bf16_tflops=312, fp16_tflops=312, fp32_tflops=19.5,
                   hbm_gbps=2039, intra_link="nvlink", intra_node_gbps=300, network_gbps=25, gpus_per_node=8,
                   source="NVIDIA A100 datasheet, SXM4 80GB", datasheet_gb=80, price_per_gpu_hour=1.30),
        # Same datasheet, SXM4 40GB: HBM2 1,555 GB/s.
        DeviceType(name="A100-40GB", memory_bytes=40960 * MiB, bf16_tflops=312, fp16_tflops=312, fp32_tflops=19.5,
                   hbm_gbps=1555, intra_link="nvlink", intra_node_gbps=300, network_gbps=25, gpus_per_node=8,
                   source="NVIDIA A100 datasheet, SXM4 40GB", datasheet_gb=40),
        # NVIDIA V100 datasheet (SXM2): 900 GB/s HBM2, FP16 tensor 125 TFLOPS, FP32 15.7, no bf16,
        # NVLink 300 GB/s bidir; DGX-1: 4x 100 Gb/s EDR for 8 GPUs.
        DeviceType(name="V100-16GB", memory_bytes=16160 * MiB, bf16_tflops=0, fp16_tflops=125, fp32_tflops=15.7,
                   hbm_gbps=900, intra_link="nvlink", intra_node_gbps=150, network_gbps=6.25, gpus_per_node=8,
                   source="NVIDIA V100 datasheet, SXM2 16GB", datasheet_gb=16),
        DeviceType(name="V100-32GB", memory_bytes=32510 * MiB, bf16_tflops=0, fp16_tflops=125, fp32_tflops=15.7,
                   hbm_gbps=900, intra_link="nvlink", intra_node_gbps=150, network_gbps=6.25, gpus_per_node=8,
                   source="NVIDIA V100 datasheet, SXM2 32GB", datasheet_gb=32),
        # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 362 dense (733 sparse), FP32 91.6; PCIe Gen4 x16.
        DeviceType(name="L40S", memory_bytes=46068 * MiB, bf16_tflops=362, fp16_tflops=362, fp32_tflops=91.6,
                   hbm_gbps=864, intra_link="pcie", intra_node_gbps=32, network_gbps=12.5, gpus_per_node=8,
                   source="NVIDIA L40S datasheet", datasheet_gb=48),
        # NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, BF16 121 dense (242 sparse), FP32 30.3; PCIe Gen4 x16.
        DeviceType(name="L4", memory_bytes=23034 * MiB, bf16_tflops=121, fp16_tflops=121, fp32_tflops=30.3,
                   hbm_gbps=300, intra_link="pcie", intra_node_gbps=32, network_gbps=6.25, gpus_per_node=8,
                   source="NVIDIA L4 datasheet", datasheet_gb=24),
        # NVIDIA A10 datasheet (A10G is AWS's variant of it): 24 GB GDDR6, 600 GB/s, BF16 125 dense
        # (250 sparse), FP32 31.2; PCIe Gen4 x16.
        DeviceType(name="A10G", memory_bytes=23028 * MiB, bf16_tflops=125, fp16_tflops=125, fp32_tflops=31.2,
                   hbm_gbps=600, intra_link="pcie", intra_node_gbps=32, network_gbps=6.25, gpus_per_node=8,
                   source="NVIDIA A10 datasheet", datasheet_gb=24),
        # AMD Instinct MI300X datasheet: 192 GB HBM3 (eight 24 GiB stacks), 5.3 TB/s, BF16 1,307.4 dense, FP32 163.4;
        # Infinity Fabric links: 7 x 128 GB/s bidir per GPU (64 GB/s per peer per direction, 448 to all peers).
        DeviceType(name="MI300X", memory_bytes=192 * GiB, bf16_tflops=1307.4, fp16_tflops=1307.4, fp32_tflops=163.4,
                   hbm_gbps=5300, intra_link="xgmi", intra_node_gbps=448, network_gbps=50, gpus_per_node=8,
                   source="AMD Instinct MI300X datasheet", datasheet_gb=192),
        # A CPU "device" is one process (rank) on this machine, for tests and laptops, trained with gloo.
        # No datasheet: nominal figures for a couple of modern cores; measure with `partita profile --device cpu`.
        DeviceType(name="cpu", memory_bytes=4 * GiB, bf16_tflops=0.05, fp16_tflops=0.05, fp32_tflops=0.1,
                   # gloo between ranks: ~0.5 GB/s bus bandwidth measured by `partita profile --comm`
                   # on the 2-core development machine (0.14-0.67 GB/s by collective).
                   hbm_gbps=20, intra_link="loopback", intra_node_gbps=0.5, network_gbps=0.5, gpus_per_node=1,
                   source="nominal; measure with partita profile --device cpu"),
    ]
}

# Names people type for the same thing.
ALIASES = {
    "H100-SXM": "H100", "H100-80GB": "H100", "H100-SXM5": "H100", "H200-SXM": "H200",
    "A100-40G": "A100-40GB", "A100-80G": "A100-80GB", "A10": "A10G", "MI300": "MI300X", "CPU": "cpu",
}
# Names that fit more than one catalog entry: refused with the candidates, never guessed (an
# "A100" planned as 80 GB on a 40 GB machine would not fit when it runs).
AMBIGUOUS = {
    "a100": ("A100-40GB", "A100-80GB"), "a100-sxm": ("A100-40GB", "A100-80GB"),
    "a100-sxm4": ("A100-40GB", "A100-80GB"), "v100": ("V100-16GB", "V100-32GB"),
    "v100-sxm2": ("V100-16GB", "V100-32GB"),
}


def get_device(name: str) -> DeviceType:
    """Look up a device type by name (case-insensitive, common aliases accepted). A name that
    fits several entries (``A100``) is refused with the candidates."""
    if name in CATALOG:
        return CATALOG[name]
    if name in ALIASES:
        return CATALOG[ALIASES[name]]
    folded = {k.lower(): v for k, v in CATALOG.items()} | {k.lower(): CATALOG[v] for k, v in ALIASES.items()}
    if isinstance(name, str) and name.lower() in folded:
        return folded[name.lower()]
    if isinstance(name, str) and name.lower() in AMBIGUOUS:
        candidates = AMBIGUOUS[name.lower()]
        raise PartitaError(f"device {name!r} is ambiguous: it could be {' or '.join(candidates)}; "
                           f"write the one the cluster has, e.g. {candidates[-1]}")
    raise PartitaError(f"unknown device {name!r}; {did_you_mean(str(name))} (`partita devices` lists them)")


def did_you_mean(name: str) -> str:
    """Catalog names close to ``name`` (only names the catalog has), or the whole catalog."""
    import difflib

    by_lower = {k.lower(): k for k in CATALOG}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.5)
    if close:
        names = [by_lower[c] for c in close]
        return f"did you mean {' or '.join(names) if len(names) < 3 else ', '.join(names[:-1]) + ' or ' + names[-1]}?"
    return f"valid: {', '.join(CATALOG)}"
