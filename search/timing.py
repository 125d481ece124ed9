"""The time side's constants and small formulas: achieved collective bandwidth, the host's
per-op overhead, the overlap slowdown, the fixed per-step overhead, and what the training
software does (``Software``). The cost model (``search/costs/``) prices with them; ``partita calibrate``
(``search/calibrate.py``) replaces the constants with fitted values.

Where each default comes from is stated beside it (and in docs/search.md): cited, measured on
this project's CPU development machine, or assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

from partita.errors import PartitaError
from partita.model import LayerKind
from partita.search.analytic import ATTENTION

# ---- achieved bus bandwidth --------------------------------------------------------------
# NCCL reaches a fraction of the link's line rate (protocol overhead): on NVLink "~20 %", an
# effective 370 of H100's 450 GB/s per direction as bus bandwidth (S. Jeaugey, NVIDIA, in
# NVIDIA/nccl-tests#212, 2024; without NVLink SHARP); A100's NVLink 3 gives ~235 of 300 GB/s
# (0.78, nccl-tests#189), within 5 % of it. The same fraction is assumed for the other GPU links.
# InfiniBand NICs come closer to their line rate: "24GB/s is the peak performance per 200G NIC
# (12 GB/s for 100G NICs)" (S. Jeaugey, nccl-tests#119, 2022) and "46-48GB/s per NIC" at 400 Gb/s
# (NVIDIA's AddyLaddy in nccl-tests#290, 2025): 0.96. The message-size dependence comes from the
# per-step latency (``costs.links.LINK_LATENCY_S``):
# achieved busbw(S) = S / (steps x latency + S / (efficiency x line rate)).
# gloo between CPU ranks is not NCCL; its figures come from a calibration or `partita profile
# --comm` (efficiency 1: the catalog's nominal loopback rate stands as is).
LINK_EFFICIENCY = {"nvlink": 370 / 450, "xgmi": 370 / 450, "pcie": 370 / 450, "network": 24 / 25,
                   "loopback": 1.0}

# ---- overlap -----------------------------------------------------------------------------
# While a collective runs beside compute, the compute slows: on A100/H100/MI250/MI210 by 18.9 %
# on average (40 % at most) against the same compute alone (Lee et al., "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning", arXiv:2507.03114,
# 2025). On CPU ranks gloo's threads share the cores the compute runs on, so overlap buys
# nothing: the slowdown is 1 (the two add up), unless a calibration says otherwise.
OVERLAP_SLOWDOWN_GPU = 0.189
OVERLAP_SLOWDOWN_CPU = 1.0
# Matrix products on Hopper parts beside a data-parallel NCCL collective (ZeRO-3 / FSDP's gathers
# and reduce-scatters, the gradients' reduction beside the backward) slow more than the average
# above. The collective's kernel holds some of the SMs for as long as it runs (24 of an H100's 132
# for an all-gather in NVIDIA developer forum thread 337991, 2025, measured with Nsight Systems),
# and Hopper's GEMM kernels are persistent: one CTA an SM, each with its share of the tiles fixed
# at launch, so the CTAs that find no free SM run their whole share after the others (the
# thread's 132-CTA product beside that all-gather: 80 % of the peak alone, 47 % beside it, its time
# x 1.70). Products whose tiles go round more SMs, or that start before the collective, lose less;
# priced at Lee et al.'s largest slowdown, 0.40, and the other kernels (attention, the
# memory-bound ones) at their average above, weighted by the products' share of the pass
# (``TimeConstants.collective_slowdown``). Transformer Engine's tensor-parallel overlap launches
# its products on the SMs its communication leaves free (userbuffers' SM margin) and pipeline
# sends hold one or two SMs for microseconds: both keep the average. A calibration's fitted
# slowdown measured the whole and replaces both. Checked on the published runs: the FSDP rows on
# H100 (MosaicML's, torchtitan's, IBM's, Meta's) were 5-16 % fast where ZeRO-3 traffic is a third
# to two thirds of the compute, and each source alone is best matched near 0.4-0.5
# (``benchmarks/overlap_sweep.py``; docs/published_runs.md, tenth session).
HOPPER_GEMM_OVERLAP_SLOWDOWN = 0.40


def overlapped_s(compute_s: float, comm_s: float, slowdown: float) -> float:
    """A pass whose compute runs beside ``comm_s`` of communication: the compute slows by
    ``slowdown`` for as long as the two overlap, and the pass lasts at least the communication.
    slowdown 0: max(compute, comm) (perfect overlap); 1: compute + comm where the communication
    is the shorter, max(comm, 2 x compute) where it is the longer (for transfers priced one after
    the other whatever their length, the caller adds them: ``Engine.zero3_overlap``)."""
    return max(comm_s, compute_s + slowdown * min(compute_s, comm_s))


# Aten ops one layer dispatches in eager PyTorch, forward and backward, counted with a
# TorchDispatchMode on the runtime's own models (tests/test_timing.py recounts them), tp 1,
# no sequence parallelism. The head's forward includes the loss. Grouped-query attention adds
# the repeat of k and v. Tensor parallelism adds DTensor's own ops (not counted).
_OPS = {
    ("llama", "embed"): (1, 2),
    ("llama", "block"): (106, 136),
    ("llama", "head"): (16, 33),
    ("gpt2", "embed"): (4, 6),
    ("gpt2", "block"): (39, 94),
    ("gpt2", "head"): (10, 18),
}
GQA_EXTRA_OPS = (8, 8)
# AdamW's single-tensor update (torch's default for CPU tensors) dispatches 10 ops per
# parameter tensor; on GPUs the foreach update's launches do not grow with the tensor count
# and fall in the per-step overhead.
OPTIMIZER_OPS_PER_TENSOR = {"cpu": 10, "gpu": 0}


def layer_ops(kind: LayerKind) -> tuple[int, int]:
    """(forward, backward) eager ops of one layer of this kind."""
    fwd, bwd = _OPS[(kind.family, kind.role)]
    if kind.role == "block" and kind.heads != kind.kv_heads:
        fwd, bwd = fwd + GQA_EXTRA_OPS[0], bwd + GQA_EXTRA_OPS[1]
    if kind.is_moe:  # routing and dispatch, and every expert's SwiGLU (runtime.models.MoE)
        experts = MOE_OPS_PER_EXPERT * kind.experts
        fwd, bwd = fwd + MOE_ROUTING_OPS + experts, bwd + 2 * (MOE_ROUTING_OPS + experts)
    return fwd, bwd


# A mixture-of-experts MLP's eager ops beyond a dense block's (counted from runtime.models.MoE,
# not measured): routing, sorting, gathers and scatters, the weighted sum and the balancing loss
# (about 20), and per expert a split, three products, silu and the gate product (6).
MOE_ROUTING_OPS = 20
MOE_OPS_PER_EXPERT = 6


# ---- host overhead -------------------------------------------------------------------------
# The host's time for one eager op on a GPU (issue 23, item 5). CUDA events around one eager call
# on an idle GPU time the host's dispatch of it whenever its kernel is shorter than that dispatch:
# the kernel starts only once the host has launched it, and the end event is queued only once the
# call has returned. /work/shared/data/h200 (one H200, torch 2.11 eager, bf16) holds three such
# host-bound calls, each taken as the median of the points whose kernel, at the best rate the file
# measures, would last under a third of the file's fastest call (benchmarks/launch_floor.py
# derives them; tests/test_timing.py re-derives them from the files):
#   a product (cuBLAS)     gemm.jsonl, a @ b of <= 8.6 GFLOP, 4 points at 35.0-38.8 us: 37.0 us;
#   an SDPA forward        attn.jsonl, causal, b 1, 8 heads, 1024 tokens (1 point): 39.2 us,
#                          its few-us kernel included: an upper bound;
#   an SDPA backward       attn.jsonl, forward+backward less the forward, 4 points at
#                          231-296 us: 247 us. It holds the fixed cost of a backward call (the
#                          autograd engine's start and hand-off to the device thread) together with
#                          SDPA's backward and the inputs' gradient accumulation: one backward with
#                          one node cannot tell them apart, so the whole is charged to the attention
#                          backward, which every block's backward has once.
# Every other op (elementwise kernels, views, reductions) is not in the data: a small op's floor
# stays the assumed 5 us (the elementwise floor of search/roofline.py). Within a pass the host
# dispatches one op after another, so these costs add, and the pass takes the larger of that sum
# and the device time (``host_bound_s``); the roofline's floors (search/roofline.py) are the same
# dispatches seen from an isolated kernel, and are not added again.


@dataclass(frozen=True, kw_only=True)
class DispatchCosts:
    """Host seconds per eager op of each kind, on one machine."""

    product: float  # one matrix product (mm / addmm), forward or backward
    attention_forward: float  # one fused attention forward
    attention_backward: float  # one fused attention backward, with a backward call's fixed cost
    other: float  # any other op


H200_DISPATCH = DispatchCosts(product=37.0e-6, attention_forward=39.2e-6, attention_backward=246.6e-6, other=5e-6)

# Matrix products among a layer's forward ops (its backward runs two per product), counted with
# a TorchDispatchMode on the runtime's models as ``_OPS`` (tests/test_timing.py recounts them).
_PRODUCTS = {("llama", "embed"): 0, ("llama", "block"): 7, ("llama", "head"): 1,
             ("gpt2", "embed"): 0, ("gpt2", "block"): 6, ("gpt2", "head"): 1}


def layer_products(kind: LayerKind) -> int:
    """Matrix products one layer's forward dispatches."""
    if kind.is_moe:  # attention, the router, three per expert, the shared expert and its gate
        return 4 + 1 + 3 * kind.experts + (4 if kind.shared_expert_ffn else 0)
    return _PRODUCTS[(kind.family, kind.role)]


def layer_host_s(kind: LayerKind, costs: DispatchCosts = H200_DISPATCH) -> tuple[float, float]:
    """(forward, backward) host seconds of one layer's eager ops on a GPU, op by op kind."""
    fwd_ops, bwd_ops = layer_ops(kind)
    products, attention = layer_products(kind), 1 if kind.role == "block" else 0
    forward = (products * costs.product + attention * costs.attention_forward
               + (fwd_ops - products - attention) * costs.other)
    backward = (2 * products * costs.product + attention * costs.attention_backward
                + (bwd_ops - 2 * products - attention) * costs.other)
    return forward, backward


def mean_op_host_s(kind: LayerKind, costs: DispatchCosts = H200_DISPATCH) -> float:
    """The host's mean time per eager op over one layer's forward and backward: what
    `partita profile`'s launch probe measures on a block (``runtime.commprobe.op_overhead_of``)."""
    return sum(layer_host_s(kind, costs)) / sum(layer_ops(kind))


# The block the GPU default is taken on: llama-3-8b's (grouped-query attention; only the family,
# the role and the head ratio set its ops).
REFERENCE_BLOCK = LayerKind(role="block", family="llama", hidden=4096, heads=32, kv_heads=8, ffn=14336,
                            vocab=128256, qkv_bias=False, learned_positions=0)

# Host time per dispatched eager op (Python, the dispatcher, autograd, the launch), the one
# constant the cost model prices every op with. GPU: the op runs asynchronously, so a pass takes
# max(device time, ops x overhead); CPU: the host does the work, so the two add. Defaults: CPU
# 3 us, measured on the development machine (a loop of tiny torch ops costs 1.3-1.8 us each; a
# module's op with autograd and Python around it about twice that); GPU 8.7 us, the H200 host's
# mean over the reference block's 258 ops (``mean_op_host_s``: 2.24 ms a forward and backward,
# where 5 us an op counted the products' and the attention backward's dispatch as device time
# that the other ops' dispatch could hide). `partita profile` measures it on the device;
# `partita calibrate` fits it.
OP_OVERHEAD_S = {"cpu": 3e-6, "gpu": mean_op_host_s(REFERENCE_BLOCK)}
# The fixed part of a step beyond its layers and optimizer (the loss's all-reduce, data to the
# device, Python between micro-batches): assumed 1 ms on either; fitted by `partita calibrate`.
STEP_OVERHEAD_S = {"cpu": 1e-3, "gpu": 1e-3}


def param_tensors(kind: LayerKind, tied_head: bool = False) -> int:
    """Parameter tensors of one layer (each one update of the optimizer's loop)."""
    norms = 1 if kind.family == "llama" else 2  # LayerNorm has a bias
    if kind.role == "embed":
        return 1 + (1 if kind.learned_positions else 0)
    if kind.role == "head":
        return norms + (0 if tied_head else 1)
    if kind.family == "gpt2":
        return 2 * 6 + 2 * norms
    if kind.is_moe:  # attention, the router, 3 per expert, the shared expert and its gate
        return 4 + 1 + 3 * kind.experts + (4 if kind.shared_expert_ffn else 0) + 2 * norms + (3 if kind.qkv_bias else 0)
    return 7 + 2 * norms + (3 if kind.qkv_bias else 0)


# ---- the zero-bubble schedules' split backward ------------------------------------------------
# Torch's zero-bubble schedules run a (virtual) stage's backward in two passes: I
# (``stage_backward_input``: the parameters grouped by the graph's intermediates, then the input
# gradient with the graph kept) and W (``stage_backward_weight``: one ``torch.autograd.grad`` per
# parameter group, each a graph task whose engine first walks every node reachable from its
# roots, most of the stage's graph). Beyond the same kernels (the same ops, counted) that costs
# the host, per parameter group, a fixed part and a walk over the stage's graph, in op overheads:
# measured on the development machine's CPU by benchmarks/split_backward.py (blocks shrunk until
# their kernels take nothing; docs/search.md has the table and what the term leaves out).
SPLIT_GROUP_OPS = 21.1
SPLIT_NODE_OPS = 0.0124


def weight_groups(kind: LayerKind, tied_head: bool = False) -> int:
    """A layer's parameter groups as torch's split backward forms them (the parameters whose
    gradients come from one intermediate: a module's weight and bias together): one weight
    gradient call each. A block: its products and two norms; the head: its norm and (untied)
    its product; the embedding: the token table and any learned positions."""
    if kind.role == "embed":
        return 1 + (1 if kind.learned_positions else 0)
    if kind.role == "head":
        return 1 + (0 if tied_head else 1)
    if kind.is_moe:  # not run under zero-bubble schedules; at most one group a tensor
        return param_tensors(kind)
    return (7 if kind.family == "llama" else 6) + 2


def split_backward_host_s(groups: int, nodes: int, op_overhead_s: float) -> float:
    """Host time a split backward adds to one micro-batch of a (virtual) stage with ``groups``
    parameter tensors and ``nodes`` forward ops."""
    return groups * (SPLIT_GROUP_OPS + SPLIT_NODE_OPS * nodes) * op_overhead_s


def host_bound_s(device_s: float, ops: int, op_overhead_s: float, on_cpu: bool) -> float:
    """A pass's time given its device time and its ops' host time: their sum on a CPU (the host
    does the work), the larger on a GPU (the host runs ahead of the device)."""
    host = ops * op_overhead_s
    return device_s + host if on_cpu else max(device_s, host)


# ---- what the training software does ----------------------------------------------------------
# Where the software that trains differs from Partita's runtime in how it runs the same layers.
# The planner prices its own runtime (the defaults); the published-runs benchmark states, per
# run, what the run's framework did (benchmarks/published_runs.yaml, `software`).
GRAD_SYNCS = ("overlapped", "after_backward")


@dataclass(frozen=True, kw_only=True)
class Software:
    """How the training software runs a layer's attention and its gradient synchronisation."""

    # "sdpa" (the runtime's fused kernel, as measured), "flash1" (FlashAttention v1, its Triton
    # port), "flash2" (FlashAttention-2), "cudnn" (cuDNN's fused attention, Transformer Engine's),
    # "flash3" (FlashAttention-3, Hopper only) or
    # "unfused" (Megatron-LM's batched products around a softmax kernel): search/analytic.py, ATTENTION.
    attention: str = "sdpa"
    # "overlapped": data-parallel gradient reductions start as the last micro-batch's backward
    # frees each layer's gradients (torch DDP's buckets, FSDP2); "after_backward": they start when
    # the whole backward has ended (Megatron-LM's "local" DDP, DeepSpeed's pipeline engine).
    grad_sync: str = "overlapped"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION:
            raise PartitaError(f"unknown attention {self.attention!r}; valid: {', '.join(ATTENTION)}")
        if self.grad_sync not in GRAD_SYNCS:
            raise PartitaError(f"unknown grad_sync {self.grad_sync!r}; valid: {', '.join(GRAD_SYNCS)}")


@dataclass(frozen=True)
class TimeConstants:
    """The time constants one device type is priced with (defaults or a calibration)."""

    compute_scale: float  # multiplies the analytic (roofline) device time
    op_overhead_s: float
    overlap_slowdown: float
    step_overhead_s: float
    # the matrix products' slowdown beside a data-parallel collective (None: ``overlap_slowdown``)
    gemm_overlap_slowdown: float | None = None

    def collective_slowdown(self, gemm_share: float) -> float:
        """The slowdown of a pass beside a data-parallel collective whose matrix products take
        ``gemm_share`` of its time (``HOPPER_GEMM_OVERLAP_SLOWDOWN``)."""
        if self.gemm_overlap_slowdown is None:
            return self.overlap_slowdown
        share = min(1.0, max(0.0, gemm_share))
        return share * self.gemm_overlap_slowdown + (1.0 - share) * self.overlap_slowdown


def default_constants(on_cpu: bool, hopper: bool = False) -> TimeConstants:
    key = "cpu" if on_cpu else "gpu"
    return TimeConstants(compute_scale=1.0, op_overhead_s=OP_OVERHEAD_S[key],
                         overlap_slowdown=OVERLAP_SLOWDOWN_CPU if on_cpu else OVERLAP_SLOWDOWN_GPU,
                         step_overhead_s=STEP_OVERHEAD_S[key],
                         gemm_overlap_slowdown=HOPPER_GEMM_OVERLAP_SLOWDOWN if hopper and not on_cpu else None)
