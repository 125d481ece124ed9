"""Time and memory of one layer shard: forward, backward, recompute, activations, parameters.

Each distinct layer kind of the model (embed, block, head: however deep the model, three) is
built once per shard width with the runtime's own constructor
(``partita.runtime.models.build_layer``: heads, kv heads and ffn, or the vocabulary, divided by
the TP degree) and measured at every micro-batch. A TP shard is timed alone on one device; its
collectives are priced apart, from the profile's comm section.

Per (kind, width, micro-batch), after ``warmup`` untimed iterations, ``repeats`` iterations of:

* forward: ``out = layer(x)`` with autograd recording, as in training; for the head, the loss
  too (``cross_entropy(logits.float(), targets)`` over this rank's vocabulary shard), which the
  planner counts with the head;
* backward: ``out.backward(grad)`` (the loss's backward for the head), gradients of the input and the weights (accumulating into
  ``.grad``, as under gradient accumulation);
* recompute: the same backward through ``torch.utils.checkpoint`` (non-reentrant, as the
  runtime's ``checkpoint_wrapper``), whose extra
  cost over the plain backward is the recomputed forward; per iteration the plain backward is
  subtracted, and the median of the differences kept;
* selective recompute (blocks): the same again with the runtime's selective policy
  (``partita.runtime.parallelize.selective_context``: the products' outputs kept); lost in
  noise, it is left unmeasured and the planner takes the analytic share of the recompute.

Each reported time is the median over the repeats. Activation memory comes from one more
forward: autograd's saved tensors, storages de-duplicated and parameters excluded
(``partita.profiler.memory``); on a GPU the CUDA allocator's growth over that forward (less the
output, which the next layer keeps; plus the input where it is saved) is reported instead, with
the saved-tensor count logged beside it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from partita import parallel
from partita.errors import PartitaError
from partita.model import ROLES, ModelSpec
from partita.profile import LayerCost
from partita.profiler.memory import SavedTensors, param_bytes, tensor_storage_bytes
from partita.profiler.timing import Clock, median, out_of_memory
from partita.runtime.parallelize import selective_context

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BuildLayer = Callable[..., torch.nn.Module]


@dataclass(frozen=True, kw_only=True)
class LayerOptions:
    device: torch.device
    dtype: str  # bf16, fp16, fp32
    seq_len: int
    micro_batches: tuple[int, ...]
    tps: tuple[int, ...]
    warmup: int = 2
    repeats: int = 5
    # CPU only: time with the thread's CPU clock (valid with one intra-op thread; see timing.Clock).
    cpu_time: bool = False


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One measured point, with the detail the profile's ``LayerCost`` leaves out."""

    cost: LayerCost
    role: str
    saved_bytes: int  # autograd's saved tensors (the CPU number)
    allocator_bytes: int | None  # CUDA allocator growth (the GPU number), None on CPU
    recompute_fallback: bool  # True where the recompute difference was lost in noise


@dataclass(frozen=True, kw_only=True)
class Shard:
    role: str
    tp: int


def plan_shards(spec: ModelSpec, opts: LayerOptions) -> tuple[list[Shard], list[str]]:
    """The (role, width) pairs to build, and notes on those skipped.

    A width that does not divide the blocks' heads, kv heads or ffn is bad input: no plan
    could use it. A width that divides the blocks but not the vocabulary (gpt2: 50257) is
    skipped for embed and head only, with a note: the runtime cannot shard those layers so.
    """
    if opts.seq_len > spec.seq_len and spec.family == "gpt2":
        raise PartitaError(f"model {spec.name!r}: --seq-len {opts.seq_len} is longer than its learned position "
                           f"table ({spec.seq_len}); use --seq-len {spec.seq_len} or less")
    for tp in opts.tps:
        why = parallel.tp_rule(spec.kinds["block"], tp)
        if why:
            raise PartitaError(f"model {spec.name!r}: --tp {tp} does not divide its blocks: {why}; "
                               f"use widths that divide heads {spec.heads}, kv_heads {spec.kv_heads} and ffn {spec.ffn}")
    shards, notes = [], []
    for role in ROLES:
        for tp in opts.tps:
            why = parallel.tp_rule(spec.kinds[role], tp)
            if why:
                notes.append(f"{role} not measured at tp={tp}: {why}")
                continue
            shards.append(Shard(role=role, tp=tp))
    return shards, notes


def profile_layers(spec: ModelSpec, opts: LayerOptions, build_layer: BuildLayer | None = None,
                   on_point: Callable[[str], None] | None = None) -> Iterator[Measurement]:
    """Measure every shard at every micro-batch; ``on_point(description)`` before each point."""
    if build_layer is None:
        from partita.runtime.models import build_layer
    shards, notes = plan_shards(spec, opts)
    for note in notes:
        log.warning(note)
    if opts.device.type == "cuda":
        torch.cuda.set_device(opts.device)  # events record on the current device's stream
    clock = Clock(opts.device, cpu_time=opts.cpu_time and torch.get_num_threads() == 1)
    for shard in shards:
        layer = build_layer(spec, shard.role, tp=shard.tp, device=opts.device, dtype=TORCH_DTYPES[opts.dtype])
        for mb in sorted(opts.micro_batches):
            if on_point is not None:
                on_point(f"{shard.role} tp={shard.tp} micro-batch={mb}")
            try:
                point = measure_point(spec, layer, shard, mb, opts, clock)
            except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
                if not out_of_memory(e):
                    raise
                point = None  # handled below, once the failed point's tensors are released
            if point is None and mb == min(opts.micro_batches):
                # nothing of this shard fits: a profile without it would be half-done
                raise PartitaError(f"out of memory measuring {shard.role} tp={shard.tp} at micro-batch {mb} and "
                                   f"sequence {opts.seq_len} on {opts.device}; nothing was written; give a shorter "
                                   f"--seq-len, wider --tp or a smaller micro-batch")
            if point is None:
                log.warning("%s tp=%d: out of memory at micro-batch %d; larger micro-batches not measured "
                            "(the planner extrapolates proportionally)", shard.role, shard.tp, mb)
                for p in layer.parameters():
                    p.grad = None
                torch.cuda.empty_cache()
                break
            yield point
        del layer
        if opts.device.type == "cuda":
            torch.cuda.empty_cache()


def measure_point(spec: ModelSpec, layer: torch.nn.Module, shard: Shard, micro_batch: int, opts: LayerOptions,
                  clock: Clock) -> Measurement:
    x = make_input(spec, shard, micro_batch, opts)
    target = torch.randint(0, spec.vocab // shard.tp, x.shape[:2], device=opts.device) if shard.role == "head" else None
    grad = None
    forward, backward, recompute, selective = [], [], [], []
    for i in range(opts.warmup + opts.repeats):
        box: list[torch.Tensor] = []
        f_s = clock.time(lambda: box.append(_forward(layer, x, target)))
        out = box.pop()
        if grad is None and out.dim():
            grad = torch.randn_like(out)
        b_s = clock.time(lambda: out.backward(grad))
        del out
        x.grad = None
        ckpt_out = _forward(layer, x, target, checkpointed=True)
        c_s = clock.time(lambda: ckpt_out.backward(grad))
        del ckpt_out
        x.grad = None
        if shard.role == "block":
            sel_out = _forward(layer, x, target, checkpointed=True, selective=True)
            selective.append(clock.time(lambda: sel_out.backward(grad)) - b_s)
            del sel_out
            x.grad = None
        if i >= opts.warmup:
            forward.append(f_s)
            backward.append(b_s)
            recompute.append(c_s - b_s)
    forward_s, backward_s, recompute_s = median(forward), median(backward), median(recompute)
    selective_s = median(selective[opts.warmup:]) if selective else None
    if selective_s is not None and selective_s <= 0:
        log.info("%s tp=%d mb=%d: selective recompute lost in noise (%.1f us); left to the analytic share",
                 shard.role, shard.tp, micro_batch, selective_s * 1e6)
        selective_s = None
    fallback = recompute_s <= 0
    if fallback:
        # Noise larger than the recomputed forward (tiny layers on a busy CPU): the recomputed
        # forward is a forward, so take its measured time.
        log.info("%s tp=%d mb=%d: recompute lost in noise (%.1f us); using the forward time",
                 shard.role, shard.tp, micro_batch, recompute_s * 1e6)
        recompute_s = forward_s
    saved, allocated = activation_memory(layer, x, target, clock)
    cost = LayerCost(kind=spec.kinds[shard.role], tp=shard.tp, micro_batch=micro_batch, seq_len=opts.seq_len,
                     forward_s=forward_s, backward_s=backward_s, recompute_s=recompute_s,
                     activation_bytes=allocated if allocated is not None else saved,
                     param_bytes=param_bytes(layer), selective_recompute_s=selective_s)
    return Measurement(cost=cost, role=shard.role, saved_bytes=saved, allocator_bytes=allocated,
                       recompute_fallback=fallback)


def _forward(layer: torch.nn.Module, x: torch.Tensor, target: torch.Tensor | None, *,
             checkpointed: bool = False, selective: bool = False) -> torch.Tensor:
    """The layer's training forward; for the head, through the loss (fp32, as the runtime)."""
    # As the runtime: non-reentrant checkpointing without RNG state (there is no dropout), the
    # selective policy of runtime.parallelize, and the loss of runtime.schedule.lm_loss.
    if selective:
        products = sum(isinstance(m, torch.nn.Linear) for m in layer.modules())
        out = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False,
                         context_fn=partial(selective_context, products))
    else:
        out = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False) if checkpointed else layer(x)
    if target is not None:
        out = F.cross_entropy(out.flatten(0, 1).float(), target.flatten())
    return out


def make_input(spec: ModelSpec, shard: Shard, micro_batch: int, opts: LayerOptions) -> torch.Tensor:
    shape = (micro_batch, opts.seq_len)
    if shard.role == "embed":
        # Token ids inside this rank's vocabulary shard (a vocab-parallel embedding masks the rest).
        return torch.randint(0, spec.vocab // shard.tp, shape, device=opts.device)
    return torch.randn(*shape, spec.hidden, device=opts.device, dtype=TORCH_DTYPES[opts.dtype], requires_grad=True)


def activation_memory(layer: torch.nn.Module, x: torch.Tensor, target: torch.Tensor | None,
                      clock: Clock) -> tuple[int, int | None]:
    """(saved-tensor bytes, CUDA allocator bytes or None) kept by one forward for backward."""
    cuda = clock.cuda
    clock.sync()
    before = torch.cuda.memory_allocated(clock.device) if cuda else 0
    with SavedTensors(exclude=list(layer.parameters())) as saved:
        out = _forward(layer, x, target)
    clock.sync()
    allocated = None
    if cuda:
        grown = torch.cuda.memory_allocated(clock.device) - before
        # The output is the next layer's input (its memory, where saved); the input is ours if saved.
        out_bytes = 0 if saved.holds(out) else tensor_storage_bytes(out)
        in_bytes = tensor_storage_bytes(x) if saved.holds(x) else 0
        allocated = grown - out_bytes + in_bytes
        if saved.nbytes and abs(allocated - saved.nbytes) > 0.1 * saved.nbytes:
            log.info("allocator says %d B kept, saved tensors %d B", allocated, saved.nbytes)
    del out
    return saved.nbytes, allocated
