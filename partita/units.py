"""Units, and the one place where real numbers become the solver's integers.

The cost model works in seconds and bytes. The CP-SAT model needs integers, so costs are
turned into integer microseconds and integer bytes here, and only here.

Rounding rule: times round to the nearest microsecond (half up); a step time summed from n
rounded terms may differ from the float sum by at most n/2 microseconds. Memory stays in
exact bytes (the cost model's byte counts are integers already; a fractional count rounds
*up*), so the solver's memory sums equal the evaluator's and a plan fits in one exactly when
it fits in the other. Bytes fit CP-SAT's int64 with room to spare: a device holds < 2**40
bytes, and a stage's sum (bytes x blocks x micro-batches in flight) stays below 2**60.
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


def to_bytes(nbytes: float) -> int:
    """A byte count as an exact integer: integers unchanged, fractions rounded up."""
    if nbytes < 0:
        raise ValueError(f"negative size {nbytes!r} bytes")
    return nbytes if isinstance(nbytes, int) else int(math.ceil(nbytes))


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
