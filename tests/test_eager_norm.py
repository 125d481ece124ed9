"""The eager RMSNorm (``Engine.norm`` "eager"): the bytes its aten ops move and what autograd
keeps, counted on torchtitan's module as written before torch.compile (torchtitan/models/norms.py,
RMSNorm, 2024), against ``kernels.norm_bytes_per_element`` and ``activation_bytes``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from partita.errors import PartitaError  # noqa: E402
from partita.model_io import load_model  # noqa: E402
from partita.search.analytic import (Shard, activation_bytes, backward_time_s, forward_time_s,  # noqa: E402
                                     norm_bytes_per_element)
from partita.devices import get_device  # noqa: E402
from partita.search.engines import get_engine  # noqa: E402
from partita.search.kernels import Kernels  # noqa: E402

TOKENS, HIDDEN = 64, 512
VIEWS = {"aten.view.default", "aten.expand.default", "aten.detach.default", "aten._unsafe_view.default"}


class EagerRMSNorm(torch.nn.Module):
    """The norm as a module of torch ops: upcast, x * rsqrt(mean(x^2) + eps), downcast, weight."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(HIDDEN, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed.type_as(x) * self.weight


class Bytes(TorchDispatchMode):
    """Bytes each non-view op reads (its inputs' storages, a broadcast input at its own size)
    and writes (its outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.moved = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) not in VIEWS:
            ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
            self.moved += sum(min(a.numel() * a.element_size(), a.untyped_storage().nbytes()) for a in ins)
            self.moved += sum(a.numel() * a.element_size() for a in outs)
        return out


@pytest.mark.parametrize("dtype, elem", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_the_eager_norm_moves_the_bytes_its_ops_move(dtype, elem):
    norm = EagerRMSNorm(dtype)
    x = torch.randn(TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
    forward = Bytes()
    with forward:
        y = norm(x)
    grad = torch.randn_like(y)
    backward = Bytes()
    with backward:
        y.backward(grad)
    per_element = TOKENS * HIDDEN
    want_forward, want_backward = norm_bytes_per_element("eager", elem)
    # The statistics ([tokens, 1]) and the weight ([hidden]) are the only bytes the formula leaves out.
    assert forward.moved / per_element == pytest.approx(want_forward, rel=0.01)
    assert backward.moved / per_element == pytest.approx(want_backward, rel=0.01)
    if elem == 2:  # in bf16: 9x the fused kernel's bytes forward, 11.5x backward
        fused_forward, fused_backward = norm_bytes_per_element("fused", elem)
        assert (want_forward / fused_forward, want_backward / fused_backward) == (9, 11.5)


@pytest.mark.parametrize("dtype, elem", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_the_eager_norm_keeps_an_fp32_input_and_its_downcast_output(dtype, elem):
    norm = EagerRMSNorm(dtype)
    x = torch.randn(TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    # What activation_bytes counts for the head: the final norm's keep, its output (the output
    # linear's input) and the loss. Only the norm differs between the two counts.
    head = load_model("tiny-llama").kinds["head"]
    kw = dict(tp=1, micro_batch=1, seq_len=TOKENS, dtype="bf16" if elem == 2 else "fp32")
    eager = activation_bytes(head, norm="eager", **kw)
    fused = activation_bytes(head, **kw)
    hidden = head.hidden
    # The tiny model's hidden is not HIDDEN: compare per element of the norm's input.
    assert (eager - fused) / (TOKENS * hidden) == pytest.approx(sum(kept.values()) / (TOKENS * HIDDEN) - elem,
                                                                rel=0.01)


def test_an_eager_norm_prices_a_llama_block_slower_and_a_gpt2_block_alike():
    h100 = get_device("H100")
    for name, slower in (("llama-3-8b", True), ("gpt2-xl", False)):
        kind = load_model(name).kinds["block"]
        sh = Shard.of(kind, tp=1, micro_batch=2, seq_len=8192, dtype="bf16")
        fused = forward_time_s(kind, h100, sh, "bf16"), backward_time_s(kind, h100, sh, "bf16")
        eager = (forward_time_s(kind, h100, sh, "bf16", kernels=Kernels(norm="eager")),
                 backward_time_s(kind, h100, sh, "bf16", kernels=Kernels(norm="eager")))
        if slower:
            # Two norms of 16,384 x 4,096 elements: 36 instead of 4 bytes an element forward and
            # 92 instead of 8 backward, at the 0.857 of the H100's 3.35 TB/s a copy reaches
            # (roofline.MEMORY_EFFICIENCY, the H200's measured copy).
            elements, rate = 2 * 16384 * 4096, 0.857 * 3.35e12
            assert eager[0] - fused[0] == pytest.approx(elements * (36 - 4) / rate, rel=0.05)
            assert eager[1] - fused[1] == pytest.approx(elements * (92 - 8) / rate, rel=0.05)
        else:
            assert eager == fused


def test_the_engine_option_names_the_norms():
    assert get_engine("torchtitan").with_options({"norm": "eager"}).norm == "eager"
    assert get_engine("partita").norm == "fused"
    with pytest.raises(PartitaError, match="unknown norm 'unfused'; valid: fused, eager"):
        get_engine("torchtitan").with_options({"norm": "unfused"})
