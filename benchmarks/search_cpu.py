"""CPU seconds of one search instance in this process: for comparing two checkouts of the code
run alternately on the same machine (docs/benchmarks.md, "Current figures").

    python benchmarks/search_cpu.py mixed [RUNS]       # llama-2-70b, 4x8xH100+8x8xA100-80GB+4x8xA100-40GB, --gap 1
    python benchmarks/search_cpu.py mixed-uni [RUNS]   # the same, --search uniform
    python benchmarks/search_cpu.py gpt3 [RUNS]        # gpt3-175b on 128x8xH100, --gap 1

OR-Tools is imported before the timing; the least of RUNS runs (default 2) is printed, with the
plan's predicted step so the two checkouts can be seen to plan alike.
"""

from __future__ import annotations

import sys
import time

import partita.search.cpsat  # noqa: F401  (OR-Tools, imported before the timing)
from partita.cluster import parse_short
from partita.search.planner import PlanRequest, make_plan

try:
    from partita.model_io import load_model
except ImportError:  # a checkout from before issue 22 (the comparison's "before")
    from partita.model import load_model

CASES = {"mixed": ("llama-2-70b", "4x8xH100+8x8xA100-80GB+4x8xA100-40GB", 0.01, "cpsat"),
         "mixed-uni": ("llama-2-70b", "4x8xH100+8x8xA100-80GB+4x8xA100-40GB", 0.0, "uniform"),
         "gpt3": ("gpt3-175b", "128x8xH100", 0.01, "cpsat")}


def main() -> None:
    which = sys.argv[1]
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    name, cluster_text, gap, search = CASES[which]
    model, cluster = load_model(name), parse_short(cluster_text)
    least = float("inf")
    for _ in range(runs):
        start = time.process_time()
        plan, _ = make_plan(PlanRequest(model=model, cluster=cluster, seq_len=model.seq_len,
                                        global_batch=model.default_global_batch, gap=gap, search=search))
        least = min(least, time.process_time() - start)
    print(f"{which}: {least:.2f} s cpu, step {plan.prediction.step_time_s:.3f} s")


if __name__ == "__main__":
    main()
