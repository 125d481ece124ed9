"""The fp32 loss's backward as ``costs.memory.loss_transient`` prices it, against what eager torch
holds: at tp 1 (torchtitan's and Hugging Face's ``F.cross_entropy(logits.float(), y)``) live
storages tracked op by op with a dispatch mode on the CPU; under a vocab-parallel head (torch's
``loss_parallel``, Partita's runtime and torchtitan at tp > 1) torch's MemTracker on two gloo
ranks, which follows DTensor's local storages."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from partita.cluster import parse_short
from partita.model import BUILTIN
from partita.search.costs.memory import loss_transient
from partita.search.costs.model import CostModel
from partita.search.engines import ENGINES
from partita.search.evaluate import evaluate_layout
from partita.search.uniform import stage_layer_names, strategy
from runtime_helpers import run_ranks


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages the ops made that are still alive, and their peak; the storages
    of ``existing`` tensors (and of the views ops return of them) are not the ops' own."""

    def __init__(self, existing=()) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.now = self.peak = 0

    def _track(self, t) -> None:
        if type(t) is not torch.Tensor:
            return
        storage = t.untyped_storage()
        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in self.live or key in self.existing:
            return
        self.live[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)

        def freed(key=key, n=n):
            if self.live.pop(key, None) is not None:
                self.now -= n
        weakref.finalize(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map(self._track, out)
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fp32_loss_backward_holds_what_the_cost_model_prices(dtype):
    tokens, vocab, hidden = 512, 8192, 32
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=dtype, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,))
    mode = LiveBytes(existing=(x, w, y))
    with mode:
        logits = x @ w.t()
        loss = F.cross_entropy(logits.float(), y)
        del logits  # torchtitan frees the model output before the backward (train.py: del pred)
        gc.collect()
        saved = mode.now
        mode.peak = mode.now
        loss.backward()
    logit_count = tokens * vocab
    assert saved == pytest.approx(4 * logit_count, rel=0.01)  # the fp32 log-probabilities
    held = mode.peak - saved  # at log_softmax's backward, before the product's gradients
    model = dataclasses.replace(BUILTIN["llama-3-8b"], vocab=vocab, hidden=hidden * 32)
    elem = torch.tensor([], dtype=dtype).element_size()
    cm = CostModel(model, parse_short("1x8xH100"), seq_len=tokens, dtype="bf16" if elem == 2 else "fp32",
                   engine=ENGINES["torchtitan"])
    priced = loss_transient(cm, 1, 1) - 4 * tokens * model.hidden  # the head input's gradient, priced apart
    assert held == pytest.approx(priced, rel=0.01)


def test_llama_3_8b_at_32k_tokens_fits_as_torchtitan_ran_it():
    """torchtitan's Llama 3.1 8B at 32,768 tokens on 8 H100 (FSDP, full activation checkpointing,
    micro-batch 1; llama3_h100_202412_torchtitan.md, Table 2) ran. At 8 bytes a logit for the
    fp32 loss's backward it fits; at the 14 the vocab-parallel loss holds it would not (the
    head's backward alone 55 GiB)."""
    model = BUILTIN["llama-3-8b"]
    cluster = parse_short("1x8xH100")
    cm = CostModel(model, cluster, seq_len=32768, dtype="bf16", engine=ENGINES["torchtitan"])
    layers = [strategy(model, name, tp=1, sp=False, zero=3, recompute="full")
              for name in stage_layer_names(model, [model.n_layers])[0]]
    ev = evaluate_layout(cm, [(cluster.groups[0], layers)], dp=8, tp=1, micro_batch=1, num_micro_batches=1)
    stage = ev.stages[0]
    assert stage.peak_at == "head backward"
    assert stage.peak_bytes <= stage.capacity


def _loss_parallel_peak(rank: int, tokens: int, vocab_local: int, dtype_name: str) -> dict:
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    torch.manual_seed(rank)
    logits = torch.randn(tokens, vocab_local, dtype=getattr(torch, dtype_name), requires_grad=True)
    targets = torch.randint(0, vocab_local * dist.get_world_size(), (tokens,))
    tracker = MemTracker()
    tracker.track_external(logits)
    with tracker, loss_parallel():  # as runtime.schedule.LossFunction runs it
        shards = DTensor.from_local(logits.float(), mesh, [Shard(1)], run_check=False)
        loss = F.cross_entropy(shards, targets).to_local()
        del shards
        gc.collect()
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(k.value) if hasattr(k, "value") else str(k): v for k, v in peak.items()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_vocab_parallel_loss_backward_holds_what_the_cost_model_prices(dtype):
    tokens, vocab_local, hidden = 512, 4096, 32
    peak = run_ranks(_loss_parallel_peak, 2, tokens, vocab_local, dtype)[0]
    logit_count = tokens * vocab_local
    assert peak["Activation"] == pytest.approx(4 * logit_count, rel=0.01)  # the saved fp32 log-probabilities
    model = dataclasses.replace(BUILTIN["llama-3-8b"], vocab=2 * vocab_local, hidden=hidden * 32)
    cm = CostModel(model, parse_short("1x8xH100"), seq_len=tokens, dtype="bf16" if dtype == "bfloat16" else "fp32",
                   engine=ENGINES["torchtitan"])
    priced = loss_transient(cm, 2, 1) - 4 * tokens * model.hidden  # the head input's gradient, priced apart
    assert peak["Temp"] == pytest.approx(priced, rel=0.01)
