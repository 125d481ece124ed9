"""The time side of the cost model (search/timing.py and its use in search/costs/): op counts
against the dispatcher, overlap, host floors, both sides of a pipeline boundary, the exposed
ZeRO edge and data-parallel sync, and a calibration's constants."""

import dataclasses
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from partita.cluster import parse_short
from partita.model_io import load_model
from partita.plan import LayerStrategy
from partita.profile import Calibration, Profile, Provenance
from partita.runtime.commprobe import OpCounter
from partita.runtime.models import build_layer
from partita.search.costs.model import CostModel
from partita.search import timing
from partita.search.evaluate import evaluate_layout
from partita.search.timing import (GQA_EXTRA_OPS, host_bound_s, layer_ops, overlapped_s, param_tensors)


def _counted(spec, role: str, counter):
    """One forward and backward of the runtime's layer under two fresh ``counter`` modes."""
    layer = build_layer(spec, role, device="cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    x = torch.randint(0, spec.vocab, (1, 8)) if role == "embed" else torch.randn(1, 8, spec.hidden, requires_grad=True)
    with counter() as fwd:
        y = layer(x)
        if role == "head":
            y = F.cross_entropy(y.flatten(0, 1).float(), torch.randint(0, spec.vocab, (8,)))
    grad = torch.ones_like(y) if role != "head" else None
    with counter() as bwd:
        y.backward(grad)
    return fwd, bwd


def _dispatched(model_name: str, role: str) -> tuple[int, int]:
    fwd, bwd = _counted(load_model(model_name), role, OpCounter)
    return fwd.ops, bwd.ops


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gpt2", "llama-2-7b"])
@pytest.mark.parametrize("role", ["embed", "block", "head"])
def test_op_counts_are_what_the_dispatcher_sees(model_name, role):
    spec = load_model(model_name)
    assert layer_ops(spec.kinds[role]) == _dispatched(model_name, role)


def test_grouped_query_attention_adds_the_repeat():
    gqa, mha = load_model("tiny-llama").kinds["block"], load_model("llama-2-7b").kinds["block"]
    assert gqa.heads != gqa.kv_heads and mha.heads == mha.kv_heads
    assert layer_ops(gqa)[0] - layer_ops(mha)[0] == GQA_EXTRA_OPS[0]


def test_parameter_tensors_match_the_runtime_layers():
    for name in ("tiny-llama", "tiny-gpt2"):
        spec = load_model(name)
        for role in ("embed", "block", "head"):
            layer = build_layer(spec, role, device="cpu")
            assert param_tensors(spec.kinds[role]) == len(list(layer.parameters())), (name, role)


def test_overlap_and_host_floor_formulas():
    assert overlapped_s(10.0, 4.0, 0.0) == 10.0  # perfect overlap
    assert overlapped_s(10.0, 4.0, 1.0) == 14.0  # none
    assert overlapped_s(10.0, 4.0, 0.189) == pytest.approx(10.756)
    assert overlapped_s(2.0, 4.0, 0.5) == 4.0  # communication-bound: the pass lasts the traffic
    assert host_bound_s(1e-3, 100, 5e-6, on_cpu=False) == 1e-3  # a GPU: the larger
    assert host_bound_s(1e-4, 100, 5e-6, on_cpu=False) == 5e-4
    assert host_bound_s(1e-4, 100, 5e-6, on_cpu=True) == pytest.approx(6e-4)  # a CPU: the sum


def _calibrated(device: str, **constants) -> Profile:
    values = dict(compute_scale=1.0, op_overhead_s=5e-6, overlap_slowdown=0.189, step_overhead_s=1e-3) | constants
    return Profile(device=device, dtype="bf16" if device != "cpu" else "fp32",
                   provenance=Provenance(source="calibrated", device_name=device), calibration=Calibration(**values))


def test_a_calibration_scales_analytic_compute_and_sets_the_host_floor():
    model, cluster = load_model("tiny-llama"), parse_short("2xcpu")
    base = CostModel(model, cluster, seq_len=64).compute("block", "cpu", 1, 1)
    twice = CostModel(model, cluster, seq_len=64, profiles=[_calibrated("cpu", compute_scale=2.0, op_overhead_s=3e-6)])
    c = twice.compute("block", "cpu", 1, 1)
    ops_fwd, _ = layer_ops(model.kinds["block"])
    device_fwd = base.forward_s - ops_fwd * 3e-6  # the default CPU op overhead is 3 us
    assert c.forward_s == pytest.approx(2 * device_fwd + ops_fwd * 3e-6)
    assert twice.cost_sources() == {"cpu": "calibrated"}


def test_fsdp_gathers_slow_compute_and_the_first_gather_is_exposed():
    model, cluster = load_model("llama-2-7b"), parse_short("8xH100")
    g = cluster.groups[0]
    z3 = LayerStrategy(name="layers.0", zero=3)
    perfect = CostModel(model, cluster, seq_len=4096, profiles=[_calibrated("H100", overlap_slowdown=0.0)])
    slowed = CostModel(model, cluster, seq_len=4096, profiles=[_calibrated("H100", overlap_slowdown=0.5)])
    t0, t1 = (cm.layer_time("block", g, z3, dp=8, micro_batch=1) for cm in (perfect, slowed))
    assert t1.forward_s > t0.forward_s and t1.zero_edge_s == pytest.approx(0.5 * t0.zero_edge_s)
    assert t0.zero_edge_s == pytest.approx(t0.zero_comm_s)
    layers = [LayerStrategy(name="embed", zero=3)] + [dataclasses.replace(z3, name=f"layers.{i}") for i in range(32)] \
        + [LayerStrategy(name="head", zero=3)]
    ev = evaluate_layout(perfect, [(g, layers)], dp=8, tp=1, micro_batch=1, num_micro_batches=4)
    assert ev.breakdown["zero_exposed"] >= 4 * max(perfect.layer_time("block", g, z3, dp=8, micro_batch=1).zero_edge_s,
                                                   0.0)


def test_a_data_parallel_collective_slows_hopper_products_more():
    """On Hopper parts a data-parallel collective (here ZeRO-3's gathers and reduce-scatters)
    slows the matrix products beside it by HOPPER_GEMM_OVERLAP_SLOWDOWN and the rest of the pass
    by the average, weighted by the products' share of the pass; elsewhere, and under a
    calibration (which measured the whole), the one slowdown stands."""
    from partita.search.costs.compute import gemm_shares

    model = load_model("llama-2-7b")
    z3 = LayerStrategy(name="layers.0", zero=3)
    hopper = CostModel(model, parse_short("8xH100"), seq_len=4096)
    g = hopper.cluster.groups[0]
    k = hopper.time_constants(g.device)
    assert k.overlap_slowdown == timing.OVERLAP_SLOWDOWN_GPU
    assert k.gemm_overlap_slowdown == timing.HOPPER_GEMM_OVERLAP_SLOWDOWN > k.overlap_slowdown
    share_fwd, share_bwd = gemm_shares(hopper, "block", g.device, 1, 1)
    assert 0.5 < share_fwd < 1.0 and 0.5 < share_bwd < 1.0  # a 7B block at 4k tokens is mostly products
    assert k.collective_slowdown(share_bwd) == pytest.approx(
        share_bwd * timing.HOPPER_GEMM_OVERLAP_SLOWDOWN + (1 - share_bwd) * timing.OVERLAP_SLOWDOWN_GPU)
    assert k.collective_slowdown(0.0) == k.overlap_slowdown and k.collective_slowdown(1.0) == k.gemm_overlap_slowdown
    t = hopper.layer_time("block", g, z3, dp=8, micro_batch=1)
    zero_fwd, zero_bwd, _, _ = hopper.zero_traffic("block", g, 1, 3, 8)
    assert zero_fwd > 0 and zero_bwd > 0
    # the same constants as a calibration (which prices every kernel at the one slowdown)
    plain = CostModel(model, parse_short("8xH100"), seq_len=4096, profiles=[_calibrated(
        "H100", op_overhead_s=k.op_overhead_s, step_overhead_s=k.step_overhead_s)])
    p = plain.layer_time("block", g, z3, dp=8, micro_batch=1)
    assert t.compute_s == pytest.approx(p.compute_s) and t.zero_comm_s == pytest.approx(p.zero_comm_s)
    assert t.forward_s > p.forward_s and t.backward_s > p.backward_s
    extra = (k.collective_slowdown(share_fwd) - k.overlap_slowdown) * zero_fwd \
        + (k.collective_slowdown(share_bwd) - k.overlap_slowdown) * zero_bwd  # traffic shorter than the passes
    assert t.forward_s + t.backward_s - p.forward_s - p.backward_s == pytest.approx(extra)
    assert t.zero_edge_s == pytest.approx((1 - k.collective_slowdown(share_fwd)) * zero_fwd
                                          + (1 - k.collective_slowdown(share_bwd)) * zero_bwd)
    # an A100 keeps the average, as does a calibrated H100
    ampere = CostModel(model, parse_short("8xA100-80GB"), seq_len=4096)
    a = ampere.cluster.groups[0]
    assert ampere.time_constants(a.device).gemm_overlap_slowdown is None
    assert ampere.time_constants(a.device).collective_slowdown(0.9) == timing.OVERLAP_SLOWDOWN_GPU
    calibrated = CostModel(model, parse_short("8xH100"), seq_len=4096,
                           profiles=[_calibrated("H100", overlap_slowdown=0.3)])
    kc = calibrated.time_constants(g.device)
    assert kc.gemm_overlap_slowdown is None and kc.collective_slowdown(0.9) == 0.3


def test_data_parallel_sync_exposes_at_least_the_last_reduction():
    model, cluster = load_model("llama-2-7b"), parse_short("2x8xH100")
    g = cluster.groups[0]
    cm = CostModel(model, cluster, seq_len=4096)
    layers = [LayerStrategy(name="embed")] + [LayerStrategy(name=f"layers.{i}") for i in range(32)] \
        + [LayerStrategy(name="head")]
    ev = evaluate_layout(cm, [(g, layers)], dp=16, tp=1, micro_batch=1, num_micro_batches=1)
    largest = max(cm.layer_time(role, g, LayerStrategy(name=role), dp=16, micro_batch=1).dp_sync_s
                  for role in ("embed", "block", "head"))
    assert ev.breakdown["data_parallel_exposed"] >= largest > 0


def test_software_defaults_to_the_runtime_and_refuses_what_it_does_not_know():
    from partita.errors import PartitaError
    from partita.search.timing import Software

    cm = CostModel(load_model("tiny-llama"), parse_short("8xH100"), seq_len=64)
    assert cm.software == Software(attention="sdpa", grad_sync="overlapped")
    with pytest.raises(PartitaError, match="valid: sdpa, flash1, flash2, cudnn, flash3, unfused"):
        Software(attention="xformers")
    with pytest.raises(PartitaError, match="valid: overlapped, after_backward"):
        Software(grad_sync="never")


def test_both_sides_of_a_stage_boundary_pay_for_it():
    model, cluster = load_model("tiny-llama"), parse_short("2xcpu")
    cm = CostModel(model, cluster, seq_len=64)
    g = cluster.groups[0]
    first = [LayerStrategy(name="embed")] + [LayerStrategy(name=f"layers.{i}") for i in range(3)]
    last = [LayerStrategy(name=f"layers.{i}") for i in range(3, 6)] + [LayerStrategy(name="head")]
    ev = evaluate_layout(cm, [(g, first), (g, last)], dp=1, tp=1, micro_batch=1, num_micro_batches=4)
    send = ev.stages[0].p2p_s
    assert send > 0 and ev.stages[1].p2p_s == pytest.approx(send)


# ---- the launch floor: the host's dispatch costs on the H200 (issue 23, item 5) -----------------
H200_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "h200"
needs_h200_data = pytest.mark.skipif(not (H200_DATA / "gemm.jsonl").exists(), reason=f"no measurements in {H200_DATA}")


def _launch_floor():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import launch_floor
    finally:
        sys.path.pop(0)
    return launch_floor


@needs_h200_data
def test_the_dispatch_costs_are_the_h200_data_host_bound_calls():
    """The committed dispatch costs are the medians of the files' host-bound calls, each over
    several points but the SDPA forward (the file has one host-bound forward)."""
    lf = _launch_floor()
    fitted = lf.fitted_dispatch(H200_DATA)
    for field in ("product", "attention_forward", "attention_backward"):
        assert getattr(timing.H200_DISPATCH, field) == pytest.approx(getattr(fitted, field), rel=0.01), field
    assert lf.product_dispatch_s(H200_DATA)[1] >= 3
    assert lf.attention_dispatch_s(H200_DATA)[1][1] >= 3


@needs_h200_data
def test_host_bound_calls_are_flat_in_their_flops():
    """What makes a call host-bound here: its time does not follow its FLOPs. The host-bound
    products span 4x in FLOPs and stay within 15 % of their median."""
    lf = _launch_floor()
    rows = lf.read_jsonl(H200_DATA / "gemm.jsonl")
    flops = [2.0 * r["m"] * r["n"] * r["k"] for r in rows]
    times = [r["s"] for r in rows]
    bound = lf._host_bound(times, flops)
    bound_flops = [f for f, t in zip(flops, times) if t in bound]
    median = statistics.median(bound)
    assert max(bound_flops) / min(bound_flops) >= 4
    assert all(abs(t / median - 1) < 0.15 for t in bound)


def test_products_and_attention_are_what_the_dispatcher_sees():
    """layer_products and the one SDPA a block runs each way, against a dispatch mode's count."""
    for name in ("tiny-llama", "tiny-gpt2", "llama-2-7b"):
        spec = load_model(name)
        for role in ("embed", "block", "head"):
            fwd, bwd = _kernels_dispatched(spec, role)
            products = timing.layer_products(spec.kinds[role])
            attention = 1 if role == "block" else 0
            assert fwd == {"product": products, "attention": attention}, (name, role)
            assert bwd == {"product": 2 * products, "attention": attention}, (name, role)


def _kernels_dispatched(spec, role: str) -> tuple[dict, dict]:
    fwd, bwd = _counted(spec, role, _KernelCounter)
    return fwd.counts, bwd.counts


class _KernelCounter(TorchDispatchMode):
    """Counts matrix products and fused attention calls among the dispatched aten ops."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"product": 0, "attention": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            self.counts["product"] += 1
        elif "scaled_dot_product" in name:
            self.counts["attention"] += 1
        return func(*args, **(kwargs or {}))


def test_the_gpu_default_is_the_reference_blocks_mean_host_time_per_op():
    kind = load_model("llama-3-8b").kinds["block"]
    assert kind == timing.REFERENCE_BLOCK
    fwd_ops, bwd_ops = layer_ops(kind)
    host_fwd, host_bwd = timing.layer_host_s(kind)
    c = timing.H200_DISPATCH
    assert host_fwd == pytest.approx(7 * c.product + c.attention_forward + (fwd_ops - 8) * c.other)
    assert host_bwd == pytest.approx(14 * c.product + c.attention_backward + (bwd_ops - 15) * c.other)
    assert timing.OP_OVERHEAD_S["gpu"] * (fwd_ops + bwd_ops) == pytest.approx(host_fwd + host_bwd)
    assert timing.OP_OVERHEAD_S["cpu"] == 3e-6  # CPU ranks keep their measured default


def test_small_shards_are_host_bound_and_large_ones_are_not():
    """A llama-3-8b block on the H200 at 2048 tokens: at tp 8 each pass is its ops' host time,
    at tp 1 the kernels' time, unchanged by the host's costs."""
    model, cluster = load_model("llama-3-8b"), parse_short("8xH200")
    cm = CostModel(model, cluster, seq_len=2048)
    fwd_ops, bwd_ops = layer_ops(model.kinds["block"])
    per_op = timing.OP_OVERHEAD_S["gpu"]
    small, large = cm.compute("block", "H200", 8, 1), cm.compute("block", "H200", 1, 1)
    assert small.forward_s == pytest.approx(fwd_ops * per_op) and small.backward_s == pytest.approx(bwd_ops * per_op)
    assert large.forward_s > 1.5 * fwd_ops * per_op and large.backward_s > 2 * bwd_ops * per_op
