"""Fused attention with and without its causal mask, and few heads at long lengths, timed on one
device beside the cost model's price of the same calls.

    python benchmarks/attention_masks.py --device cuda --out attention_masks.json
    python benchmarks/attention_masks.py --device cpu --seq-lens 256,512 --heads 2,4 --repeats 2   # a dry run

Two of the cost model's attention terms were set from published kernel tables, not from a GPU
here (docs/published_runs.md, thirteenth session), and this is their check:

* a context-parallel ring's steps after the first, and each all-gathered chunk but its own
  block, run with no mask (``search/context.py``, ``attention_time``): the ring's later step is
  half a block of queries against a whole block of keys, unmasked, holding as many pairs as the
  rank's own causal block. The script times both calls, causal over s tokens and s/2 queries
  against s keys unmasked, forward and forward + backward (torch's SDPA: the kernel the
  runtime's ring and all-gather call), and prints their ratio beside the model's.
* past the H200 data's 8192 tokens, a call runs at the rate of as many query tiles at 8192
  (``search/roofline.py``, ``attention_time_s``): the script prints each shape's measured
  TFLOP/s and the model's for the device type given (``--device-type``, the catalog's name).

Times are the median of ``--repeats`` calls after two warm-ups (CUDA events on a GPU). FLOPs are
counted as the model counts them: 4 b h s^2 d forward for the whole square, half when causal,
the backward 2.5x. ``benchmarks/gpu_session.sh`` runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from partita.devices import get_device
from partita.errors import PartitaError
from partita.search.roofline import ATTENTION_BWD_FLOPS_RATIO, attention_time_s


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--device-type", default="H200", help="the catalog's device the model prices (default H200)")
    parser.add_argument("--seq-lens", type=_ints, default=[8192, 16384, 32768, 65536],
                        help="sequence lengths, comma-separated (default 8192,16384,32768,65536)")
    parser.add_argument("--heads", type=_ints, default=[4, 8, 32], help="query heads, comma-separated (default 4,8,32)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per shape; the median counts (default 5)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.head_dim < 1 or any(s % 2 for s in args.seq_lens):
        parser.error("--repeats and --head-dim must be positive and every sequence length even")
    try:
        get_device(args.device_type)
    except PartitaError as e:
        parser.error(str(e))
    return args


def _timed(torch, device: str, fn, repeats: int) -> float:
    """The median of ``repeats`` calls of ``fn`` after two warm-ups, on the profiler's clock."""
    from partita.profiler.timing import Clock, median

    clock = Clock(torch.device(device))
    for _ in range(2):
        fn()
    return median([clock.time(fn) for _ in range(repeats)])


def _call_times(torch, device: str, dtype, *, heads: int, queries: int, keys: int, head_dim: int, causal: bool,
                repeats: int) -> tuple[float, float]:
    """(forward, forward + backward) seconds of one SDPA call: ``queries`` against ``keys``."""
    import torch.nn.functional as F

    q = torch.randn(1, heads, queries, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, heads, keys, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(1, heads, queries, head_dim, device=device, dtype=dtype)

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def both():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)

    return _timed(torch, device, forward, repeats), _timed(torch, device, both, repeats)


def measure(args: argparse.Namespace) -> list[dict]:
    import torch

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model_dtype = "bf16" if args.device == "cuda" else "fp32"
    dev = get_device(args.device_type)
    rows = []
    for seq in args.seq_lens:
        for heads in args.heads:
            pairs_flops = 4.0 * heads * seq * seq * args.head_dim / 2  # the causal square's, and the half block's
            shape = dict(heads=heads, head_dim=args.head_dim, repeats=args.repeats)
            causal = _call_times(torch, args.device, dtype, queries=seq, keys=seq, causal=True, **shape)
            half = _call_times(torch, args.device, dtype, queries=seq // 2, keys=seq, causal=False, **shape)
            m_causal = attention_time_s(dev, 1, heads, seq, args.head_dim, causal=True, dtype=model_dtype)
            m_full = attention_time_s(dev, 1, heads, seq, args.head_dim, causal=False, dtype=model_dtype)
            m_half = tuple(t / 2 for t in m_full)
            rows.append(dict(
                seq=seq, heads=heads, head_dim=args.head_dim, device=args.device, device_type=dev.name,
                causal_fwd_s=causal[0], causal_fwd_bwd_s=causal[1], half_fwd_s=half[0], half_fwd_bwd_s=half[1],
                causal_fwd_tflops=pairs_flops / causal[0] / 1e12,
                causal_fwd_bwd_tflops=(1 + ATTENTION_BWD_FLOPS_RATIO) * pairs_flops / causal[1] / 1e12,
                model_causal_fwd_tflops=pairs_flops / m_causal[0] / 1e12,
                model_causal_fwd_bwd_tflops=(1 + ATTENTION_BWD_FLOPS_RATIO) * pairs_flops / sum(m_causal) / 1e12,
                unmasked_speedup=causal[1] / half[1], model_unmasked_speedup=sum(m_causal) / sum(m_half)))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rows = measure(args)
    print(f"| seq | heads | causal fwd+bwd TFLOP/s | model ({rows[0]['device_type']}) | unmasked half block, "
          f"speed-up over causal | model |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['seq']} | {r['heads']} | {r['causal_fwd_bwd_tflops']:.1f} | {r['model_causal_fwd_bwd_tflops']:.1f} "
              f"| {r['unmasked_speedup']:.2f}x | {r['model_unmasked_speedup']:.2f}x |")
    if args.out is not None:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(rows, indent=1) + "\n")
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
