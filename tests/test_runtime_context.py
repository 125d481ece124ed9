"""Context parallelism in the runtime (``partita.runtime.context``), on CPU ranks joined by gloo.

The all-to-all variant on sequence shards must give each rank exactly the slice of what one
process computes on the whole sequence: the attention output and the q/k/v gradients (with
grouped-query heads, both layouts, cp 2 and 4), a whole model's loss and parameter gradients
(llama with rotary, gpt2 with learned positions; cp 2, cp 4, and cp 2 x tp 2 on 4 ranks), and
the activation bytes the cost model predicts (``partita.search.context.cp_activation_bytes``).
The ring variant is refused on CPU ranks; on two or more GPUs it is compared with one GPU.
Float64 on CPU: the parallel and single-process computations must agree to rounding.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from partita.errors import PartitaError  # noqa: E402
from partita.model import BUILTIN, ModelSpec  # noqa: E402
from partita.runtime import context  # noqa: E402
from partita.runtime.models import _rotary, build_model, materialize  # noqa: E402
from runtime_helpers import all_to_all_block_saved_bytes, free_port, run_ranks  # noqa: E402

BATCH, SEQ = 2, 16  # 16 tokens: 2 x cp chunks for cp 2 and 4
GQA = dict(heads=8, kv_heads=4, head_dim=4)  # kv heads divisible by cp 4 and by cp x tp = 4


def _spec(base: str, **changes) -> ModelSpec:
    d = BUILTIN[base].to_dict()
    d.update(name=f"cp-{base}", n_layers=2, **changes)
    return ModelSpec.from_dict(d)


LLAMA = _spec("tiny-llama")  # 4 heads, 2 kv heads: cp 2
LLAMA_GQA = _spec("tiny-llama", heads=8, kv_heads=4)  # cp 4, cp 2 x tp 2
GPT2 = _spec("tiny-gpt2")  # learned positions


# ---- layouts and positions (one process) --------------------------------------------------------


def test_shard_positions_for_both_layouts():
    assert context.shard_positions(8, 2, 1).tolist() == [4, 5, 6, 7]
    assert context.shard_positions(8, 2, 0, "head_tail").tolist() == [0, 1, 6, 7]
    assert context.shard_positions(8, 2, 1, "head_tail").tolist() == [2, 3, 4, 5]
    for layout in context.LAYOUTS:
        every = torch.cat([context.shard_positions(16, 4, r, layout) for r in range(4)])
        assert sorted(every.tolist()) == list(range(16))


def test_head_tail_is_torchs_load_balanced_layout():
    """The ring's data layout must be the one torch's context_parallel shards buffers with."""
    balancer = pytest.importorskip("torch.distributed.tensor.experimental._attention")
    if not hasattr(balancer, "_HeadTailLoadBalancer"):
        pytest.skip("this torch has no _HeadTailLoadBalancer")
    for cp in (2, 4):
        order = balancer._HeadTailLoadBalancer(SEQ, cp, "cpu")._generate_indices().view(cp, SEQ // cp)
        for r in range(cp):
            assert order[r].tolist() == context.shard_positions(SEQ, cp, r, "head_tail").tolist()


@pytest.mark.parametrize("layout", context.LAYOUTS)
def test_reordering_the_gathered_shards_restores_the_sequence(layout):
    x = torch.arange(BATCH * SEQ * 3).view(BATCH, SEQ, 3)
    cp = 4
    gathered = torch.cat([context.shard_sequence(x, cp=cp, index=r, layout=layout) for r in range(cp)], dim=1)
    assert torch.equal(context.to_global_order(gathered, cp, layout), x)
    assert torch.equal(context.to_shard_order(x, cp, layout), gathered)


@pytest.mark.parametrize("layout", context.LAYOUTS)
def test_rotary_of_a_shard_at_its_positions_is_the_slice_of_the_whole(layout):
    x = torch.randn(BATCH, SEQ, 3, 8, generator=torch.Generator().manual_seed(0))
    whole = _rotary(x, 10000.0)
    assert torch.equal(context.rotary_at(x, torch.arange(SEQ), 10000.0), whole)
    for r in range(2):
        shard = context.shard_sequence(x, cp=2, index=r, layout=layout)
        got = context.rotary_at(shard, context.shard_positions(SEQ, 2, r, layout), 10000.0)
        torch.testing.assert_close(got, context.shard_sequence(whole, cp=2, index=r, layout=layout))


# ---- limits (one process) -----------------------------------------------------------------------


def test_divisibility_errors_name_the_numbers_and_the_fix():
    with pytest.raises(PartitaError, match=r"kv_heads divisible by cp x tp = 2 x 2 = 4, but kv_heads is 2"):
        context.check_all_to_all(8, 2, cp=2, tp=2)
    with pytest.raises(PartitaError, match=r"heads divisible by cp x tp = 3 x 1 = 3, but heads is 8"):
        context.check_all_to_all(8, 8, cp=3)
    context.check_all_to_all(8, 4, cp=2, tp=2)
    with pytest.raises(PartitaError, match=r"sequence length 12 cannot be split into 8 equal chunks .* divisible by 8"):
        context.check_sequence(12, 4, "head_tail")
    context.check_sequence(12, 4, "contiguous")
    with pytest.raises(PartitaError, match="unknown context-parallel layout 'zigzag'; valid: contiguous, head_tail"):
        context.shard_positions(16, 2, 0, "zigzag")


def test_the_ring_is_refused_off_cuda_in_one_line():
    with pytest.raises(PartitaError, match="runs on CUDA only") as e:
        context.check_ring_device("cpu")
    assert "\n" not in str(e.value) and "all-to-all" in str(e.value)


# ---- the all-to-all attention against one process -------------------------------------------------


def _qkv():
    """q, k, v and an output weight for the loss, [b, s, heads, d], float64."""
    gen = torch.Generator().manual_seed(0)
    h, kv, d = GQA["heads"], GQA["kv_heads"], GQA["head_dim"]
    return tuple(torch.randn(BATCH, SEQ, n, d, generator=gen, dtype=torch.float64) for n in (h, kv, kv, h))


def _reference_attention(q, k, v):
    group = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _attention_rank(rank: int) -> dict:
    cp = dist.get_world_size()
    results = {}
    for layout in context.LAYOUTS:
        q, k, v, weight = _qkv()
        shards = [context.shard_sequence(t, cp=cp, index=rank, layout=layout).requires_grad_() for t in (q, k, v)]
        out = context.all_to_all_attention(*shards, dist.group.WORLD, layout=layout)
        (out * context.shard_sequence(weight, cp=cp, index=rank, layout=layout)).sum().backward()
        results[layout] = (out.detach(), *(s.grad for s in shards))
    return results


@pytest.mark.parametrize("cp", [2, 4])
def test_all_to_all_attention_gives_each_shard_its_slice_of_the_whole(cp):
    q, k, v, weight = (t.requires_grad_() for t in _qkv())
    out = _reference_attention(q, k, v)
    (out * weight).sum().backward()
    want = (out.detach(), q.grad, k.grad, v.grad)
    for rank, got in enumerate(run_ranks(_attention_rank, cp)):
        for layout in context.LAYOUTS:
            for name, g, w in zip(("out", "dq", "dk", "dv"), got[layout], want):
                torch.testing.assert_close(g, context.shard_sequence(w, cp=cp, index=rank, layout=layout),
                                           msg=lambda m: f"rank {rank} {layout} {name}: {m}")


# ---- whole models: loss and parameter gradients ----------------------------------------------------


def _batch(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, spec.vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _model(spec: ModelSpec):
    return materialize(build_model(spec, dtype=torch.float64), device="cpu", seed=0)


def _tensor_parallel(model, mesh) -> None:
    """Megatron's split of each block (q, k, v and the MLP's first matrices by columns, the
    output projections by rows); embedding and head stay whole."""
    styles = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
              "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
              "feed_forward.w2": RowwiseParallel()}
    if model.spec.family == "llama":
        styles["feed_forward.w3"] = ColwiseParallel()
    for block in model.layers.values():
        parallelize_module(block, mesh, styles)


def _model_rank(rank: int, spec_dict: dict, cp: int, tp: int, layout: str) -> dict:
    spec = ModelSpec.from_dict(spec_dict)
    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    model = _model(spec)
    if tp > 1:
        _tensor_parallel(model, mesh["tp"])
    context.apply_all_to_all(model, mesh["cp"], tp=tp, layout=layout)
    cp_group, cp_rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
    inputs, targets = (context.shard_sequence(t, cp=cp, index=cp_rank, layout=layout) for t in _batch(spec))
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())  # the mean over this rank's tokens
    (loss / cp).backward()  # the cp shards' mean is the whole sequence's
    total = loss.detach() / cp
    dist.all_reduce(total, group=cp_group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        dist.all_reduce(g, group=cp_group)  # what FSDP / DP do over dp x cp
        grads[name] = g
    return {"loss": total, "grads": grads}


def _reference_model(spec: ModelSpec) -> dict:
    model = _model(spec)
    inputs, targets = _batch(spec)
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("spec, cp, tp, layout", [
    (LLAMA, 2, 1, "contiguous"), (LLAMA, 2, 1, "head_tail"), (GPT2, 2, 1, "head_tail"),
    (LLAMA_GQA, 4, 1, "contiguous"), (LLAMA_GQA, 2, 2, "head_tail")],
    ids=["llama-cp2", "llama-cp2-head_tail", "gpt2-cp2-head_tail", "llama-gqa-cp4", "llama-gqa-cp2xtp2-head_tail"])
def test_a_model_under_all_to_all_has_the_loss_and_gradients_of_one_process(spec, cp, tp, layout):
    want = _reference_model(spec)
    for rank, got in enumerate(run_ranks(_model_rank, cp * tp, spec.to_dict(), cp, tp, layout)):
        torch.testing.assert_close(got["loss"], want["loss"], msg=lambda m: f"rank {rank} loss: {m}")
        assert got["grads"].keys() == want["grads"].keys()
        for name, g in got["grads"].items():
            torch.testing.assert_close(g, want["grads"][name], msg=lambda m: f"rank {rank} {name}: {m}")


# ---- errors on ranks --------------------------------------------------------------------------------


def _errors_rank(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    out = {}
    try:  # cp 4 with tiny-llama's 2 kv heads
        context.apply_all_to_all(build_model(BUILTIN["tiny-llama"]), mesh)
    except PartitaError as e:
        out["apply"] = str(e)
    q, k, v, _ = _qkv()
    try:  # 8 heads, 4 kv heads, but only 2 of them on this rank (as a tp 2 shard would hold)
        context.all_to_all_attention(q[:, :4], k[:, :4, :2], v[:, :4, :2], mesh)
    except PartitaError as e:
        out["local"] = str(e)
    for what, call in (("ring", lambda: context.apply_ring(build_model(BUILTIN["tiny-llama"]), mesh)),
                       ("ring_context", lambda: context.ring_attention(mesh, [torch.zeros(1, SEQ)]).__enter__())):
        try:
            call()
        except PartitaError as e:
            out[what] = str(e)
    return out


def test_ranks_refuse_what_cannot_run_with_a_clear_line():
    for got in run_ranks(_errors_rank, 4):
        assert "kv_heads divisible by cp x tp = 4 x 1 = 4, but kv_heads is 2" in got["apply"]
        assert "2 kv heads, not divisible by cp 4" in got["local"]
        for what in ("ring", "ring_context"):
            assert got[what].startswith("ring attention (torch's context_parallel) runs on CUDA only"), got[what]


# ---- activation memory against the cost model ----------------------------------------------------------


@pytest.mark.parametrize("spec", [LLAMA_GQA, GPT2], ids=["llama-gqa", "gpt2"])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_blocks_saved_bytes_under_all_to_all_are_the_cost_models(spec, cp):
    from partita.cluster import parse_short
    from partita.plan import LayerStrategy
    from partita.search.context import cp_activation_bytes
    from partita.search.costs.model import CostModel
    from partita.units import round_up_to_grain

    want = cp_activation_bytes(spec.kinds["block"], variant="all_to_all", cp=cp, tp=1, micro_batch=BATCH, seq_len=SEQ,
                               dtype="fp32", on_cpu=True)
    cm = CostModel(spec, parse_short(f"{cp}xcpu"), seq_len=SEQ, dtype="fp32").at_cp(cp)
    priced = cm.layer_memory("block", "cpu", LayerStrategy(name="layers.0"), dp=1, micro_batch=BATCH, num_micro_batches=1)
    assert priced.activations == round_up_to_grain(want)  # what the planner prices is what is measured here
    for layout in context.LAYOUTS:
        assert run_ranks(all_to_all_block_saved_bytes, cp, spec.to_dict(), BATCH, SEQ, layout) == [want] * cp, layout


# ---- the ring, on GPUs only --------------------------------------------------------------------------------


def _ring_rank(rank: int, world: int, port: int, spec_dict: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        spec = ModelSpec.from_dict(spec_dict)
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
        model = materialize(build_model(spec, dtype=torch.bfloat16), device="cuda", seed=0)
        context.apply_ring(model, mesh)
        inputs, targets = (t.cuda() for t in _batch(spec))
        with context.ring_attention(mesh, [inputs, targets]):
            loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
            (loss / world).backward()
        total = loss.detach() / world
        dist.all_reduce(total)
        grads = {n: p.grad.float() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        torch.save({"loss": total.cpu(), "grads": {n: g.cpu() for n, g in grads.items()}}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="ring attention needs two CUDA devices")
def test_ring_attention_on_gpus_has_the_loss_of_one_gpu(tmp_path):
    import torch.multiprocessing as mp

    spec = LLAMA
    mp.start_processes(_ring_rank, args=(2, free_port(), spec.to_dict(), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    model = materialize(build_model(spec, dtype=torch.bfloat16), device="cuda", seed=0)
    inputs, targets = (t.cuda() for t in _batch(spec))
    loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
    loss.backward()
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        # bf16 kernels, merged in fp32 by the ring: agreement to bf16 rounding, not to the bit.
        torch.testing.assert_close(got["loss"], loss.detach().cpu(), rtol=2e-2, atol=2e-2)
        for n, p in model.named_parameters():
            want = p.grad.float().cpu()
            assert (got["grads"][n] - want).norm() <= 3e-2 * want.norm(), f"rank {r} {n}"


# ---- the all-gather variant (Llama 3's) ---------------------------------------------------------


def _gather_rank(rank: int, spec_dict: dict, cp: int, tp: int) -> dict:
    """``_model_rank`` under the all-gather variant (head_tail shards)."""
    spec = ModelSpec.from_dict(spec_dict)
    mesh = init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp", "tp"))
    model = _model(spec)
    if tp > 1:
        _tensor_parallel(model, mesh["tp"])
    context.apply_all_gather(model, mesh["cp"])
    cp_group, cp_rank = mesh["cp"].get_group(), mesh["cp"].get_local_rank()
    inputs, targets = (context.shard_sequence(t, cp=cp, index=cp_rank, layout="head_tail") for t in _batch(spec))
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    (loss / cp).backward()
    total = loss.detach() / cp
    dist.all_reduce(total, group=cp_group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        dist.all_reduce(g, group=cp_group)
        grads[name] = g
    return {"loss": total, "grads": grads}


@pytest.mark.parametrize("spec, cp, tp", [(LLAMA, 2, 1), (GPT2, 2, 1), (LLAMA_GQA, 4, 1), (LLAMA_GQA, 2, 2),
                                          (LLAMA, 4, 1)],
                         ids=["llama-cp2", "gpt2-cp2", "llama-gqa-cp4", "llama-gqa-cp2xtp2", "llama-cp4-more-ranks-than-kv-heads"])
def test_a_model_under_all_gather_has_the_loss_and_gradients_of_one_process(spec, cp, tp):
    """K and V gathered at their own kv heads (cp 4 over tiny-llama's 2 kv heads: more ranks
    than kv heads, which all-to-all cannot split), each chunk attending up to its end."""
    want = _reference_model(spec)
    for rank, got in enumerate(run_ranks(_gather_rank, cp * tp, spec.to_dict(), cp, tp)):
        torch.testing.assert_close(got["loss"], want["loss"], msg=lambda m: f"rank {rank} loss: {m}")
        for name, g in got["grads"].items():
            torch.testing.assert_close(g, want["grads"][name], msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA kernels behind the all-gather's chunks")
@pytest.mark.parametrize("cp", [2, 4])
def test_all_gather_chunks_on_a_gpu_match_full_causal_attention(cp):
    """The kernels the all-gather variant dispatches on a GPU (a lower-right causal bias with
    grouped-query heads, bf16), one rank's head_tail chunks at a time, against SDPA over the whole
    sequence: forward and the q, k, v gradients (benchmarks/gpu_session.sh runs it)."""
    b, s, h, kv, d = 1, 4096, 8, 2, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
               for n in (h, kv, kv))
    whole = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True).transpose(1, 2)
    grad = torch.randn_like(whole)
    want = torch.autograd.grad(whole, (q, k, v), grad)
    got_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for r in range(cp):
        pos = context.shard_positions(s, cp, r, "head_tail", device="cuda")
        starts = pos[::s // (2 * cp)].tolist()
        out = context.chunk_attention(q[:, pos], k.transpose(1, 2), v.transpose(1, 2), starts)
        torch.testing.assert_close(out, whole[:, pos], rtol=2e-2, atol=2e-2)
        for acc, g in zip(got_grads, torch.autograd.grad(out, (q, k, v), grad[:, pos])):
            acc += g
    for name, g, w in zip("qkv", got_grads, want):
        assert (g.float() - w.float()).norm() <= 3e-2 * w.float().norm(), name
