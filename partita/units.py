"""Units, and the one place where real numbers become the solver's integers.

The cost model works in seconds and bytes. The CP-SAT model needs integers, so costs are
turned into integer microseconds and integer memory grains here, and only here.

Rounding rule: times round to the nearest microsecond (half up); a step time summed from n
rounded terms may differ from the float sum by at most n/2 microseconds.

Memory is counted in allocation grains of ``MEMORY_GRAIN`` = 512 bytes, the CUDA caching
allocator's rounding: the cost model rounds each of its byte counts *up* to whole grains
(``round_up_to_grain``), so every sum it makes is a whole number of grains, and the solver works
in grains (``to_grains``, exact) against capacities rounded *down* to grains
(``capacity_grains``). A plan then fits under the solver exactly when it fits under the
evaluator. Grains, not bytes, because CP-SAT misjudges linear constraints whose coefficients
reach the hundreds of gigabytes that byte counts of large models do: it declared a shape of
llama-2-70b infeasible that a fixed assignment showed feasible (coefficients 32 times smaller
and up were right).
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


MEMORY_GRAIN = 512

# The chunked cross entropy's chunk: as many tokens as keep one chunk's fp32 logits within these
# bytes. runtime.schedule.ChunkedCrossEntropy runs it; search/costs/memory.py prices it.
LOSS_CHUNK_BYTES = 256 * MiB


def loss_chunk_tokens(tokens: int, vocab: int) -> int:
    """Tokens per chunk of the chunked loss: as many as keep one chunk's fp32 logits within
    ``LOSS_CHUNK_BYTES``."""
    return max(1, min(tokens, LOSS_CHUNK_BYTES // (4 * vocab)))


def round_up_to_grain(nbytes: float) -> int:
    """Bytes rounded up to whole allocation grains."""
    if nbytes < 0:
        raise ValueError(f"negative size {nbytes!r} bytes")
    return int(math.ceil(nbytes / MEMORY_GRAIN)) * MEMORY_GRAIN


def to_grains(nbytes: int) -> int:
    """A byte count the cost model made (a whole number of grains) in grains, exactly."""
    if nbytes % MEMORY_GRAIN:
        raise ValueError(f"{nbytes} bytes is not a whole number of {MEMORY_GRAIN}-byte grains")
    return nbytes // MEMORY_GRAIN


def capacity_grains(nbytes: int) -> int:
    """A capacity in whole grains, rounded down."""
    return nbytes // MEMORY_GRAIN


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
