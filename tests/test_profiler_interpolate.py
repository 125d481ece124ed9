"""interpolate(): reading a measured profile at any micro-batch, without torch."""

import subprocess
import sys

import pytest

from partita.model_io import load_model
from partita.profile import LayerCost, Profile, Provenance
from partita.profile import bus_bytes
from partita.profiler.fit import fit_latency_bandwidth, relative_errors
from partita.profile import layer_cost_at as interpolate

SPEC = load_model("tiny-llama")
BLOCK = SPEC.kinds["block"]


def point(mb: int, fwd: float, act: int, tp: int = 1, seq_len: int = 64) -> LayerCost:
    return LayerCost(kind=BLOCK, tp=tp, micro_batch=mb, seq_len=seq_len, forward_s=fwd, backward_s=2 * fwd,
                     recompute_s=fwd, activation_bytes=act, param_bytes=1000)


def profile(*points: LayerCost) -> Profile:
    return Profile(device="cpu", dtype="fp32", provenance=Provenance(source="measured", device_name="test"),
                   layers=points)


PROF = profile(point(2, 1.0, 200), point(4, 1.5, 400), point(16, 6.0, 1600))


def test_measured_point_is_returned_as_is():
    assert interpolate(PROF, BLOCK, 1, 4, 64) == point(4, 1.5, 400)


def test_between_neighbours_is_linear():
    c = interpolate(PROF, BLOCK, 1, 10, 64)
    assert c.micro_batch == 10
    assert c.forward_s == pytest.approx(1.5 + (6.0 - 1.5) * 6 / 12)
    assert c.backward_s == pytest.approx(2 * c.forward_s)
    assert c.activation_bytes == 1000
    assert c.param_bytes == 1000


def test_above_the_largest_is_proportional():
    c = interpolate(PROF, BLOCK, 1, 32, 64)
    assert c.forward_s == pytest.approx(12.0)
    assert c.activation_bytes == 3200


def test_below_the_smallest_is_linear_clamped_between_proportional_and_flat():
    c = interpolate(PROF, BLOCK, 1, 1, 64)
    # linear through (2, 1.0) and (4, 1.5) gives 0.75, inside [0.5, 1.0]
    assert c.forward_s == pytest.approx(0.75)
    steep = profile(point(2, 1.0, 200), point(4, 10.0, 400))
    assert interpolate(steep, BLOCK, 1, 1, 64).forward_s == pytest.approx(0.5)  # proportional floor
    falling = profile(point(2, 1.0, 200), point(4, 0.5, 400))  # noise: the larger point was faster
    assert interpolate(falling, BLOCK, 1, 1, 64).forward_s == pytest.approx(1.0)  # flat ceiling


def test_unmeasured_width_sequence_or_kind_is_none():
    assert interpolate(PROF, BLOCK, 2, 4, 64) is None
    assert interpolate(PROF, BLOCK, 1, 4, 128) is None
    assert interpolate(PROF, SPEC.kinds["head"], 1, 4, 64) is None


def test_fit_recovers_latency_and_bandwidth():
    sizes = [4096 * 4**i for i in range(8)]
    times = [20e-6 + b / 5e9 for b in sizes]
    fit = fit_latency_bandwidth(sizes, times)
    assert fit.latency_s == pytest.approx(20e-6, rel=1e-6)
    assert fit.bandwidth_gbps == pytest.approx(5.0, rel=1e-6)
    assert max(relative_errors(fit, sizes, times)) < 1e-9


def test_fit_never_returns_negative_latency():
    sizes = [1e3, 1e4, 1e5]
    fit = fit_latency_bandwidth(sizes, [0.5e-6, 1e-5, 1e-4])  # a free fit would cross zero
    assert fit.latency_s == 0 and fit.bandwidth_gbps == pytest.approx(1.5)  # sum(x/t) / sum((x/t)^2)


def test_no_fit_where_time_does_not_grow_with_size():
    assert fit_latency_bandwidth([4096, 16384, 65536], [1e-3, 0.9e-3, 0.95e-3]) is None


def test_bus_bytes_ring_conventions():
    assert bus_bytes("all_reduce", 1000, 4) == 1500
    assert bus_bytes("all_gather", 1000, 4) == 750
    assert bus_bytes("reduce_scatter", 1000, 2) == 500
    assert bus_bytes("p2p", 1000, 2) == 1000


def test_interpolate_and_fit_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from partita.profile import layer_cost_at as interpolate\n"
            "from partita.profiler.fit import fit_latency_bandwidth\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    subprocess.run([sys.executable, "-c", code], check=True)
