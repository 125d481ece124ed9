"""Time of the primitive kernels (GEMM, fused attention, memory-bound elementwise) on any catalog device.

The analytic cost model has datasheet peaks only (``partita.devices``); real kernels reach a
shape-dependent fraction of them. One curve, calibrated on real H200 measurements
(``/work/shared/data/h200``, PyTorch eager, bf16), turns peaks into times::

    device_s = flops / (peak * efficiency) + memory_weight * bytes / bandwidth
    time_s   = (floor_s**sharpness + device_s**sharpness) ** (1 / sharpness)

``device_s`` is the kernel's own time: compute at a fixed fraction of peak, plus the part of
its memory traffic that does not hide behind the math (the fit says: nearly all of a GEMM's
output write; this is what makes k=1024 products slow). ``floor_s`` is the time an isolated
kernel cannot go below, measured on an idle GPU: mostly the host's dispatch of one eager op
(tens of µs), which a busy training step partly hides behind earlier work. The soft maximum
with exponent ``sharpness`` blends the floor-bound and device-bound regimes, which gives the
saturating efficiency small matrices show (1024³: 58 TFLOP/s, large ones 700-780). Only peaks
and bandwidths are per device, so the curve transfers across devices by scaling with them; the
floor is a host property and is kept as is.

The catalog's ``cpu`` device is nominal; it gets a plain roofline at its catalog peaks with
a modest efficiency, and on CPU ranks the weights' own traffic is priced apart
(``cpu_weight_stream_s``: passes over a layer's weights per micro-batch at a weight-stream
bandwidth that ``partita calibrate`` fits). ``benchmarks/calibrate_roofline.py`` re-fits the constants below and
prints the fit; ``docs/calibration.md`` records the errors. Nothing here reads those files.

Usage::

    from partita.devices import get_device
    from partita.search.roofline import matmul_time_s
    matmul_time_s(get_device("H100"), 8192, 4096, 4096)  # seconds
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from partita.devices import DeviceType
from partita.errors import PartitaError

ArrayLike = Union[float, np.ndarray]

ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP8_ELEMENT_BYTES = 1  # e4m3 and e5m2


def element_bytes(dtype: str) -> int:
    if dtype not in ELEMENT_BYTES:
        raise PartitaError(f"unknown dtype {dtype!r}; valid: {', '.join(ELEMENT_BYTES)}")
    return ELEMENT_BYTES[dtype]


@dataclass(frozen=True, kw_only=True)
class KernelCurve:
    """How one family of kernels turns FLOPs and bytes into time (see the module docstring)."""

    floor_s: float  # the least time an isolated kernel takes (host dispatch + launch)
    efficiency: float  # fraction of peak FLOP/s the math runs at once the device is busy
    memory_weight: float  # multiples of bytes/bandwidth that add to the math time
    # Exponent of the blend of floor and device time. Above 1 a soft maximum (large: a plain
    # max); below 1 the floor keeps costing a little beyond the sum, i.e. efficiency approaches
    # its limit slowly with size, which is what the attention forward shows.
    sharpness: float

    def time_s(self, flops: ArrayLike, nbytes: ArrayLike, peak_flops: float, bandwidth: float) -> ArrayLike:
        device_s = np.asarray(flops, dtype=float) / (peak_flops * self.efficiency) \
            + self.memory_weight * np.asarray(nbytes, dtype=float) / bandwidth
        q = self.sharpness
        # Soft maximum, scaled by the larger term so that large q cannot overflow.
        top = np.maximum(device_s, self.floor_s)
        result = top * ((self.floor_s / top) ** q + (device_s / top) ** q) ** (1.0 / q)
        return float(result) if np.ndim(result) == 0 else result


# ---- constants ---------------------------------------------------------------------------
# Fitted by `python benchmarks/calibrate_roofline.py` (least squares on log time) to
# /work/shared/data/h200/gemm.jsonl: 37 bf16 products a@b, m in {1024, 4096, 16384, 8192},
# n in {1024..28672}, k in {1024, 4096, 8192}, H200 SXM, torch 2.11 eager, CUDA events.
# Bytes per GEMM: (m*k + k*n + m*n) elements, each read or written once.
GEMM_CURVE = KernelCurve(floor_s=3.420e-05, efficiency=0.7573, memory_weight=1.016, sharpness=1.834)

# The curves above and the attention curves below are bursts: each call timed ten times after three
# warm-ups on an idle, cool card. A training step keeps the tensor cores busy for hours at the
# part's power limit, and a Hopper part does not hold its clocks through that (issue 23, items 3
# and 5). The measurements show it within one file: the products measured last and longest in
# gemm.jsonl (m = 16384, 12 shapes, up to 7.7 TFLOP a call) run at a median 0.944 of the curve's
# rate (0.83 to 1.03), where the same n and k at m = 1024 and 4096 run at 1.03 and 1.04 of it; the
# 8192^3 product at 0.89 (the data's README: 631-790 TFLOP/s on this card across runs, "clocks
# under sustained load"). So on Hopper parts the tensor-core rate (matrix products and fused
# attention; not the memory-bound kernels: HBM has its own clock) is taken at that median,
# ``HOPPER_SUSTAINED_TENSOR`` (``benchmarks/calibrate_roofline.py`` derives it from the file). It
# is a lower bound on the slowdown, not a fit: the 8192^3 run says a hot card loses more. Other
# parts keep the curve as it transfers by peak: no measurement here says how their clocks hold
# (``docs/calibration.md``, "Sustained load").
HOPPER_SUSTAINED_TENSOR = 0.944
# A Hopper part run below the power its datasheet is specified at (``DeviceType.power_limit_w``
# under ``tdp_w``) keeps less of its tensor rate, by the one public sweep of an H100's training
# throughput over power limits: Mayr et al., "AI Application Benchmarking: Power-Aware Performance
# Analysis for Vision and Language Models" (arXiv 2603.16164, 2026), Table 4, Llama 3 8B
# continued pre-training (LitGPT, bf16) on an H100 SXM 94 GB HBM2e (the HBM2e SXM variant of
# torchtitan's Grand Teton hosts) with its limit set from 200 to 700 W, tokens/s a GPU:
# 9,699.3, 17,982.3, 24,853.4, 27,705.3, 29,250.0 and 30,271.0 (the same table's ViT-L/16
# training keeps 0.915 at 500 W too). ``HOPPER_POWER_CURVE`` is that column over its 700 W row,
# against limit / 700 W, interpolated linearly; below 200 W the 200 W row's fraction (the range
# measured ends there). The step's memory-bound kernels lose less than its products (HBM has its
# own clock), so a step that keeps 0.915 has products that keep at most that: taken as the
# products' rate, it is the smallest loss the sweep allows, not a fit. It replaces an elasticity of
# 0.167 from an H100 at 700 W and a GH200 module at 900 W (whose limit covers the Grace CPU too),
# which kept 0.945 at 500 W (docs/calibration.md, "Below the design power").
HOPPER_POWER_CURVE = ((200 / 700, 9699.3 / 30271.0), (300 / 700, 17982.3 / 30271.0),
                      (400 / 700, 24853.4 / 30271.0), (500 / 700, 27705.3 / 30271.0),
                      (600 / 700, 29250.0 / 30271.0), (1.0, 1.0))
# FP8 matrix products (``dtype`` "fp8": e4m3/e5m2 operands, a bf16 result) reach a smaller share of
# their datasheet peak than bf16 ones. The one public pair of measurements of both on the same part
# by one method, the Maximum Achievable Matmul FLOPS of an H100 SXM (stas00/ml-engineering,
# compute/accelerator/README.md, torch 2.7.0 + CUDA 12.6): bf16 794.5 of 989 TFLOP/s (80.3 %), fp8
# (float8_e4m3fn) 1,402.6 of 1,979 (70.9 %). The bf16 curve (``GEMM_CURVE``) is taken to fp8 at
# the fp8 peak times this ratio of the two shares: an FP8 product runs 1.77x a bf16 one, not 2x.
# (The same table's H200, 73.4 %, and GH200, 77.6 % against 83.8 %, give 0.91-0.93.)
FP8_OVER_BF16_SHARE = (1402.6 / 1979) / (794.5 / 989)
SUSTAINED_SERIES_M = 16384  # the products of gemm.jsonl measured last and longest

# Fitted by the same script to /work/shared/data/h200/attn.jsonl: 24 causal bf16
# scaled_dot_product_attention calls, b in {1, 4}, heads in {8, 32, 64}, seq 1024..8192,
# head_dim 128. Forward: 4*b*h*s^2*d FLOPs (halved when causal), bytes q, k, v, out.
# Backward (fitted on forward+backward minus the forward curve): 2.5x the forward FLOPs
# (five products against two), bytes twice the forward's (q, k, v, out, dout in; dq, dk, dv out).
# The backward floor (~0.25 ms) is most likely autograd dispatching the backward to an idle GPU.
ATTENTION_FWD_CURVE = KernelCurve(floor_s=2.301e-05, efficiency=0.7170, memory_weight=0.1561, sharpness=0.5621)
ATTENTION_BWD_CURVE = KernelCurve(floor_s=2.474e-04, efficiency=0.5881, memory_weight=3.768, sharpness=1.928)

# /work/shared/data/h200/copy.jsonl: a 1 GiB device copy moves 2 GiB (read + write) at
# 4112 GB/s = 0.857 of the 4800 GB/s datasheet. One point, so only the bandwidth is fitted;
# the floor of an elementwise kernel is an assumed launch latency, not a measurement.
MEMORY_EFFICIENCY = 0.857
MEMORY_CURVE = KernelCurve(floor_s=5e-06, efficiency=1.0, memory_weight=1.0 / MEMORY_EFFICIENCY, sharpness=2.0)

# The nominal "cpu" device: a plain roofline, max(compute, memory), at a modest fraction of
# the catalog's nominal peaks. Not calibrated; measure CPUs with `partita profile --device cpu`.
CPU_EFFICIENCY = 0.5
CPU_FLOOR_S = 2e-06

# The weights' traffic on a CPU rank (``cpu_weight_stream_s``). The roofline above prices a product
# by the larger of its math and its bytes, and its bytes are mostly the activations': on a CPU the
# weights' own traffic does not hide behind the math. One core runs the BLAS kernel, which first
# copies (packs) the weight operand into panels, and the weights, the gradients and the optimizer's
# state of a rank (~60 MB for a calib-llama stage) do not stay in a cache (32 MB of L3 shared by the
# ranks on the development machine), so each pass over a weight streams it from memory before the
# math. Passes per micro-batch over a layer's parameters:
#   forward   2: the product reads the weight and writes its packed copy;
#   backward  3 + 3: dX = dY W^T reads and packs it again, dW = X^T dY writes a weight-sized
#             result; autograd then accumulates it into the fp32 .grad (reads both, writes one).
#             (A step's first micro-batch hands its gradient over without the add; not modelled.)
# The embedding's weight feeds a gather, not a product: its forward reads rows only, and its
# dense gradient's zeroing and scatter are priced as kernels (search/analytic.py); what is left
# is the accumulation.
# Measured on the development machine (one thread, nn.Linear 256x688 and 256x256, 128-512 tokens,
# weights evicted by a 64 MB pass before each call against warm): the time at zero tokens grows
# by 0.07-0.19 ms forward and 0.24-0.46 ms backward for the 0.7 MB weight, about 1 : 3 as the
# passes say, at 7-20 GB/s. ``partita calibrate`` fits the bandwidth (from the device's memory
# bandwidth); without a calibration that has it, the CPU keeps the plain roofline above.
CPU_WEIGHT_PASSES_FORWARD = 2
CPU_WEIGHT_PASSES_BACKWARD = 3
CPU_GRAD_ACCUMULATE_PASSES = 3
FP32_BYTES = 4  # the gradients accumulate in fp32; the master weights and Adam's state are fp32
# torch's single-tensor AdamW (the CPU default) passes over parameter-sized fp32 tensors 20 times
# per parameter: param *= 1 - lr*wd (2), exp_avg.lerp_(grad) (3), exp_avg_sq.mul_ (2) and
# .addcmul_(grad, grad) (3), sqrt, / and +eps (2 each), param.addcdiv_(exp_avg, denom) (4). The
# same streams at the same bandwidth: a step's optimizer time shows it on every run.
CPU_ADAM_PASSES = 20


def cpu_weight_stream_s(params: float, elem: int, bandwidth_gbps: float, *,
                        product: bool) -> tuple[float, float]:
    """(forward, backward) seconds one micro-batch spends streaming a layer's ``params``
    parameters (``elem`` bytes each in the compute dtype) on a CPU rank at ``bandwidth_gbps``;
    ``product``: the weights feed matrix products (every layer but the embedding)."""
    if bandwidth_gbps <= 0:
        raise PartitaError(f"weight-stream bandwidth must be positive, got {bandwidth_gbps} GB/s")
    rate = bandwidth_gbps * 1e9
    accumulate = CPU_GRAD_ACCUMULATE_PASSES * params * FP32_BYTES / rate
    if not product:
        return 0.0, accumulate
    return (CPU_WEIGHT_PASSES_FORWARD * params * elem / rate,
            CPU_WEIGHT_PASSES_BACKWARD * params * elem / rate + accumulate)


def cpu_adam_s(params: float, bandwidth_gbps: float) -> float:
    """Seconds of torch's single-tensor AdamW streaming ``params`` fp32 parameters and their
    state on a CPU rank at ``bandwidth_gbps`` (its host ops are priced apart)."""
    return CPU_ADAM_PASSES * params * FP32_BYTES / (bandwidth_gbps * 1e9)


# Flash attention's backward runs five block products to the forward's two.
ATTENTION_BWD_FLOPS_RATIO = 2.5

# ---- fused attention by sequence length (issue 23, item 3) ----------------------------------
# A fused attention kernel's achieved throughput depends on the sequence length (its tiles, the
# causal mask's partly filled blocks, the softmax between the products) far more than on the
# FLOP count alone, and on Hopper at head dim 128 it stays far below the matmul peak: the
# forward at most ~0.62, the backward ~0.57 of 989 TFLOP/s for the best kernel, FlashAttention-2
# about a third. Each kernel below is a curve of achieved TFLOP/s by sequence length, forward and
# backward apart, read from Shah et al. 2024 ("FlashAttention-3: Fast and Accurate Attention with
# Asynchrony and Low-precision", arXiv:2407.08608, Figures 5 and 6: H100 80GB SXM5, bf16, head
# dim 128, batch x seq = 16k tokens, 16 heads; FlashAttention-2, cuDNN and FlashAttention-3
# bars). The paper shows the backward without the causal mask only; the causal backward is taken
# at the same fraction of the full one as the causal forward is of the full forward at that
# length (0.62-0.95), i.e. the mask costs the backward what it costs the forward. Efficiency =
# TFLOP/s / 989 (H100 SXM5 dense bf16), applied to the device's peak; log-linear in the sequence
# length between the points, flat beyond them (from 8k to 16k every kernel gains 0-2 %: the
# curves have saturated). FLOPs are counted as the paper counts them: forward 4 b h s^2 d
# (halved when causal), backward 2.5 x the forward.
ATTENTION_TABLE_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
H100_SXM_BF16_TFLOPS = 989.0


@dataclass(frozen=True, kw_only=True)
class AttentionTable:
    """A fused attention kernel's achieved TFLOP/s at ``ATTENTION_TABLE_SEQ`` on an H100 SXM5."""

    forward_full: tuple[float, ...]
    forward_causal: tuple[float, ...]
    backward_full: tuple[float, ...]

    def efficiency(self, seq: int, *, causal: bool, backward: bool) -> float:
        """Fraction of the dense bf16 peak the kernel reaches at ``seq`` tokens."""
        fwd = self.forward_causal if causal else self.forward_full
        tflops = np.asarray(fwd, dtype=float)
        if backward:
            tflops = np.asarray(self.backward_full, dtype=float)
            if causal:
                tflops = tflops * np.asarray(self.forward_causal) / np.asarray(self.forward_full)
        x = np.log2(np.clip(seq, ATTENTION_TABLE_SEQ[0], ATTENTION_TABLE_SEQ[-1]))
        return float(np.interp(x, np.log2(ATTENTION_TABLE_SEQ), tflops)) / H100_SXM_BF16_TFLOPS


# FlashAttention-3 paper, Fig. 5 (forward, head dim 128, without and with the causal mask) and
# Fig. 6 (backward, head dim 128), H100 80GB SXM5, TFLOP/s at 512, 1k, 2k, 4k, 8k, 16k tokens.
# "flash2": FlashAttention-2, the kernel torch's SDPA dispatched on H100 in 2024-25 (torchtitan#1042:
# "it dispatches SDPBackend.FLASH_ATTENTION"); written for Ampere's instructions, it reaches
# "only 35 % utilization" on H100 (the paper's abstract). "cudnn": cuDNN's fused attention
# (Transformer Engine's default, torch's SDPBackend.CUDNN_ATTENTION). "flash3": FlashAttention-3.
HOPPER_ATTENTION = {
    "flash2": AttentionTable(forward_full=(309, 350, 362, 368, 370, 370),
                             forward_causal=(191, 260, 298, 319, 333, 335),
                             backward_full=(214, 260, 291, 310, 318, 322)),
    "cudnn": AttentionTable(forward_full=(497, 574, 617, 609, 600, 595),
                            forward_causal=(315, 410, 484, 518, 529, 539),
                            backward_full=(305, 408, 465, 499, 518, 516)),
    "flash3": AttentionTable(forward_full=(467, 565, 625, 638, 646, 648),
                             forward_causal=(292, 423, 521, 579, 602, 616),
                             backward_full=(316, 424, 501, 542, 559, 561)),
}
# The published figures include every byte the kernels move: no memory term. They are taken at
# one family of shapes (batch x seq = 16k tokens, 16 heads); at another batch x heads the rate is
# scaled as the measured H200 SDPA kernel's changes between the two shapes at the same length
# (its floors, the host dispatching the call and autograd its backward, included), never above
# the paper's rate (its shapes already fill the GPU): one sequence of 8k tokens over 4 heads (a
# tp 8 shard) runs at 0.65 of it forward.
ATTENTION_TABLE_REF_TOKENS = 16384
ATTENTION_TABLE_REF_HEADS = 16

# "sdpa" is what the fitted curves above measured: torch 2.11's scaled_dot_product_attention on an
# H200, a Hopper-native kernel (causal forward 574-617 TFLOP/s at 8k tokens, as FlashAttention-3's
# 602; backward 469-495, FlashAttention-3's causal backward by the rule above is 520). The data
# stop at 8192 tokens, and the curves' asymptotes (0.717 and 0.588 of peak, 709 and 582 TFLOP/s)
# lie above every published Hopper kernel's long-sequence rate, so past 8192 tokens the kernel runs
# at the rate it reaches at 8192 over the same query tiles (batch x heads x seq / 8192 sequences:
# as many CTAs to fill the SMs), never above the largest call measured there (the published
# kernels gain 0-2 % from 8k to 16k at 16 heads): at a fixed shape the time grows with the FLOPs,
# s^2. Until 2026-12-07 the rate was held at the same batch and heads, which left a tensor-parallel
# shard of a few heads at the rate of a few heads of 8k tokens however long its sequence.
SDPA_MEASURED_SEQ = 8192
SDPA_MEASURED_SEQUENCES = 256  # the largest batch x heads measured there (b 4, 64 heads)

# On a non-Hopper part "flash2" and "cudnn" are priced by the fitted curves, which transfer by
# peak (FlashAttention-2 reaches 50-73 % of A100's peak, Dao 2023, arXiv:2307.08691); "flash3"
# runs on Hopper only.
#
# "flash1" is FlashAttention (v1, Dao et al. 2022) and its 2022 Triton port
# (flash_attn/flash_attn_triton.py, written for triton 2.0.0.dev20221202, before Triton's MLIR
# backend and Hopper instructions; llm-foundry ships it as attn_impl "triton", its default until
# 2024 and the only kernel of its time with an attention bias, so ALiBi). Its docstring: "Triton
# forward is generally faster than CUDA forward, while Triton backward is generally slower than
# CUDA backward". The FlashAttention-2 paper (Dao 2023, arXiv:2307.08691, sec. 4.1) gives the two
# passes apart: FlashAttention-2 is "around 1.3-1.5x faster than FlashAttention in Triton in the
# forward pass and around 2x faster in the backward pass". Priced as FlashAttention-2's time on the
# same part and shape, the forward 1.4x (the range's middle), the backward 2x: under full
# recomputation, which runs the forward twice, about 1.75x on a Hopper (1.85x without). The
# paper's Fig. 4 (A100, forward + backward, head dim 128, causal) puts the port at 2.0-2.4x; the
# text's split is the one figure per pass. The Ampere-era kernels gain nothing on Hopper that
# FlashAttention-2 does not (both issue Ampere's mma instructions). FlashAttention v1's CUDA
# kernels run their forward slower than the port ("around 2x" against FlashAttention-2, the same
# section): priced as the port, a forward that is optimistic for them; no published run here ran them.
FLASH1_FORWARD_SLOWDOWN = 1.4
FLASH1_BACKWARD_SLOWDOWN = 2.0
ATTENTION_KERNELS = ("sdpa", "flash1", "flash2", "cudnn", "flash3")
HOPPER_ONLY_KERNELS = ("flash3",)
HOPPER_PREFIXES = ("H100", "H200", "GH200")  # catalog names (and variants of them) of Hopper parts


def is_hopper(dev: DeviceType) -> bool:
    return dev.name.upper().startswith(HOPPER_PREFIXES)


# ---- primitives ----------------------------------------------------------------------------
def sustained_tensor_fraction(dev: DeviceType) -> float:
    """The fraction of its burst tensor-core rate ``dev`` keeps under a training step's sustained
    load: ``HOPPER_SUSTAINED_TENSOR`` on Hopper parts, less below their design power
    (``power_limit_fraction``); 1 on other parts."""
    if not is_hopper(dev):
        return 1.0
    return HOPPER_SUSTAINED_TENSOR * power_limit_fraction(dev)


def power_limit_fraction(dev: DeviceType) -> float:
    """The fraction of its tensor rate a Hopper part keeps at ``power_limit_w`` under its design
    power ``tdp_w`` (``HOPPER_POWER_CURVE``); 1 at or above it, or without the two figures."""
    if not (dev.tdp_w and dev.power_limit_w and dev.power_limit_w < dev.tdp_w):
        return 1.0
    xs, ys = zip(*HOPPER_POWER_CURVE)
    return float(np.interp(dev.power_limit_w / dev.tdp_w, xs, ys))


def _peaks(dev: DeviceType, dtype: str) -> tuple[float, float]:
    peak = dev.peak_tflops(dtype) * 1e12 * sustained_tensor_fraction(dev)
    if peak <= 0:
        raise PartitaError(f"device {dev.name} has no {dtype} peak in the catalog; choose another dtype")
    if dtype == "fp8":
        peak *= FP8_OVER_BF16_SHARE
    return peak, dev.hbm_gbps * 1e9


def _cpu_time_s(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    return CPU_FLOOR_S + max(flops / (peak * CPU_EFFICIENCY), nbytes / (bandwidth * CPU_EFFICIENCY))


def _time_s(curve: KernelCurve, dev: DeviceType, flops: float, nbytes: float, dtype: str) -> float:
    peak, bandwidth = _peaks(dev, dtype)
    if dev.is_cpu:
        return _cpu_time_s(flops, nbytes, peak, bandwidth)
    return float(curve.time_s(flops, nbytes, peak, bandwidth))


def _check_positive(**dims: int) -> None:
    bad = {k: v for k, v in dims.items() if v <= 0}
    if bad:
        raise PartitaError(f"kernel shape must be positive, got {bad}")


def matmul_flops_bytes(m: int, n: int, k: int, dtype: str) -> tuple[float, float]:
    """FLOPs and bytes moved by C[m,n] = A[m,k] @ B[k,n] (each operand read or written once);
    "fp8": one-byte operands and a bf16 result (Transformer Engine's FP8 GEMMs)."""
    if dtype == "fp8":
        return 2.0 * m * n * k, float(m * k + k * n + 2 * m * n)
    return 2.0 * m * n * k, float(element_bytes(dtype) * (m * k + k * n + m * n))


def matmul_time_s(dev: DeviceType, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    """Seconds for C[m,n] = A[m,k] @ B[k,n] on ``dev``."""
    _check_positive(m=m, n=n, k=k)
    flops, nbytes = matmul_flops_bytes(m, n, k, dtype)
    return _time_s(GEMM_CURVE, dev, flops, nbytes, dtype)


def attention_flops_bytes(batch: int, heads: int, seq: int, head_dim: int, *, causal: bool,
                          dtype: str) -> tuple[float, float]:
    """Forward FLOPs (QK^T and AV; half the square when causal) and bytes (q, k, v, out)."""
    flops = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return flops, float(4 * batch * heads * seq * head_dim * element_bytes(dtype))


def attention_time_s(dev: DeviceType, batch: int, heads: int, seq: int, head_dim: int, *,
                     causal: bool = True, dtype: str = "bf16", kernel: str = "sdpa") -> tuple[float, float]:
    """(forward, backward) seconds of fused (flash / SDPA) attention over ``heads`` query heads;
    ``kernel`` one of ``ATTENTION_KERNELS``: on Hopper the published kernels by their curves of
    throughput by sequence length (``HOPPER_ATTENTION``), "sdpa" by the H200 fit (held at its
    8192-token rate beyond; ``SDPA_MEASURED_SEQ``)."""
    _check_positive(batch=batch, heads=heads, seq=seq, head_dim=head_dim)
    if kernel not in ATTENTION_KERNELS:
        raise PartitaError(f"unknown fused attention kernel {kernel!r}; valid: {', '.join(ATTENTION_KERNELS)}")
    hopper = is_hopper(dev)
    if kernel in HOPPER_ONLY_KERNELS and not hopper and not dev.is_cpu:
        raise PartitaError(f"attention kernel {kernel!r} runs on Hopper GPUs only, not on {dev.name}; "
                           f"valid there: {', '.join(k for k in ATTENTION_KERNELS if k not in HOPPER_ONLY_KERNELS)}")
    if kernel == "flash1":
        forward, backward = attention_time_s(dev, batch, heads, seq, head_dim, causal=causal, dtype=dtype,
                                             kernel="flash2")
        return FLASH1_FORWARD_SLOWDOWN * forward, FLASH1_BACKWARD_SLOWDOWN * backward
    flops, nbytes = attention_flops_bytes(batch, heads, seq, head_dim, causal=causal, dtype=dtype)
    if kernel in HOPPER_ATTENTION and hopper:
        # The table's rate at the paper's shape (16k tokens a batch, 16 heads), carried to this
        # shape by how the measured SDPA kernel's rate changes from that shape to this one at the
        # same length (fewer heads x sequences: fewer tiles to fill the GPU, the floor's share).
        table = HOPPER_ATTENTION[kernel]
        ref_batch = max(1, ATTENTION_TABLE_REF_TOKENS // seq)
        ref_flops = attention_flops_bytes(ref_batch, ATTENTION_TABLE_REF_HEADS, seq, head_dim, causal=causal,
                                          dtype=dtype)[0]
        here = attention_time_s(dev, batch, heads, seq, head_dim, causal=causal, dtype=dtype, kernel="sdpa")
        ref = attention_time_s(dev, ref_batch, ATTENTION_TABLE_REF_HEADS, seq, head_dim, causal=causal, dtype=dtype,
                               kernel="sdpa")
        peak = _peaks(dev, dtype)[0]
        times = []
        for i, backward in enumerate((False, True)):
            # this shape's SDPA rate over the paper shape's; never above 1: the paper's shapes fill the GPU
            ratio = min(1.0, (ref[i] / ref_flops) / (here[i] / flops))
            times.append((ATTENTION_BWD_FLOPS_RATIO if backward else 1.0) * flops
                         / (peak * table.efficiency(seq, causal=causal, backward=backward) * ratio))
        return times[0], times[1]
    if seq > SDPA_MEASURED_SEQ and not dev.is_cpu:
        # Past the measured lengths: the rate of a call at the measured length over as many query
        # tiles (batch x heads x seq / tile rows: the CTAs that fill the SMs), each tile's loop over
        # the keys as long as there: scale = seq / 8192 times the sequences of 8192 tokens, each
        # scale times as long, so the shape's FLOPs / scale and its bytes, its time x scale. Never
        # past the largest call the data measured at that length (SDPA_MEASURED_SEQUENCES: the
        # fitted curves' asymptotes lie above every published Hopper kernel). Held instead at the
        # same batch and heads, a one-sequence, four-head shard at 256k tokens would run at the rate
        # of four heads of 8k tokens, a GPU a quarter filled.
        scale = seq / SDPA_MEASURED_SEQ
        fill = min(1.0, SDPA_MEASURED_SEQUENCES / (batch * heads * scale))
        forward = _time_s(ATTENTION_FWD_CURVE, dev, flops / scale * fill, nbytes * fill, dtype) * scale / fill
        backward = _time_s(ATTENTION_BWD_CURVE, dev, ATTENTION_BWD_FLOPS_RATIO * flops / scale * fill,
                           2.0 * nbytes * fill, dtype) * scale / fill
        return forward, backward
    forward = _time_s(ATTENTION_FWD_CURVE, dev, flops, nbytes, dtype)
    backward = _time_s(ATTENTION_BWD_CURVE, dev, ATTENTION_BWD_FLOPS_RATIO * flops, 2.0 * nbytes, dtype)
    return forward, backward


def batched_matmul_time_s(dev: DeviceType, batch: int, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    """Seconds for ``batch`` independent products C[m,n] = A[m,k] @ B[k,n] in one kernel
    (``torch.bmm`` / ``baddbmm``): the GEMM curve on the batch's FLOPs and bytes, one floor."""
    _check_positive(batch=batch, m=m, n=n, k=k)
    flops, nbytes = matmul_flops_bytes(m, n, k, dtype)
    return _time_s(GEMM_CURVE, dev, batch * flops, batch * nbytes, dtype)


def memory_time_s(dev: DeviceType, nbytes: float) -> float:
    """Seconds for one memory-bound elementwise kernel moving ``nbytes`` (read + written)."""
    if nbytes < 0:
        raise PartitaError(f"bytes must be non-negative, got {nbytes}")
    bandwidth = dev.hbm_gbps * 1e9
    if dev.is_cpu:
        return CPU_FLOOR_S + nbytes / (bandwidth * CPU_EFFICIENCY)
    return float(MEMORY_CURVE.time_s(0.0, nbytes, 1.0, bandwidth))
