"""The runtime's chunked cross entropy: the same loss and gradients as torch's fp32 cross entropy,
what it keeps for the backward (the logits as given and a log-sum-exp a token, no fp32 copy of the
vocabulary), and the chunk the cost model prices (search/costs/memory.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from partita import units  # noqa: E402
from partita.runtime import schedule  # noqa: E402
from partita.search.costs import memory  # noqa: E402


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 7 tokens for a vocabulary of 50: several chunks and a short last one."""
    monkeypatch.setattr(units, "LOSS_CHUNK_BYTES", 4 * 50 * 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loss_and_its_gradient_are_torch_s_fp32_cross_entropy(small_chunks, dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 9, 50, generator=gen)).to(dtype)
    targets = torch.randint(0, 50, (4, 9), generator=gen)
    assert schedule.loss_chunk_tokens(36, 50) == 7

    mine = logits.clone().requires_grad_()
    loss = schedule.lm_loss(mine, targets)
    loss.backward()
    ref = logits.clone().requires_grad_()
    expected = F.cross_entropy(ref.flatten(0, 1).float(), targets.flatten())
    expected.backward()

    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert mine.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(mine.grad.float(), ref.grad.float(), rtol=tol, atol=tol * 1e-2)


def test_the_backward_keeps_the_logits_themselves_and_a_float_a_token():
    logits = torch.randn(3, 5, 11, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        schedule.lm_loss(logits, targets)
    floats = [t for t in saved if t.is_floating_point()]
    assert sum(t.numel() * t.element_size() for t in floats) == 2 * 15 * 11 + 4 * 15
    assert all(t.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
               for t in floats if t.dtype == torch.bfloat16)


def test_the_cost_model_prices_the_runtime_s_chunk():
    assert memory.loss_chunk_tokens is schedule.loss_chunk_tokens is units.loss_chunk_tokens
    for tokens, vocab in [(1, 32000), (8192, 128256), (40 * 2048, 50257), (10**6, 7)]:
        assert memory.loss_chunk_tokens(tokens, vocab) == schedule.loss_chunk_tokens(tokens, vocab)
