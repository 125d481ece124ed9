"""Each memory-contract plan's predicted peak against the peak torch's memory trackers measure on
CPU ranks (the plans and the measurement of tests/test_runtime_memory.py), per stage: the
predicted total and moment, the tracked peak total, and the tracked bytes at the moment the plan
names. Prints a table; about two minutes on two cores.

    python benchmarks/memory_moments.py [PLAN ...]
"""

import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from runtime_helpers import run_ranks  # noqa: E402
from test_runtime_memory import CFG, MEMORY_PLANS, _measure_rank, predicted  # noqa: E402


def main(names: list[str]) -> None:
    table = Table(title="memory: predicted against tracked, per stage (reserve excluded)")
    for col in ("plan", "stage", "predicted peak", "at", "tracked peak", "error", "tracked at that moment"):
        table.add_column(col, justify="right" if col not in ("plan", "at") else "left")
    for name in names or list(MEMORY_PLANS):
        plan = MEMORY_PLANS[name]
        prediction = predicted(plan)
        seen = set()
        for measured in run_ranks(_measure_rank, plan.world_size, plan.to_dict(), CFG):
            stage = measured["stage"]
            if stage in seen:
                continue
            seen.add(stage)
            moment, want = prediction[stage]
            total, peak = sum(want.values()), sum(measured["memory"].values())
            at = measured["moments"].get(moment)
            table.add_row(name, str(stage), f"{total:,}", moment, f"{peak:,}", f"{peak / total - 1:+.1%}",
                          f"{sum(at.values()):,}" if at else "-")
    Console().print(table)


if __name__ == "__main__":
    main(sys.argv[1:])
