"""The launch floor: the host's dispatch costs fitted to the H200 kernel data, and what they price.

Run from the repository root::

    python benchmarks/launch_floor.py                  # ../shared/data/h200
    python benchmarks/launch_floor.py path/to/h200     # a folder with gemm.jsonl and attn.jsonl

It derives, from the isolated eager calls in the files, the host's time for one matrix product,
one SDPA forward and one SDPA backward (with a backward call's fixed cost), prints them beside
the constants committed in ``search/timing.py`` (``H200_DISPATCH``), and prices a llama-3-8b
decoder block on the H200 (micro-batch 1, 2048 tokens, tp 1-8, with and without full
recompute) with the previous GPU default (5 us every op) and the current one, term by term.
docs/calibration.md ("The launch floor") has the table and what the data leave open.

A call is host-bound when its kernel, at the best rate the file measures for that kernel, would
last under a third of the file's fastest call: its event-to-event time is then the host's
dispatch (the kernel starts only once launched; the end event is queued once the call returns).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from partita.cluster import parse_short
from partita.devices import get_device
from partita.model_io import load_model
from partita.profile import Profile, Provenance
from partita.search import roofline, timing
from partita.search.analytic import layer_cost
from partita.search.costs.model import CostModel

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "h200"
HOST_BOUND_SHARE = 1 / 3  # a call's kernel under this share of the fastest call: host-bound
PREVIOUS_GPU_OP_S = 5e-6  # the GPU default before issue 23 item 5 (assumed, every op alike)
MODEL, TOKENS, TPS = "llama-3-8b", 2048, (1, 2, 4, 8)


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _host_bound(times: list[float], flops: list[float]) -> list[float]:
    """The times of the calls whose kernel, at the best measured rate, lasts under
    ``HOST_BOUND_SHARE`` of the fastest call."""
    best_rate, fastest = max(f / t for f, t in zip(flops, times)), min(times)
    return [t for f, t in zip(flops, times) if f / best_rate < HOST_BOUND_SHARE * fastest]


def product_dispatch_s(folder: Path) -> tuple[float, int]:
    """(median seconds, points) of the host-bound products in ``gemm.jsonl``."""
    rows = read_jsonl(folder / "gemm.jsonl")
    times = _host_bound([r["s"] for r in rows], [2.0 * r["m"] * r["n"] * r["k"] for r in rows])
    return statistics.median(times), len(times)


def attention_dispatch_s(folder: Path) -> tuple[tuple[float, int], tuple[float, int]]:
    """((forward seconds, points), (backward seconds, points)) of the host-bound SDPA calls in
    ``attn.jsonl``: the forward as timed, the backward as forward+backward less the forward."""
    rows = read_jsonl(folder / "attn.jsonl")
    flops = [roofline.attention_flops_bytes(r["b"], r["heads"], r["seq"], r["head_dim"], causal=r["causal"],
                                            dtype="bf16")[0] for r in rows]
    forward = _host_bound([r["fwd_s"] for r in rows], flops)
    backward = _host_bound([r["fwd_bwd_s"] - r["fwd_s"] for r in rows],
                           [roofline.ATTENTION_BWD_FLOPS_RATIO * f for f in flops])
    return (statistics.median(forward), len(forward)), (statistics.median(backward), len(backward))


def fitted_dispatch(folder: Path) -> timing.DispatchCosts:
    """The dispatch costs the files give; the other ops' cost is not in them (the committed one)."""
    (product, _), ((fwd, _), (bwd, _)) = product_dispatch_s(folder), attention_dispatch_s(folder)
    return timing.DispatchCosts(product=product, attention_forward=fwd, attention_backward=bwd,
                                other=timing.H200_DISPATCH.other)


@dataclasses.dataclass(frozen=True)
class BlockPrice:
    tp: int
    device_fwd_s: float  # the roofline's kernels, their floors included
    device_bwd_s: float
    old_fwd_s: float  # priced with 5 us every op
    old_bwd_s: float
    new_fwd_s: float  # priced with the current default
    new_bwd_s: float

    def old(self, recompute: bool) -> float:
        return self.old_fwd_s * (2 if recompute else 1) + self.old_bwd_s

    def new(self, recompute: bool) -> float:
        return self.new_fwd_s * (2 if recompute else 1) + self.new_bwd_s

    def by_kind(self, host_fwd_s: float, host_bwd_s: float, recompute: bool) -> float:
        """The block were each pass priced against its own ops' host time (``timing.layer_host_s``)
        rather than its op count times the mean."""
        fwd, bwd = max(self.device_fwd_s, host_fwd_s), max(self.device_bwd_s, host_bwd_s)
        return fwd * (2 if recompute else 1) + bwd


def price_block(tp: int) -> BlockPrice:
    """A llama-3-8b block on the H200 at ``tp``, micro-batch 1, 2048 tokens: the cost model's
    own pricing, with the previous per-op default (a profile carrying only its overhead) and the
    current one."""
    model, cluster = load_model(MODEL), parse_short("8xH200")
    old_profile = Profile(device="H200", dtype="bf16", provenance=Provenance(source="analytic", device_name="H200"),
                          op_overhead_s=PREVIOUS_GPU_OP_S)
    old = CostModel(model, cluster, seq_len=TOKENS, profiles=[old_profile]).compute("block", "H200", tp, 1)
    new = CostModel(model, cluster, seq_len=TOKENS).compute("block", "H200", tp, 1)
    device = layer_cost(model.kinds["block"], get_device("H200"), tp=tp, micro_batch=1, seq_len=TOKENS, dtype="bf16")
    return BlockPrice(tp=tp, device_fwd_s=device.forward_s, device_bwd_s=device.backward_s,
                      old_fwd_s=old.forward_s, old_bwd_s=old.backward_s, new_fwd_s=new.forward_s,
                      new_bwd_s=new.backward_s)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA, help="folder with gemm.jsonl, attn.jsonl")
    args = parser.parse_args(argv)

    committed = timing.H200_DISPATCH
    print(f"host dispatch from {args.data} (median of the host-bound calls) against search/timing.py:")
    if (args.data / "gemm.jsonl").exists():
        (product, n_p), ((fwd, n_f), (bwd, n_b)) = product_dispatch_s(args.data), attention_dispatch_s(args.data)
        rows = [("product (cuBLAS)", product, n_p, committed.product),
                ("SDPA forward", fwd, n_f, committed.attention_forward),
                ("SDPA backward + backward call", bwd, n_b, committed.attention_backward)]
        for name, value, points, kept in rows:
            print(f"  {name:32s} {value * 1e6:7.1f} us  ({points} points)   committed {kept * 1e6:7.1f} us")
    else:
        print(f"  no measurements in {args.data}; the committed constants follow")
    print(f"  {'any other op (not in the data)':32s} {committed.other * 1e6:7.1f} us  (assumed)")
    kind = load_model(MODEL).kinds["block"]
    fwd_ops, bwd_ops = timing.layer_ops(kind)
    host_fwd, host_bwd = timing.layer_host_s(kind)
    products = timing.layer_products(kind)
    print(f"\n{MODEL} block, {fwd_ops} + {bwd_ops} eager ops ({products} + {2 * products} products, one SDPA each way):"
          f" host {_ms(host_fwd)} ms forward = {products} x {committed.product * 1e6:.1f} + "
          f"{committed.attention_forward * 1e6:.1f} + {fwd_ops - products - 1} x {committed.other * 1e6:.0f} us; "
          f"{_ms(host_bwd)} ms backward = {2 * products} x {committed.product * 1e6:.1f} + "
          f"{committed.attention_backward * 1e6:.1f} + {bwd_ops - 2 * products - 1} x {committed.other * 1e6:.0f} us")
    mean = timing.OP_OVERHEAD_S["gpu"]
    print(f"GPU default per op: {mean * 1e6:.2f} us (the mean over those ops; was {PREVIOUS_GPU_OP_S * 1e6:.0f} us)\n")

    print(f"H200, micro-batch 1, {TOKENS} tokens; ms a block (forward + backward, + the forward again with full "
          f"recompute).")
    print("device: the roofline's kernels; old host: ops x 5 us; new host: ops x the default; by kind: each pass"
          " against layer_host_s. A pass takes the larger of device and host.")
    header = (f"{'tp':>3} {'device f':>9} {'device b':>9} {'old host f':>11} {'old host b':>11} {'new host f':>11} "
              f"{'new host b':>11} {'old':>6} {'new':>6} {'by kind':>8} {'old rc':>7} {'new rc':>7} {'kind rc':>8}")
    print(header)
    for tp in TPS:
        p = price_block(tp)
        print(f"{tp:>3} {_ms(p.device_fwd_s):>9} {_ms(p.device_bwd_s):>9} {_ms(fwd_ops * PREVIOUS_GPU_OP_S):>11} "
              f"{_ms(bwd_ops * PREVIOUS_GPU_OP_S):>11} {_ms(fwd_ops * mean):>11} {_ms(bwd_ops * mean):>11} "
              f"{_ms(p.old(False)):>6} {_ms(p.new(False)):>6} {_ms(p.by_kind(host_fwd, host_bwd, False)):>8} "
              f"{_ms(p.old(True)):>7} {_ms(p.new(True)):>7} {_ms(p.by_kind(host_fwd, host_bwd, True)):>8}")
    print("\nissue 23 (measured, not in the repository): 3.0-3.9 ms a block at small shards, 6.6-7.3 ms with recompute")


if __name__ == "__main__":
    main()
