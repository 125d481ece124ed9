"""Plan a fixed list of requests and compare the plans' choices and predictions with a record.

    python benchmarks/plan_diff.py --record before.json   # plan every request, write the digest
    python benchmarks/plan_diff.py --against before.json  # plan again, print what differs (exit 1)
    python benchmarks/plan_diff.py --only 3,7 --against before.json

A refactoring that should change nothing is checked by recording before it and comparing after.
Each request runs as `partita plan` does (a separate process: the CLI, the search, the file
written), and the digest keeps what a plan decides and predicts: the degrees, the schedule, the
micro-batching, every stage's ranks, groups, chunks and per-layer choices, the prediction, and the
solver's status, objective and bound (not its wall time, version or worker count). Requests that
exit non-zero are recorded by their exit code and first line of stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

# The search benchmark's instances (benchmarks/search_targets.py), the README's and docs' examples,
# and one request per dimension of the space (cp, ep, replicas, uniform search, interleaving, CPU).
REQUESTS = [
    "--model llama-2-70b --cluster 8x8xH100",
    "--model gpt3-175b --cluster 128x8xH100 --gap 1",
    "--model llama-2-70b --cluster 4x8xH100+8x8xA100-80GB+4x8xA100-40GB --gap 1",
    "--model llama-3-405b --cluster 256x8xH100",
    "--model gpt2-medium --cluster 20x4xA100-40GB --global-batch 1000",
    "--model gpt2-medium --cluster 2x8xH100+6x8xV100-32GB --global-batch 512",
    "--model llama-3-8b --cluster 2x8xH100+2x8xA100-80GB",
    "--model llama-2-70b --cluster 8x8xH100 --pp 8 --global-batch 64",
    "--model llama-2-7b --cluster 4x8xH100 --search uniform",
    "--model llama-2-13b --cluster 2x8xA100-80GB --pp 8",
    "--model llama-3-8b --cluster 1x8xH100 --seq-len 32768 --global-batch 8",
    "--model llama-3-8b --cluster 2x8xH100 --seq-len 16384 --global-batch 16 --cp 2,4 --cp-variant ring",
    "--model mixtral-8x7b --cluster 4x8xH100 --global-batch 64",
    "--model tiny-moe --cluster 4xcpu",
    "--model tiny-llama --cluster 4xcpu",
    "--model gpt2 --cluster 2xcpu --global-batch 8",
    "--model llama-3-8b --cluster 4x8xA100-80GB --objective cost --release-idle",
    "--model llama-2-7b --cluster 2x8xH100 --micro-batch 2 --zero 1,3 --no-recompute",
]


def digest(plan: dict) -> dict:
    """What a plan decides and predicts, in a form that does not depend on the file's schema."""
    mesh = plan.get("mesh") or {}
    degrees = {k: plan.get(k, mesh.get(k, 1)) for k in ("pp", "dp", "cp", "tp", "ep")}
    stages = [{k: s.get(k) for k in ("group", "device", "ranks", "chunks", "replica_groups")} |
              {"layers": [{k: v for k, v in l.items()} for l in s["layers"]]} for s in plan["stages"]]
    solver = plan.get("solver") or {}
    return {"degrees": degrees,
            "batch": {k: plan.get(k) for k in ("seq_len", "global_batch", "micro_batch", "num_micro_batches",
                                              "batch_shares", "micro_batch_sizes", "schedule", "cp_variant")},
            "stages": stages, "prediction": plan.get("prediction"),
            "solver": {k: solver.get(k) for k in ("method", "status", "objective_us", "bound_us")}}


def plan_one(args: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.yaml"
        proc = subprocess.run([sys.executable, "-m", "partita.cli", "plan", *args.split(), "-o", str(out)],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONHASHSEED="0"))
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or [""])[-1]
            return {"exit": proc.returncode, "error": first}
        return {"exit": 0, "plan": digest(yaml.safe_load(out.read_text()))}


def differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += differences(a.get(k), b.get(k), f"{where}.{k}" if where else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {json.dumps(a)[:160]} -> {json.dumps(b)[:160]}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", help="write the digests to this JSON file")
    ap.add_argument("--against", help="compare with the digests in this JSON file")
    ap.add_argument("--only", help="comma-separated request numbers (0-based) to run")
    args = ap.parse_args()
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(REQUESTS))
    old = json.loads(Path(args.against).read_text()) if args.against else {}
    results, changed = {}, 0
    for i in chosen:
        request = REQUESTS[i]
        results[request] = got = plan_one(request)
        status = f"exit {got['exit']}" if got["exit"] else "planned"
        if args.against:
            diff = differences(old.get(request), got) if request in old else ["(not in the record)"]
            changed += bool(diff)
            print(f"[{i}] {request}: {status}, {'identical' if not diff else f'{len(diff)} differences'}", flush=True)
            for d in diff[:12]:
                print(f"      {d}")
        else:
            print(f"[{i}] {request}: {status}", flush=True)
    if args.record:
        tmp = Path(args.record).with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
        tmp.replace(args.record)
    if args.against:
        print(f"{changed} of {len(results)} requests differ")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
