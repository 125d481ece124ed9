"""Compute: a layer's forward, backward and recompute time on one device, and the constants
that scale it.

Forward, backward and recompute time of a layer's 1/tp shard come from a measured profile of
that device type when it has the point (interpolated in micro-batch), else from the analytic
roofline (``partita.search.analytic``); the cost model records which (``CostModel.cost_sources``).
Full recomputation repeats the forward; selective recomputation its share that is not matrix
products (``selective_recompute_s``).

Host overhead: an analytic layer pass takes max(device time, ops x per-op overhead) on a GPU and
their sum on a CPU rank (``timing.host_bound_s``); a profile's calibration scales the device
time and sets the overhead (``time_constants``). On a CPU rank each micro-batch's passes over a
layer's weights stream at a weight-stream bandwidth and add (``roofline.cpu_weight_stream_s``,
``weight_stream_gbps``). Adam's update is memory-bound (``optimizer_s``).
"""

from __future__ import annotations

import dataclasses

from partita.cluster import ClusterSpec, NodeGroup
from partita.devices import get_device
from partita.profile import LayerCost, Profile, layer_cost_at
from partita.search.analytic import (Shard, attention_s, backward_time_s, column_wgrad_times_s, forward_time_s,
                                     layer_cost, linear_times_s, selective_recompute_time_s, sequence_parallel_savings_s)
from partita.search.roofline import cpu_weight_stream_s, is_hopper
from partita.search.timing import TimeConstants, default_constants, host_bound_s, layer_ops

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Adam's update reads and writes master weights, m, v (fp32) and reads the gradient: bytes
# touched per parameter of the local shard.
OPTIMIZER_BYTES_PER_PARAM = 32


def default_dtype(cluster: ClusterSpec) -> str:
    """fp32 on CPU ranks; bf16 on GPUs, or fp16 where a device has no bf16 (V100)."""
    if cluster.is_cpu:
        return "fp32"
    if any(get_device(d).bf16_tflops == 0 for d in cluster.device_types):
        return "fp16"
    return "bf16"


def calibrated(profile: Profile | None, dtype: str) -> bool:
    return profile is not None and profile.calibration is not None and profile.dtype == dtype


def measures(profile: Profile | None, cm) -> bool:
    """Whether ``profile``'s measured layers price the cost model ``cm``'s: measured in its dtype,
    and with the compute dtype's products (the profiler runs no FP8 products: under the engine's
    ``matmul`` "fp8" the layers are analytic, a calibration's constants still applied)."""
    return profile is not None and profile.dtype == cm.dtype and cm.engine.matmul == "compute"


def time_constants(profile: Profile | None, device: str, dtype: str) -> TimeConstants:
    """The device type's time constants: its profile's calibration, else the defaults, with
    the per-op overhead its profile measured (``Profile.op_overhead_s``) if it did."""
    if calibrated(profile, dtype):
        cal = profile.calibration
        return TimeConstants(compute_scale=cal.compute_scale, op_overhead_s=cal.op_overhead_s,
                             overlap_slowdown=cal.overlap_slowdown, step_overhead_s=cal.step_overhead_s)
    dev = get_device(device)
    defaults = default_constants(dev.is_cpu, hopper=is_hopper(dev))
    if profile is not None and profile.op_overhead_s is not None:
        return dataclasses.replace(defaults, op_overhead_s=profile.op_overhead_s)
    return defaults


def weight_stream_gbps(profile: Profile | None, device: str, dtype: str) -> float | None:
    """The bandwidth passes over the weights and the optimizer's state stream at on a CPU rank
    (``roofline.cpu_weight_stream_s``), as its profile's calibration fitted it. None on GPUs,
    without a calibration (the plain CPU roofline, whose bytes term stands in for it) and for a
    calibration without the term (its other constants were fitted without it)."""
    if not get_device(device).is_cpu or not calibrated(profile, dtype):
        return None
    return profile.calibration.weight_stream_gbps


def optimizer_s(group: NodeGroup, params: int) -> float:
    """Adam's update of ``params`` local parameters: memory-bound."""
    return params * OPTIMIZER_BYTES_PER_PARAM / (group.device_type.hbm_gbps * 1e9)


def layer_compute(cm, role: str, device: str, tp: int, micro_batch: int) -> tuple[LayerCost, str]:
    """One layer shard's compute on ``device`` at the cost model ``cm``'s sequence length and
    dtype, and where it came from: "measured", "calibrated" or "analytic"."""
    kind = cm.model.kinds[role]
    profile = cm.profiles.get(device)
    if measures(profile, cm):
        measured = layer_cost_at(profile, kind, tp, micro_batch, cm.seq_len)
        if measured is not None:
            return measured, "measured"
    dev = get_device(device)
    c = layer_cost(kind, dev, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype,
                   attention=cm.software.attention, kernels=cm.engine.kernels)
    k = cm.time_constants(device)
    source = "calibrated" if calibrated(profile, cm.dtype) else "analytic"
    # The roofline's device time, scaled by a calibration, and the host's eager ops: a pass
    # takes the larger of the two on a GPU, their sum on a CPU (search/timing.py).
    ops_fwd, ops_bwd = layer_ops(kind)
    fwd = host_bound_s(k.compute_scale * c.forward_s, ops_fwd, k.op_overhead_s, dev.is_cpu)
    bwd = host_bound_s(k.compute_scale * c.backward_s, ops_bwd, k.op_overhead_s, dev.is_cpu)
    stream = cm.weight_stream_gbps(device)
    if stream is not None:  # CPU ranks: the passes over the weights add (roofline.cpu_weight_stream_s)
        fwd_w, bwd_w = cpu_weight_stream_s(c.param_bytes / cm.elem, cm.elem, stream, product=kind.role != "embed")
        fwd, bwd = fwd + fwd_w, bwd + bwd_w
    return dataclasses.replace(c, forward_s=fwd, backward_s=bwd, recompute_s=fwd), source


def selective_recompute_s(cm, role: str, device: str, tp: int, micro_batch: int) -> float:
    """A selectively recomputed block runs its forward again without the matrix products
    (``analytic.selective_recompute_time_s``), but every op of it passes through torch's
    selective-checkpoint dispatch again, a kept product's too: the host's ops are the
    forward's. From a measured profile: the profiler's measurement, or where it has none its
    full recompute time times the analytic share."""
    kind, dev = cm.model.kinds[role], get_device(device)
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    if cm.engine.selective_scope == "attention":  # Megatron-LM: the attention core alone (search/engines.py)
        core = attention_s(dev, sh, cm.dtype, cm.software.attention)[0]
        return core * _pass_scales(cm, role, device, tp, micro_batch)[0]
    selective = selective_recompute_time_s(kind, dev, sh, cm.dtype, cm.software.attention, cm.engine.kernels,
                                           cm.engine.selective_keeps)
    profile = cm.profiles.get(device)
    if measures(profile, cm):
        measured = layer_cost_at(profile, kind, tp, micro_batch, cm.seq_len)
        if measured is not None and measured.selective_recompute_s is not None:
            return measured.selective_recompute_s
        if measured is not None:
            forward = forward_time_s(kind, dev, sh, cm.dtype, cm.software.attention, cm.engine.kernels)
            return measured.recompute_s * selective / forward
    k = cm.time_constants(device)
    return host_bound_s(k.compute_scale * selective, layer_ops(kind)[0], k.op_overhead_s, dev.is_cpu)


def _pass_scales(cm, role: str, device: str, tp: int, micro_batch: int) -> tuple[float, float]:
    """(forward, backward): the layer's passes as the cost model has them (measured, calibrated
    or analytic) over the roofline's, to carry a share the roofline gives of a pass to them."""
    kind, dev = cm.model.kinds[role], get_device(device)
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    c = cm.compute(role, device, tp, micro_batch)
    forward = forward_time_s(kind, dev, sh, cm.dtype, cm.software.attention, cm.engine.kernels)
    backward = backward_time_s(kind, dev, sh, cm.dtype, cm.software.attention, cm.engine.kernels)
    return (c.forward_s / forward if forward > 0 else 0.0), (c.backward_s / backward if backward > 0 else 0.0)


def dgrad_windows_s(cm, role: str, device: str, tp: int, micro_batch: int) -> list[float]:
    """The weight-gradient products of each column-parallel linear of one micro-batch's backward
    (``analytic.column_wgrad_times_s``), at the share of the layer's backward (as the cost model
    has it: measured, calibrated or analytic) that the roofline gives them."""
    kind, dev = cm.model.kinds[role], get_device(device)
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    windows = column_wgrad_times_s(kind, dev, sh, cm.dtype, cm.engine.kernels)
    if not windows:
        return []
    scale = _pass_scales(cm, role, device, tp, micro_batch)[1]
    return [w * scale for w in windows]


def gemm_shares(cm, role: str, device: str, tp: int, micro_batch: int) -> tuple[float, float]:
    """(forward, backward): the share of each of the layer's passes its matrix products take
    (``linear_windows_s`` over the pass): what a data-parallel collective beside the pass slows
    by the products' rate (``TimeConstants.collective_slowdown``)."""
    cache = cm.__dict__.setdefault("_gemm_shares", {})  # a cost model's engine and sequence are fixed
    key = (role, device, tp, micro_batch)
    if key not in cache:
        c = cm.compute(role, device, tp, micro_batch)
        products = linear_windows_s(cm, role, device, tp, micro_batch).values()
        cache[key] = (sum(f for f, _ in products) / c.forward_s if c.forward_s > 0 else 0.0,
                      sum(b for _, b in products) / c.backward_s if c.backward_s > 0 else 0.0)
    return cache[key]


def linear_windows_s(cm, role: str, device: str, tp: int, micro_batch: int) -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds of each of the layer's products by name
    (``analytic.linear_times_s``) at the share of the layer's passes (measured, calibrated or
    analytic) that the roofline gives them."""
    kind, dev = cm.model.kinds[role], get_device(device)
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    fwd_scale, bwd_scale = _pass_scales(cm, role, device, tp, micro_batch)
    return {name: (f * fwd_scale, b * bwd_scale)
            for name, (f, b) in linear_times_s(kind, dev, sh, cm.dtype, cm.engine.kernels).items()}


def sequence_parallel_savings(cm, role: str, device: str, tp: int, micro_batch: int,
                              recompute: str) -> tuple[float, float]:
    """(forward, backward with its recomputation) seconds sequence parallelism takes off one
    micro-batch of the layer: its residual-stream kernels on 1/tp of the tokens
    (``analytic.sequence_parallel_savings_s``), at the share of the layer's passes (measured,
    calibrated or analytic) that the roofline gives them. The recomputed forward saves what it
    reruns: all of it under full recomputation, all but the final residual add under the "ops"
    selective scope, nothing under the "attention" one."""
    if tp <= 1:
        return 0.0, 0.0
    kind, dev = cm.model.kinds[role], get_device(device)
    sh = Shard.of(kind, tp=tp, micro_batch=micro_batch, seq_len=cm.seq_len, dtype=cm.dtype)
    per_kernel = sequence_parallel_savings_s(kind, dev, sh, tp, cm.engine.kernels)
    forward = [f for f, _ in per_kernel]
    if not any(forward):
        return 0.0, 0.0
    rerun = {"full": sum(forward), "none": 0.0}.get(recompute)
    if rerun is None:  # selective
        rerun = 0.0 if cm.engine.selective_scope == "attention" else sum(forward[:-1])
    fwd_scale, bwd_scale = _pass_scales(cm, role, device, tp, micro_batch)
    return fwd_scale * sum(forward), bwd_scale * sum(b for _, b in per_kernel) + fwd_scale * rerun
