"""FP8 products against the runs measured both ways: the DGX Cloud recipes' BF16 and FP8 columns.

    python benchmarks/fp8_pairs.py

Each ``dgxc-*-fp8`` row of ``benchmarks/published_runs.yaml`` is its BF16 twin's recipe, layout
and GPUs with FP8 products, so a pair checks the FP8 term alone (``docs/calibration.md``, "FP8
products"). Prints, for every pair, the measured and predicted speedup of FP8 over BF16 and the
FP8 row's error; then the speedups' error (predicted over measured, minus one) over all pairs
three ways: as priced, with FP8 products at twice bf16's rate (the datasheets' ratio:
``roofline.FP8_OVER_BF16_SHARE`` set to 1), and without the casts FP8 adds (``kernels.fp8_casts``
priced at nothing). Last, the share of a block's activations FP8's one-byte saved inputs take off
(``analytic.activation_bytes``, ``fp8_inputs``) as the megatron engine's kernels keep them.
"""

from __future__ import annotations

import statistics
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import published_runs as pr  # noqa: E402

from partita.model import BUILTIN  # noqa: E402
from partita.search import kernels, roofline  # noqa: E402
from partita.search.analytic import activation_bytes  # noqa: E402

SUFFIX = "-fp8"


def pairs(runs) -> list[tuple]:
    """(FP8 run, its BF16 twin) for every FP8 recipe row."""
    by_id = {r.id: r for r in runs}
    return [(r, by_id[r.id.removesuffix(SUFFIX)]) for r in runs
            if r.id.startswith("dgxc-") and r.id.endswith(SUFFIX) and r.id.removesuffix(SUFFIX) in by_id]


def speedups(pairs_) -> list[tuple[str, float, float, float]]:
    """(id, measured speedup, predicted speedup, FP8 row's error %) of each pair."""
    out = []
    for fp8_run, bf16_run in pairs_:
        fp8, bf16 = pr.price(fp8_run), pr.price(bf16_run)
        out.append((fp8_run.id, fp8.measured_tokens_per_s_per_gpu / bf16.measured_tokens_per_s_per_gpu,
                    fp8.predicted_tokens_per_s_per_gpu / bf16.predicted_tokens_per_s_per_gpu, fp8.error_pct))
    return out


def summary(rows) -> tuple[float, float]:
    """Median and largest |predicted / measured speedup - 1|, in %."""
    errors = [abs(p / m - 1) * 100 for _, m, p, _ in rows]
    return statistics.median(errors), max(errors)


@contextmanager
def counterfactual(share: float | None = None, casts: bool = True) -> Iterator[None]:
    """The FP8 term with its share of the peak replaced, or its casts priced at nothing."""
    saved_share, saved_casts = roofline.FP8_OVER_BF16_SHARE, kernels.fp8_casts
    try:
        if share is not None:
            roofline.FP8_OVER_BF16_SHARE = share
        if not casts:
            kernels.fp8_casts = lambda kind, sh, impl="transformer_engine": {k: (0.0, 0.0) for k in saved_casts(kind, sh, impl)}
        yield
    finally:
        roofline.FP8_OVER_BF16_SHARE, kernels.fp8_casts = saved_share, saved_casts


def saved_inputs_share(model: str, tp: int, sp: bool) -> float:
    """The fraction of one block's activations (seq 8,192, micro-batch 1, the megatron engine's
    kernels) that FP8's one-byte saved inputs take off."""
    kind = BUILTIN[model].kinds["block"]
    kw = dict(tp=tp, micro_batch=1, seq_len=8192, dtype="bf16", glu_saves="input", qkv_saves="fused",
              sequence_parallel=sp, sharded_inputs=sp)
    return 1 - activation_bytes(kind, fp8_inputs=True, **kw) / activation_bytes(kind, **kw)


def main() -> int:
    console = Console()
    both = pairs(pr.load_runs())
    rows = speedups(both)
    t = Table(title="FP8 over BF16, the same recipe, layout and GPUs (DGX Cloud recipes, H100)")
    for col in ("FP8 row", "measured speedup", "predicted", "predicted / measured", "FP8 row's error %"):
        t.add_column(col, justify="right" if col != "FP8 row" else "left")
    for rid, measured, predicted, error in rows:
        t.add_row(rid, f"{measured:.3f}x", f"{predicted:.3f}x", f"{predicted / measured - 1:+.1%}", f"{error:+.1f}")
    console.print(t)
    s = Table(title=f"the speedups' |error| over {len(rows)} pairs, %")
    for col in ("FP8 term", "median", "largest"):
        s.add_column(col, justify="right" if col != "FP8 term" else "left")
    for label, kwargs in ((f"as priced (share {roofline.FP8_OVER_BF16_SHARE:.3f}, casts)", {}),
                          ("twice bf16's rate (share 1)", {"share": 1.0}), ("without the casts", {"casts": False})):
        with counterfactual(**kwargs):
            median, largest = summary(speedups(both))
        s.add_row(label, f"{median:.1f}", f"{largest:.1f}")
    console.print(s)
    for model, tp, sp in (("llama-3-8b", 1, False), ("llama-3-405b", 8, True)):
        console.print(f"FP8's saved inputs: {saved_inputs_share(model, tp, sp):.1%} of a {model} block's activations "
                      f"at tp {tp}{' with sequence parallelism' if sp else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
