"""Time the causal attention core alone at long sequences, for context parallelism's pricing.

    partita profile --model llama-3-8b --device cuda --attention-seq-lens 8192,16384,32768 --cp 1,8 \
        --attention-only -o h200-attention.yaml

A block's layer points are measured at the plan's sequence length; context parallelism runs its
attention core on other shapes: all s positions for H/cp heads (all-to-all) and causal blocks of
L = s/cp tokens for all H heads (the ring's step, and what the block's layer cost at s/cp
already holds). Per (heads, sequence length), after ``warmup`` untimed iterations, ``repeats``
of:

* forward: ``scaled_dot_product_attention(q, k, v, is_causal=True)`` on [b, H, s, d] tensors
  with autograd recording, the runtime's call (``runtime.models.Attention``: kv heads are
  repeated to the query heads before it, so the kernel sees H heads);
* backward: ``out.backward(grad)``, the q, k and v gradients.

Each time is the median over the repeats (``timing.Clock``: CUDA events on a GPU). The cost
model reads the points as achieved FLOP rates (``partita.profile.attention_time_at``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from partita import parallel
from partita.errors import PartitaError
from partita.model import ModelSpec
from partita.profile import AttentionCost
from partita.profiler.timing import Clock, median, out_of_memory

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class AttentionOptions:
    device: torch.device
    dtype: str  # bf16, fp16, fp32
    seq_lens: tuple[int, ...]
    heads: tuple[int, ...]  # query heads a device holds (kv heads repeated to them)
    head_dim: int
    micro_batch: int = 1
    warmup: int = 1
    repeats: int = 5
    cpu_time: bool = False  # CPU only: the thread's CPU clock (see timing.Clock)


def attention_heads(spec: ModelSpec, *, tps: tuple[int, ...], cps: tuple[int, ...]) -> tuple[int, ...]:
    """The head counts a device's attention core runs with: H/(tp cp) over s for the all-to-all
    at each cp, and H/tp over s/cp for the ring's steps (cp 1's entry). Only shapes a plan can
    use: tp dividing the blocks, and tp x cp dividing heads and kv heads."""
    block = spec.kinds["block"]
    heads = set()
    for tp in tps:
        if parallel.tp_rule(block, tp):
            continue
        for cp in cps:
            if spec.heads % (tp * cp) == 0 and spec.kv_heads % (tp * cp) == 0:
                heads.add(spec.heads // (tp * cp))
    if not heads:
        raise PartitaError(f"model {spec.name!r}: no attention shape to measure at tp {list(tps)} and cp {list(cps)}: "
                           f"tp x cp must divide heads {spec.heads} and kv_heads {spec.kv_heads}")
    return tuple(sorted(heads, reverse=True))


def profile_attention(opts: AttentionOptions,
                      on_point: Callable[[str], None] | None = None) -> Iterator[AttentionCost]:
    """Measure every (heads, sequence length); ``on_point(description)`` before each. A point
    that runs out of device memory is skipped with a warning, and so are the longer ones at
    those heads."""
    if opts.device.type == "cuda":
        torch.cuda.set_device(opts.device)
    clock = Clock(opts.device, cpu_time=opts.cpu_time and torch.get_num_threads() == 1)
    for heads in opts.heads:
        for seq in sorted(opts.seq_lens):
            if on_point is not None:
                on_point(f"attention heads={heads} seq={seq}")
            try:
                point = measure_attention(opts, clock, heads=heads, seq_len=seq)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                if not out_of_memory(e):
                    raise
                point = None  # reported once the failed point's tensors are released
            if point is None and seq == min(opts.seq_lens):
                raise PartitaError(f"out of memory timing attention with {heads} heads at sequence {seq} "
                                   f"(micro-batch {opts.micro_batch}) on {opts.device}; nothing was written; give "
                                   f"shorter --attention-seq-lens")
            if point is None:
                log.warning("attention heads=%d: out of memory at sequence %d; longer ones not measured "
                            "(the planner reads the longest measured rate)", heads, seq)
                torch.cuda.empty_cache()
                break
            yield point


def measure_attention(opts: AttentionOptions, clock: Clock, *, heads: int, seq_len: int) -> AttentionCost:
    dtype = TORCH_DTYPES[opts.dtype]
    shape = (opts.micro_batch, heads, seq_len, opts.head_dim)
    q, k, v = (torch.randn(shape, device=opts.device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=opts.device, dtype=dtype)
    forward, backward = [], []
    for i in range(opts.warmup + opts.repeats):
        box: list[torch.Tensor] = []
        f_s = clock.time(lambda: box.append(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        out = box.pop()
        b_s = clock.time(lambda: out.backward(grad))
        del out
        q.grad = k.grad = v.grad = None
        if i >= opts.warmup:
            forward.append(f_s)
            backward.append(b_s)
    return AttentionCost(heads=heads, head_dim=opts.head_dim, micro_batch=opts.micro_batch, seq_len=seq_len,
                         forward_s=median(forward), backward_s=median(backward))
