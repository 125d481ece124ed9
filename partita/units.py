"""Units, and the one place where real numbers become the solver's integers.

The cost model works in seconds and bytes (floats). The CP-SAT model needs integers,
so costs are turned into integer microseconds and integer MiB here, and only here.

Rounding rule: times round to the nearest microsecond (half up); memory rounds *up* to
the next MiB, so a plan that fits in integer MiB also fits in bytes. A step time summed
from n rounded terms may differ from the float sum by at most n/2 microseconds.
"""

import math

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 1e9  # link and memory bandwidths are quoted in decimal GB/s on datasheets
TFLOPS = 1e12


def to_us(seconds: float) -> int:
    """Seconds to integer microseconds, rounded half up."""
    if seconds < 0:
        raise ValueError(f"negative time {seconds!r} s")
    return int(math.floor(seconds * 1e6 + 0.5))


def to_mib(nbytes: float) -> int:
    """Bytes to integer MiB, rounded up."""
    if nbytes < 0:
        raise ValueError(f"negative size {nbytes!r} bytes")
    return int(math.ceil(nbytes / MiB - 1e-9))


def fmt_bytes(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.1f} GiB"
    if nbytes >= MiB:
        return f"{nbytes / MiB:.1f} MiB"
    return f"{nbytes / KiB:.1f} KiB"


def fmt_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"
