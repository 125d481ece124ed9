"""CPU profiling numbers for the docs: tiny models' wall time, activation agreement, comm fit error.

    OMP_NUM_THREADS=1 python benchmarks/profile_cpu.py

Profiles ``tiny-llama`` and ``tiny-gpt2`` (micro-batches 1,4,16; every TP width the CLI
defaults to), compares activation memory with ``search.analytic``, then spawns 4 gloo ranks
and reports, for each collective fit, the relative error on a held-back message size.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from partita.cli.profile import main as profile_main
from partita.cli.profile_compare import compare
from partita.profile import Profile
from partita.profiler.comm import CommOptions, spawn_and_measure
from partita.profiler.fit import fit_latency_bandwidth, relative_errors
from partita.units import KiB, MiB


def layers(tmp: Path) -> None:
    for model in ("tiny-llama", "tiny-gpt2"):
        out = tmp / f"{model}.yaml"
        start = time.perf_counter()
        assert profile_main(["--model", model, "--device", "cpu", "--micro-batches", "1,4,16", "-o", str(out)]) == 0
        wall = time.perf_counter() - start
        prof = Profile.load(out)
        ratios = [c.ratio("activation_bytes") for c in compare(prof.layers, "cpu", "fp32") or []]
        print(f"RESULT {model}: {len(prof.layers)} points in {wall:.1f} s; activation measured/analytic "
              f"min {min(ratios):.3f} max {max(ratios):.3f}" if ratios else f"RESULT {model}: {wall:.1f} s")


def comm(held_back: int = 256 * KiB) -> None:
    start = time.perf_counter()
    samples = spawn_and_measure(CommOptions(min_bytes=4 * KiB, max_bytes=4 * MiB), 4)
    print(f"RESULT comm: {len(samples)} points on 4 gloo ranks in {time.perf_counter() - start:.1f} s")
    errors = []
    for key in sorted({(s.op, s.ranks) for s in samples}):
        pts = [s for s in samples if (s.op, s.ranks) == key]
        train = [s for s in pts if s.message_bytes != held_back]
        held = next(s for s in pts if s.message_bytes == held_back)
        fit = fit_latency_bandwidth([s.bus_bytes for s in train], [s.seconds for s in train])
        err = relative_errors(fit, [held.bus_bytes], [held.seconds])[0]
        errors.append(err)
        print(f"RESULT   {key[0]:>14s} x{key[1]}: latency {fit.latency_s * 1e6:7.0f} us, {fit.bandwidth_gbps:5.2f} GB/s; "
              f"held-back {held_back // KiB} KiB measured {held.seconds * 1e6:6.0f} us, "
              f"predicted {fit.predict_s(held.bus_bytes) * 1e6:6.0f} us ({err:.0%})")
    print(f"RESULT comm held-back error: median {statistics.median(errors):.0%}, max {max(errors):.0%}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        layers(Path(tmp))
    comm()
    sys.exit(0)
