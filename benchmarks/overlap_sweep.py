"""Price the published runs at several values of the Hopper matrix products' slowdown beside a
data-parallel collective (``search/timing.py``, ``HOPPER_GEMM_OVERLAP_SLOWDOWN``) and print, per
source, how the rows it moves read: the check behind the value the cost model takes.

    python benchmarks/overlap_sweep.py [--values 0.189 0.3 0.4 0.5 0.6 0.7]

At 0.189 (the average slowdown, ``OVERLAP_SLOWDOWN_GPU``) the products slow as the other kernels
do, i.e. the term is off. The rows it moves are split into MosaicML's FSDP rows, the other ZeRO-2/3 rows, and the ZeRO-0/1
rows it touches only through the gradients' reduction beside the backward; each set's median
|error| and mean signed error is printed for every value.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published_runs as pr  # noqa: E402

from partita.search import timing  # noqa: E402


def errors(runs: list, value: float) -> dict[str, float]:
    saved = timing.HOPPER_GEMM_OVERLAP_SLOWDOWN
    timing.HOPPER_GEMM_OVERLAP_SLOWDOWN = value
    try:
        return {run.id: pr.price(run).error_pct for run in runs}
    finally:
        timing.HOPPER_GEMM_OVERLAP_SLOWDOWN = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=float, nargs="+", default=[timing.OVERLAP_SLOWDOWN_GPU, 0.3, 0.4, 0.5, 0.6, 0.7])
    args = ap.parse_args(argv)
    runs = [r for r in pr.load_runs() if r.pricing != "not_expressible"]
    table = {v: errors(runs, v) for v in args.values}
    off = errors(runs, timing.OVERLAP_SLOWDOWN_GPU)
    moved = {r.id: r for r in runs if any(abs(t[r.id] - off[r.id]) > 0.05 for t in table.values())}
    sets = {"MosaicML's FSDP rows": [i for i in moved if i.startswith("mpt-")],
            "the other ZeRO-2/3 rows": [i for i, r in moved.items() if not i.startswith("mpt-") and r.zero >= 2],
            "ZeRO-0/1 rows (the gradients' reduction only)": [i for i, r in moved.items() if r.zero < 2]}
    for name, ids in sets.items():
        print(f"{name}: {len(ids)}" + (f" ({', '.join(ids)})" if len(ids) < 20 else ""))
    print("| products' slowdown | " + " | ".join(f"{name}: median abs error | mean signed" for name in sets) + " |")
    print("| --- " * (1 + 2 * len(sets)) + "|")
    for v, e in table.items():
        cells = []
        for ids in sets.values():
            cells += [f"{statistics.median(abs(e[i]) for i in ids):.1f} %", f"{statistics.mean(e[i] for i in ids):+.1f} %"]
        print(f"| {v:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
