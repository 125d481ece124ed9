"""Context parallelism measured: the profile's attention table and all-to-all fit, and the cost
model pricing cp from them; cp's collectives apart in a step's breakdown.

Pricing tests use synthetic profile entries (exact expectations, no timing). The profiler runs
on the CPU on tiny shapes and is only required to write the points it was asked for with
positive times; the GPU test (long sequences on CUDA) is skipped without a GPU.
"""

import dataclasses
import math

import pytest

from partita.cluster import parse_short
from partita.errors import PartitaError
from partita.model import BUILTIN
from partita.plan import LayerStrategy
from partita.profile import (AttentionCost, CommCost, Profile, Provenance, attention_time_at, bus_bytes,
                             causal_attention_flops)
from partita.search.analytic import Shard
from partita.search.context import all_to_all_s, attention_time
from partita.search.costs.model import CostModel
from partita.search.costs.stage import stage_cost
from partita.search.costs.step import step_time_s

LLAMA8 = BUILTIN["llama-3-8b"]  # 32 heads, 8 kv heads, head_dim 128


def _point(heads: int, seq: int, tflops: float, *, batch: int = 1, head_dim: int = 128) -> AttentionCost:
    """A point whose forward runs at ``tflops`` and backward at a third of it."""
    flops = causal_attention_flops(batch, heads, seq, head_dim)
    return AttentionCost(heads=heads, head_dim=head_dim, micro_batch=batch, seq_len=seq,
                         forward_s=flops / (tflops * 1e12), backward_s=3 * flops / (tflops * 1e12))


def _profile(device: str = "H100", dtype: str = "bf16", **tables) -> Profile:
    return Profile(device=device, dtype=dtype, provenance=Provenance(source="measured", device_name="test"), **tables)


# ---- the table and reading it --------------------------------------------------------------


def test_attention_points_round_trip_and_are_absent_without_them(tmp_path):
    plain = _profile()
    assert "attention" not in plain.to_dict()  # older profiles keep their fingerprint
    prof = _profile(attention=(_point(32, 8192, 400.0), _point(4, 32768, 300.0)))
    path = tmp_path / "p.yaml"
    prof.save(path)
    assert Profile.load(path) == prof
    assert prof.fingerprint != plain.fingerprint


def test_a_bad_attention_entry_names_the_valid_keys():
    data = _profile(attention=(_point(32, 8192, 400.0),)).to_dict()
    data["attention"][0]["causal"] = True
    with pytest.raises(PartitaError, match="attention\\[0\\]: unknown key 'causal'; valid keys: heads, head_dim"):
        Profile.from_dict(data)


def test_a_measured_shape_reads_back_its_times():
    p = _point(32, 8192, 400.0)
    prof = _profile(attention=(p, _point(32, 32768, 500.0)))
    assert attention_time_at(prof, batch=1, heads=32, seq_len=8192, head_dim=128) == pytest.approx(
        (p.forward_s, p.backward_s))


def test_rates_interpolate_in_log_length_and_hold_above_the_longest():
    prof = _profile(attention=(_point(32, 8192, 400.0), _point(32, 32768, 600.0)))
    flops = causal_attention_flops(1, 32, 16384, 128)
    fwd, bwd = attention_time_at(prof, batch=1, heads=32, seq_len=16384, head_dim=128)
    assert fwd == pytest.approx(flops / 500e12)  # halfway in log2 between 8k and 32k
    assert bwd == pytest.approx(3 * flops / 500e12)
    fwd_128k, _ = attention_time_at(prof, batch=1, heads=32, seq_len=131072, head_dim=128)
    assert fwd_128k == pytest.approx(causal_attention_flops(1, 32, 131072, 128) / 600e12)


def test_below_the_shortest_length_or_another_head_dim_is_left_to_the_roofline():
    prof = _profile(attention=(_point(32, 8192, 400.0),))
    assert attention_time_at(prof, batch=1, heads=32, seq_len=4096, head_dim=128) is None
    assert attention_time_at(prof, batch=1, heads=32, seq_len=8192, head_dim=64) is None
    assert attention_time_at(_profile(), batch=1, heads=32, seq_len=8192, head_dim=128) is None


def test_the_nearest_width_sets_the_rate_and_batch_times_heads_scales_time():
    prof = _profile(attention=(_point(32, 8192, 400.0), _point(4, 8192, 200.0)))
    flops_4 = causal_attention_flops(1, 4, 8192, 128)
    assert attention_time_at(prof, batch=1, heads=4, seq_len=8192, head_dim=128)[0] == pytest.approx(flops_4 / 200e12)
    # b x H = 8: nearer 4 than 32 in log distance; twice the work at the same rate
    assert attention_time_at(prof, batch=2, heads=4, seq_len=8192, head_dim=128)[0] == pytest.approx(
        2 * flops_4 / 200e12)
    assert attention_time_at(prof, batch=1, heads=16, seq_len=8192, head_dim=128)[0] == pytest.approx(
        causal_attention_flops(1, 16, 8192, 128) / 400e12)


# ---- the cost model at cp, from a profile --------------------------------------------------


def _view(cp: int, variant: str = "all_to_all", profiles=(), seq: int = 65536, cluster: str = "8xH100"):
    return CostModel(LLAMA8, parse_short(cluster), seq_len=seq, profiles=profiles).at_cp(cp, variant)


def test_all_to_all_attention_is_read_from_the_profile_where_it_covers_the_shape():
    """All s positions for H/cp heads, and the L-token core it replaces (H heads over s/cp)."""
    whole, local = _point(4, 65536, 500.0), _point(32, 8192, 450.0)
    view = _view(8, profiles=[_profile(attention=(whole, local))])
    at = attention_time(view, view.cluster.groups[0], 1, 1)
    assert (at.forward_s, at.backward_s) == pytest.approx((whole.forward_s, whole.backward_s))
    assert (at.local_forward_s, at.local_backward_s) == pytest.approx((local.forward_s, local.backward_s))
    assert at.exposed_forward_s == at.exposed_backward_s == 0.0


def test_without_attention_points_cp_prices_the_roofline_as_before():
    from partita.devices import get_device
    from partita.search.analytic import attention_s

    view = _view(8, profiles=[_profile()])
    at = attention_time(view, view.cluster.groups[0], 1, 1)
    whole = Shard.of(LLAMA8.kinds["block"], tp=8, micro_batch=1, seq_len=65536, dtype="bf16")
    assert (at.forward_s, at.backward_s) == pytest.approx(attention_s(get_device("H100"), whole, "bf16", "sdpa"))


def test_measured_attention_moves_the_block_time_by_the_difference():
    whole = _point(4, 65536, 500.0)
    slow = _point(4, 65536, 250.0)
    fast_view, slow_view = (_view(8, profiles=[_profile(attention=(p,))]) for p in (whole, slow))
    s = LayerStrategy(name="layers.0")
    t_fast, t_slow = (v.layer_time("block", v.cluster.groups[0], s, dp=1, micro_batch=1) for v in (fast_view, slow_view))
    assert t_slow.forward_s - t_fast.forward_s == pytest.approx(slow.forward_s - whole.forward_s)
    assert t_slow.backward_s - t_fast.backward_s == pytest.approx(slow.backward_s - whole.backward_s)


def test_the_all_to_alls_are_priced_by_the_profiles_fit():
    fit = CommCost(op="all_to_all", link="nvlink", ranks=8, latency_s=20e-6, bandwidth_gbps=100.0)
    view = _view(8, profiles=[_profile(comm=(fit,))])
    sh = Shard.of(LLAMA8.kinds["block"], tp=1, micro_batch=1, seq_len=8192, dtype="bf16")
    q = sh.tokens * 32 * sh.head_dim * 2
    kv = sh.tokens * 8 * sh.head_dim * 2
    expected = sum(fit.time_s(bus_bytes("all_to_all", m, 8)) for m in (q, kv, kv, q))
    assert all_to_all_s(view, view.cluster.groups[0], 1, 1) == pytest.approx(expected)
    datasheet = _view(8)
    assert all_to_all_s(datasheet, datasheet.cluster.groups[0], 1, 1) != pytest.approx(expected)


def test_a_cpu_profiles_all_to_all_fit_prices_cp_on_cpu_ranks():
    small = dataclasses.replace(BUILTIN["tiny-llama"], n_layers=2)
    fit = CommCost(op="all_to_all", link="loopback", ranks=2, latency_s=1e-3, bandwidth_gbps=0.5)
    prof = _profile(device="cpu", dtype="fp32", comm=(fit,))
    view = CostModel(small, parse_short("4xcpu"), seq_len=64, profiles=[prof]).at_cp(2)
    sh = Shard.of(small.kinds["block"], tp=1, micro_batch=1, seq_len=32, dtype="fp32")
    q, kv = (sh.tokens * h * sh.head_dim * 4 for h in (small.heads, small.kv_heads))
    expected = sum(fit.time_s(bus_bytes("all_to_all", m, 2)) for m in (q, kv, kv, q))
    assert all_to_all_s(view, view.cluster.groups[0], 1, 1) == pytest.approx(expected)


# ---- the step's breakdown ------------------------------------------------------------------


def _step(cm: CostModel, recompute: str = "none", m: int = 4):
    layers = [LayerStrategy(name=n, recompute=recompute if n.startswith("layers.") else "none")
              for n in LLAMA8.layer_names()]
    group = cm.cluster.groups[0]
    stage = stage_cost(cm, group, layers, stage=0, pp=1, dp=1, tp=1, micro_batch=1, num_micro_batches=m,
                       next_group=None)
    return stage, step_time_s([stage], m)


@pytest.mark.parametrize("variant", ["all_to_all", "ring"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_cp_comm_has_its_own_key_and_the_total_is_the_sum_of_the_layers(variant, recompute):
    view = _view(8, variant, seq=131072, cluster="8xH200")
    stage, (total, breakdown) = _step(view, recompute)
    block = view.layer_time("block", view.cluster.groups[0], LayerStrategy(name="layers.0", recompute=recompute),
                            dp=1, micro_batch=1)
    assert breakdown["context_parallel_comm"] == pytest.approx(4 * LLAMA8.n_layers * block.cp_comm_s)
    assert breakdown["tensor_parallel_comm"] == 0.0  # tp 1: nothing of cp's under tensor parallelism
    if variant == "all_to_all":
        assert block.cp_comm_s > 0
    assert stage.time_s == pytest.approx(stage.forward_s + stage.backward_s)
    assert total >= breakdown["compute"] + breakdown["context_parallel_comm"]


def test_plans_without_cp_have_no_cp_key():
    _, (_, breakdown) = _step(CostModel(LLAMA8, parse_short("8xH100"), seq_len=8192))
    assert "context_parallel_comm" not in breakdown


# ---- the profiler -------------------------------------------------------------------------


def test_attention_heads_are_the_shapes_plans_can_use():
    pytest.importorskip("torch")
    from partita.profiler.attention import attention_heads

    assert attention_heads(LLAMA8, tps=(1,), cps=(1, 8)) == (32, 4)
    assert attention_heads(LLAMA8, tps=(1, 2), cps=(1, 2, 4, 8)) == (32, 16, 8, 4)  # kv 8 caps tp x cp at 8
    with pytest.raises(PartitaError, match="tp x cp must divide heads 32 and kv_heads 8"):
        attention_heads(LLAMA8, tps=(1,), cps=(16,))


def test_the_profiler_writes_attention_points_on_the_cpu(tmp_path):
    pytest.importorskip("torch")
    from partita.cli import main

    out = tmp_path / "att.yaml"
    rc = main(["profile", "--model", "tiny-llama", "--device", "cpu", "--attention-only", "--attention-seq-lens",
               "128,256", "--tp", "1", "--cp", "1,2", "--warmup", "1", "--repeats", "3", "-o", str(out)])
    assert rc == 0
    prof = Profile.load(out)
    assert prof.layers == () and prof.comm == ()
    assert {(a.heads, a.seq_len, a.head_dim, a.micro_batch) for a in prof.attention} == {
        (h, s, 16, 1) for h in (4, 2) for s in (128, 256)}
    assert all(a.forward_s > 0 and a.backward_s > 0 for a in prof.attention)
    assert "--attention-seq-lens 128,256" in prof.provenance.command


@pytest.mark.parametrize("argv, message", [
    (["--attention-only"], "--attention-only needs --attention-seq-lens"),
    (["--comm-only", "--attention-seq-lens", "1024"], "drop --comm-only"),
    (["--attention-seq-lens", "1024", "--cp", "3"], "tp x cp must divide"),
])
def test_attention_flags_that_cannot_work_fail_in_one_line(argv, message, tmp_path, capsys):
    pytest.importorskip("torch")
    from partita.cli import main

    rc = main(["profile", "--model", "tiny-llama", "--device", "cpu", "--tp", "1", *argv, "-o", str(tmp_path / "p.yaml")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "p.yaml").exists()


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_attention_at_a_long_sequence_on_the_gpu():
    import torch

    from partita.profiler.attention import AttentionOptions, profile_attention

    opts = AttentionOptions(device=torch.device("cuda"), dtype="bf16", seq_lens=(8192,), heads=(8,), head_dim=128,
                            warmup=1, repeats=3)
    (point,) = profile_attention(opts)
    rate = point.forward_flops / point.forward_s
    assert 1e12 < rate < 5e15  # a fused kernel on any datacenter GPU, not a stalled or skipped one
    assert point.backward_s > point.forward_s
    prof = _profile(device="H200", attention=(point,))
    fwd, _ = attention_time_at(prof, batch=1, heads=8, seq_len=16384, head_dim=128)
    assert fwd == pytest.approx(4 * point.forward_s)  # twice the length, four times the pairs
    assert math.isfinite(fwd)
