"""Where a profile came from: the device as its driver names it, versions, dtype, date, command."""

from __future__ import annotations

import datetime
import platform
import re
import socket
from pathlib import Path

import torch

from partita.devices import CATALOG, get_device
from partita.errors import PartitaError
from partita.profile import Provenance

# Driver names of GPUs -> catalog names, most specific first (an "H100 PCIe" is not an "H100").
_GPU_PATTERNS = (
    (r"H100.*PCIe", "H100-PCIe"), (r"H100", "H100"), (r"H200", "H200"),
    (r"A100.*40\s*GB", "A100-40GB"), (r"A100", "A100-80GB"),
    (r"V100.*16\s*GB", "V100-16GB"), (r"V100", "V100-32GB"),
    (r"L40S", "L40S"), (r"\bL4\b", "L4"), (r"A10G?\b", "A10G"), (r"MI300X", "MI300X"),
)


def resolve_device(text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; anything else, or CUDA without a GPU, is bad input."""
    m = re.fullmatch(r"(cpu|cuda)(?::(\d+))?", text.strip().lower())
    if not m:
        raise PartitaError(f"unknown --device {text!r}; valid: cpu, cuda, cuda:N "
                           f"(use --device-type to name a GPU type: {', '.join(sorted(CATALOG))})")
    kind, index = m.group(1), m.group(2)
    if kind == "cpu":
        if index is not None:
            raise PartitaError(f"--device {text!r}: the CPU has no index; use --device cpu")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise PartitaError("--device cuda, but torch sees no CUDA GPU here "
                           f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); "
                           "run on a GPU machine or use --device cpu")
    index_n = int(index or 0)
    if index_n >= torch.cuda.device_count():
        raise PartitaError(f"--device {text}: only {torch.cuda.device_count()} GPU(s) visible")
    return torch.device("cuda", index_n)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def catalog_device(device: torch.device, override: str | None = None) -> str:
    """The catalog name the measured costs apply to."""
    if override:
        return get_device(override).name
    if device.type == "cpu":
        return "cpu"
    name = device_name(device)
    catalog = catalog_name_for_gpu(name)
    if catalog is not None:
        return catalog
    raise PartitaError(f"GPU {name!r} is not in the device catalog; name its type with --device-type "
                       f"(one of {', '.join(sorted(CATALOG))})")


def catalog_name_for_gpu(name: str) -> str | None:
    """``NVIDIA H100 80GB HBM3`` -> ``H100``; None for a GPU the catalog does not hold."""
    for pattern, catalog in _GPU_PATTERNS:
        if re.search(pattern, name, re.IGNORECASE):
            return catalog
    return None


def driver_version() -> str:
    """The NVIDIA kernel driver's version where the driver says it, else CUDA's driver API version."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?([\d.]+)", text)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        v = torch._C._cuda_getDriverVersion()  # e.g. 12040 for CUDA 12.4
        return f"cuda-driver-api {v // 1000}.{(v % 1000) // 10}"
    except (AttributeError, RuntimeError):
        return ""


def provenance(device: torch.device, *, dtype: str, command: str, threads: int | None = None) -> Provenance:
    name = device_name(device)
    if device.type == "cpu" and threads:
        name = f"{name} ({threads} thread{'s' if threads > 1 else ''} per rank)"
    cuda = device.type == "cuda"
    return Provenance(source="measured", device_name=name, torch=str(torch.__version__),
                      cuda=str(torch.version.cuda or "") if cuda else "", driver=driver_version() if cuda else "",
                      dtype=dtype, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      command=command, host=socket.gethostname())
