"""Context parallelism: one sequence split over the ``cp`` ranks of a group, two ways.

    from partita.runtime.context import apply_all_to_all, shard_sequence
    apply_all_to_all(model, cp_mesh, tp=plan.tp)          # every block's attention, once
    inputs = shard_sequence(inputs, cp=cp, index=cp_rank)  # the targets alike
    loss = lm_loss(model(inputs), targets)                 # the mean over this rank's tokens

**All-to-all** (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509). Everything but the
attention core acts on each token alone, so it runs on the rank's s/cp tokens unchanged. Around
the core, one all-to-all per tensor turns q, k and v from sequence shards with all of the rank's
heads into the full sequence with 1/cp of them; each rank runs ordinary causal attention for its
heads, and one more all-to-all turns the output back into sequence shards (4 all-to-alls a
forward; autograd runs their mirror in the backward). Needs heads and kv heads divisible by cp
(by cp x tp under tensor parallelism); runs anywhere ``all_to_all_single`` does, gloo included.

**Ring** (Liu et al. 2023, arXiv:2310.01889): each rank keeps its queries and the key/value
blocks travel. Here it is torch's ``context_parallel`` (``torch.distributed.tensor.experimental``),
which replaces SDPA by ring kernels for the CUDA flash / memory-efficient / cuDNN backends only;
the CPU kernel has no ring rule, so ``ring_attention`` refuses anything but a CUDA mesh.

**Layouts** (``LAYOUTS``): which tokens a rank holds.
  * ``contiguous``: rank r holds tokens [r*s/cp, (r+1)*s/cp). Enough for all-to-all: after the
    first all-to-all every rank sees the whole sequence (for its heads), so the causal mask is
    the ordinary one and every rank does the same work whatever it held.
  * ``head_tail``: the sequence in 2*cp chunks, rank r holding chunks r and 2*cp-1-r (torch's
    ``_HeadTailLoadBalancer``, the "zigzag" of Llama 3's context parallelism and of torchtitan).
    The ring needs it: under a causal mask a contiguous shard near the end of the sequence
    attends to every earlier block and one near the start to almost none, while a head chunk
    paired with its mirrored tail chunk gives each rank the same number of (query, key) pairs.
    The all-to-all variant accepts it too (it puts the gathered sequence back in order before
    attention), so a data loader can use one layout for both.
Positions follow the tokens: a shard's rotary angles are those of its global positions
(``shard_positions``), never 0..s/cp-1.

The loss is unchanged: each rank's ``lm_loss`` is the mean over its s/cp tokens, and equal
shards make the mean of the cp means the global mean; averaging gradients over the cp ranks
(FSDP / DP reduce over dp x cp) gives the global gradient.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from partita.errors import PartitaError
from partita.runtime.models import Attention, Embed, causal_attention
from partita.runtime.tp_linear import columns

CONTIGUOUS, HEAD_TAIL = "contiguous", "head_tail"
LAYOUTS = (CONTIGUOUS, HEAD_TAIL)


# ---- limits -----------------------------------------------------------------------------------


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise PartitaError(f"unknown context-parallel layout {layout!r}; valid: {', '.join(LAYOUTS)}")


def check_sequence(seq_len: int, cp: int, layout: str) -> None:
    """The sequence must split into equal shards (into 2*cp equal chunks for ``head_tail``)."""
    check_layout(layout)
    chunks = 2 * cp if layout == HEAD_TAIL else cp
    if cp < 1 or seq_len < 1 or seq_len % chunks:
        raise PartitaError(f"sequence length {seq_len} cannot be split into {chunks} equal chunks for context "
                           f"parallelism cp={cp} ({layout} layout); use a sequence length divisible by {chunks} "
                           f"or another cp")


def check_all_to_all(heads: int, kv_heads: int, *, cp: int, tp: int = 1) -> None:
    """All-to-all hands each of the cp x tp ranks of a block whole query and kv heads."""
    for what, n in (("heads", heads), ("kv_heads", kv_heads)):
        if n % (cp * tp):
            raise PartitaError(f"all-to-all context parallelism needs {what} divisible by cp x tp = {cp} x {tp} = "
                               f"{cp * tp}, but {what} is {n}; choose cp x tp dividing {heads} heads and "
                               f"{kv_heads} kv heads, or use ring attention")


# ---- layouts and positions --------------------------------------------------------------------


def shard_positions(seq_len: int, cp: int, index: int, layout: str = CONTIGUOUS,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (int64, in order) of the tokens cp rank ``index`` holds."""
    check_sequence(seq_len, cp, layout)
    if not 0 <= index < cp:
        raise PartitaError(f"cp rank {index} is outside the group of {cp}")
    if layout == CONTIGUOUS:
        per = seq_len // cp
        return torch.arange(index * per, (index + 1) * per, device=device)
    chunk = seq_len // (2 * cp)
    head = torch.arange(index * chunk, (index + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - index) * chunk, (2 * cp - index) * chunk, device=device)
    return torch.cat((head, tail))


def shard_sequence(t: torch.Tensor, *, cp: int, index: int, layout: str = CONTIGUOUS, dim: int = 1) -> torch.Tensor:
    """Cp rank ``index``'s shard of ``t`` along ``dim`` (tokens, targets, positions: [b, s, ...])."""
    return t.index_select(dim, shard_positions(t.shape[dim], cp, index, layout, device=t.device))


def to_global_order(x: torch.Tensor, cp: int, layout: str) -> torch.Tensor:
    """[b, s, ...] holding the cp shards one after another (rank order) -> [b, s, ...] in
    sequence order. Views, a flip and a cat: autograd keeps no index tensor for it."""
    if layout == CONTIGUOUS:
        return x
    b, s, rest = x.shape[0], x.shape[1], x.shape[2:]
    chunks = x.reshape(b, cp, 2, s // (2 * cp), *rest)  # rank r: (chunk r, chunk 2cp-1-r)
    return torch.cat((chunks[:, :, 0], chunks[:, :, 1].flip(1)), dim=1).reshape(b, s, *rest)


def to_shard_order(x: torch.Tensor, cp: int, layout: str) -> torch.Tensor:
    """The inverse of ``to_global_order``."""
    if layout == CONTIGUOUS:
        return x
    b, s, rest = x.shape[0], x.shape[1], x.shape[2:]
    chunks = x.reshape(b, 2 * cp, s // (2 * cp), *rest)
    return torch.stack((chunks[:, :cp], chunks[:, cp:].flip(1)), dim=2).reshape(b, s, *rest)


def rotary_at(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of [b, s, heads, head_dim] at the given positions [s]: the arithmetic
    of ``partita.runtime.models._rotary``, which is this at positions 0..s-1."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = torch.outer(positions.to(device=x.device, dtype=torch.float32), inv_freq)
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[None, :, None, :].to(x.dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[None, :, None, :].to(x.dtype)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---- the all-to-all --------------------------------------------------------------------------


def _group(cp: DeviceMesh | dist.ProcessGroup) -> dist.ProcessGroup:
    if isinstance(cp, DeviceMesh):
        if cp.ndim != 1:
            raise PartitaError(f"context parallelism takes a 1-D mesh (the 'cp' slice), got {cp.ndim} dimensions")
        return cp.get_group()
    return cp


class _AllToAll(torch.autograd.Function):
    """All-to-all of [cp, ...]: slice j goes to rank j, slice i of the result came from rank i.
    The exchange is a transpose of (rank, slice), its own inverse, so the backward is the same
    all-to-all of the gradient. (``torch.distributed.nn.functional.all_to_all_single`` does the
    same but is deprecated in torch 2.13; the functional collectives' version is for compile.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[b, s/cp, H, d] sequence shard -> [b, s, H/cp, d]: all cp shards (rank order) of this
    rank's H/cp heads (head group j goes to cp rank j)."""
    cp = dist.get_world_size(group)
    b, s_local, heads, d = x.shape
    parts = x.reshape(b, s_local, cp, heads // cp, d).permute(2, 0, 1, 3, 4)  # [head group, b, s/cp, H/cp, d]
    parts = _AllToAll.apply(parts, group)  # [source rank = sequence shard, b, s/cp, H/cp, d]
    return parts.permute(1, 0, 2, 3, 4).reshape(b, cp * s_local, heads // cp, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: [b, s, H/cp, d] -> [b, s/cp, H, d]."""
    cp = dist.get_world_size(group)
    b, s, heads_local, d = x.shape
    parts = x.reshape(b, cp, s // cp, heads_local, d).permute(1, 0, 2, 3, 4)  # [sequence shard, b, s/cp, H/cp, d]
    parts = _AllToAll.apply(parts, group)  # [source rank = head group, b, s/cp, H/cp, d]
    return parts.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * heads_local, d)


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: DeviceMesh | dist.ProcessGroup,
                         *, layout: str = CONTIGUOUS) -> torch.Tensor:
    """Causal attention of sequence shards: q [b, s/cp, H, d], k and v [b, s/cp, KV, d] (H and
    KV this rank's heads, rotary already applied at the shard's global positions) -> the output
    [b, s/cp, H, d] of this rank's tokens, exactly what full-sequence attention gives them.

    Each rank attends for H/cp query heads and their KV/cp kv heads over the whole sequence
    (query head i uses kv head i // (H/KV) before and after the split), with the model's own
    core (``partita.runtime.models.causal_attention``)."""
    group = _group(cp)
    size = dist.get_world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % size or kv_heads % size:
        raise PartitaError(f"all-to-all context parallelism: this rank holds {heads} heads and {kv_heads} kv heads, "
                           f"not divisible by cp {size}; choose cp x tp dividing the model's heads and kv heads")
    check_sequence(q.shape[1] * size, size, layout)
    q, k, v = (to_global_order(seq_to_heads(t, group), size, layout).transpose(1, 2) for t in (q, k, v))
    out = causal_attention(q, k, v)  # the model's own core, on this rank's heads
    return heads_to_seq(to_shard_order(out.transpose(1, 2), size, layout), group)


# ---- the model's layers under context parallelism -------------------------------------------


def _shard_qkv(attn: Attention, x: torch.Tensor, layout: str) -> tuple[torch.Tensor, ...]:
    """q, k, v of a sequence shard ([b, s/cp, heads, head_dim]), rotary at the shard's global
    positions in ``layout``."""
    q, k, v = columns(attn, x, attn.wq, attn.wk, attn.wv)  # the cp shard's, whole over tp
    b, s_local = q.shape[:2]
    q, k, v = (t.view(b, s_local, -1, attn.head_dim) for t in (q, k, v))
    if attn.rope_theta is not None:
        cp, index = dist.get_world_size(attn.cp_group), dist.get_rank(attn.cp_group)
        positions = shard_positions(s_local * cp, cp, index, layout, device=x.device)
        q, k = rotary_at(q, positions, attn.rope_theta), rotary_at(k, positions, attn.rope_theta)
    return q, k, v


class _ShardAttention(Attention):
    """``Attention`` on a sequence shard: rotary at the shard's global positions, then the
    variant's attention of the shards (``attend``). Same parameters and names as ``Attention``
    (a class swap, made by ``_swap_all``), so tensor-parallel styles, FSDP and checkpoints see no
    difference."""

    cp_group: dist.ProcessGroup
    cp_layout: str
    attend: staticmethod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _shard_qkv(self, x, self.cp_layout)
        out = self.attend(q, k, v, self.cp_group, layout=self.cp_layout)
        return self.wo(out.reshape(*q.shape[:2], -1))


class AllToAllAttention(_ShardAttention):
    """``_ShardAttention`` by ``all_to_all_attention`` (``apply_all_to_all``)."""

    attend = staticmethod(all_to_all_attention)


class ShardEmbed(Embed):
    """``Embed`` on a sequence shard: gpt2's learned positions are the shard's global ones."""

    cp_group: dist.ProcessGroup
    cp_layout: str

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        if self.pos is not None:
            cp, index = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
            h = h + self.pos(shard_positions(tokens.shape[1] * cp, cp, index, self.cp_layout, device=tokens.device))
        return h


def _swap_all(model: nn.Module, attention: type, group: dist.ProcessGroup, layout: str) -> None:
    """Every ``Attention`` of ``model`` becomes ``attention`` and every ``Embed`` a
    ``ShardEmbed``, in place (a class swap: parameters and names unchanged), on ``group``'s
    sequence shards in ``layout``."""
    for module in model.modules():
        cls = {Attention: attention, Embed: ShardEmbed}.get(type(module))
        if cls is not None:
            module.__class__ = cls
            module.cp_group = group
            module.cp_layout = layout


def apply_all_to_all(model: nn.Module, cp: DeviceMesh | dist.ProcessGroup, *, tp: int = 1,
                     layout: str = CONTIGUOUS) -> nn.Module:
    """All-to-all context parallelism on every attention (and gpt2 position table) ``model``
    holds, in place: each then takes this rank's sequence shard in ``layout``. Run after tensor
    parallelism and before checkpointing and FSDP (the class swap must come before FSDP's).
    ``model.spec`` (a ``Transformer``'s) is checked against cp x ``tp``."""
    check_layout(layout)
    group = _group(cp)
    size = dist.get_world_size(group)
    spec = getattr(model, "spec", None)
    if spec is not None:
        check_all_to_all(spec.heads, spec.kv_heads, cp=size, tp=tp)
    _swap_all(model, AllToAllAttention, group, layout)
    return model


# ---- the all-gather (Llama 3's) ------------------------------------------------------------------


class _GatherShards(torch.autograd.Function):
    """[b, L, ...] shards -> [cp, b, L, ...]: every rank's shard (rank order). The backward is the
    gradient's reduce-scatter, run as an all-to-all of each rank's contribution to every shard and
    a sum (the same bytes; gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group), *x.shape))
        dist.all_gather(list(out.unbind(0)), x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        parts = torch.empty_like(grad)
        dist.all_to_all_single(parts, grad, group=ctx.group)  # [source rank, ...]: its gradient of this shard
        return parts.sum(0), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, layout: str) -> torch.Tensor:
    """[b, s/cp, ...] shard in ``layout`` -> [b, s, ...], the whole sequence in order."""
    cp = dist.get_world_size(group)
    parts = _GatherShards.apply(x, group)  # [cp, b, L, ...]
    b, local, rest = x.shape[0], x.shape[1], x.shape[2:]
    return to_global_order(parts.transpose(0, 1).reshape(b, cp * local, *rest), cp, layout)


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: DeviceMesh | dist.ProcessGroup,
                         *, layout: str = HEAD_TAIL) -> torch.Tensor:
    """Causal attention of sequence shards by gathering keys and values (Llama 3's context
    parallelism, Llama Team 2024, arXiv:2407.21783, sec. 3.3.2): q [b, s/cp, H, d], k and v
    [b, s/cp, KV, d] (this rank's heads, rotary at the shard's global positions) -> the output
    [b, s/cp, H, d] of this rank's tokens. K and V are all-gathered at their KV heads (under
    grouped-query attention far fewer bytes than the queries' H), then each contiguous chunk of
    the shard attends to the keys up to its own end, causal at the lower right
    (``torch.nn.attention.bias.causal_lower_right``: no mask is built). Under ``head_tail`` a
    rank's two chunks together meet s + s/(2 cp) keys, the same on every rank."""
    group = _group(cp)
    size, index = dist.get_world_size(group), dist.get_rank(group)
    local = q.shape[1]
    check_sequence(local * size, size, layout)
    keys, values = (gather_sequence(t, group, layout).transpose(1, 2) for t in (k, v))  # [b, KV, s, d]
    chunks = 2 if layout == HEAD_TAIL else 1
    starts = shard_positions(local * size, size, index, layout)[::local // chunks].tolist()  # each chunk's first
    return chunk_attention(q, keys, values, starts)


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: Sequence[int]) -> torch.Tensor:
    """q [b, L, H, d], its equal contiguous chunks starting at global positions ``starts``,
    against the whole sequence's keys and values [b, KV, s, d]: each chunk attends to the keys up
    to its own end, causal at the lower right. [b, L, H, d]."""
    from torch.nn.attention.bias import causal_lower_right
    import torch.nn.functional as F

    length = q.shape[1] // len(starts)
    gqa = q.shape[2] != keys.shape[1]
    out = []
    for c, start in enumerate(starts):
        qc = q[:, c * length:(c + 1) * length].transpose(1, 2)
        end = start + length
        out.append(F.scaled_dot_product_attention(qc, keys[:, :, :end], values[:, :, :end],
                                                  attn_mask=causal_lower_right(length, end), enable_gqa=gqa))
    return torch.cat(out, dim=2).transpose(1, 2)


class AllGatherAttention(_ShardAttention):
    """``_ShardAttention`` by ``all_gather_attention`` (``apply_all_gather``)."""

    attend = staticmethod(all_gather_attention)


def apply_all_gather(model: nn.Module, cp: DeviceMesh | dist.ProcessGroup, *, layout: str = HEAD_TAIL) -> nn.Module:
    """All-gather context parallelism on every attention (and gpt2 position table) ``model``
    holds, in place, as ``apply_all_to_all``; any head counts (the gathered K/V keep theirs)."""
    check_layout(layout)
    _swap_all(model, AllGatherAttention, _group(cp), layout)
    return model


# ---- ring attention (CUDA only) ---------------------------------------------------------------


class RingAttention(Attention):
    """``Attention`` on a head_tail shard under torch's ``context_parallel``: rotary at the
    shard's global positions; the model's ``causal_attention``, whose SDPA call (looked up on
    ``F`` at call time, which ``context_parallel`` patches) becomes torch's ring attention."""

    cp_group: dist.ProcessGroup
    cp_layout: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _shard_qkv(self, x, HEAD_TAIL)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(*q.shape[:2], -1))


def check_ring_device(device_type: str) -> None:
    if device_type != "cuda":
        raise PartitaError(f"ring attention (torch's context_parallel) runs on CUDA only: torch has no ring rule "
                           f"for the {device_type} attention kernel; use all-to-all context parallelism on "
                           f"{device_type} ranks")


def apply_ring(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Ring attention on every attention (and gpt2 position table) of ``model``, in place; each
    step must then run inside ``ring_attention``, which shards its batch head_tail."""
    check_ring_device(cp_mesh.device_type)
    _swap_all(model, RingAttention, _group(cp_mesh), HEAD_TAIL)
    return model


@contextmanager
def ring_attention(cp_mesh: DeviceMesh, buffers: Sequence[torch.Tensor], *, seq_dims: Sequence[int] | None = None,
                   rotate: str = "alltoall") -> Iterator[None]:
    """torch's ``context_parallel`` over ``cp_mesh``: shards ``buffers`` (whole tokens and
    targets, [b, s]) in place, head_tail, and routes SDPA to ring attention until exit (buffers
    are not restored). ``rotate``: "alltoall" passes one K/V block per step around the ring (two
    blocks in memory), "allgather" (torch's default) gathers all cp blocks at the first step."""
    check_ring_device(cp_mesh.device_type)
    seq_dims = list(seq_dims) if seq_dims is not None else [1] * len(buffers)
    size = cp_mesh.size()
    for buffer, dim in zip(buffers, seq_dims):
        # torch quietly drops load balancing otherwise, and the rotary positions would be wrong.
        check_sequence(buffer.shape[dim], size, HEAD_TAIL)
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    with context_parallel(cp_mesh, buffers=list(buffers), buffer_seq_dims=seq_dims, no_restore_buffers=set(buffers)):
        yield
