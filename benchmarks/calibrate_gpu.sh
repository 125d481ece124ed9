#!/usr/bin/env bash
# The calibration loop on one GPU (docs/calibration.md): launch a host-bound and a compute-bound
# plan, calibrate the device's time constants on them, and check the profile on two plans it was
# not fitted on. The plans are committed (benchmarks/data/gpu-calibration, made with
# `partita plan --cluster 1xH200 --pp 1 ...`): the GPU machine has no OR-Tools to plan with.
#
#   OUT=/tmp/gpu bash benchmarks/calibrate_gpu.sh     # about 2 minutes on one H200
#
# Writes $OUT/calibration/: each run's directory and log, h200-calibrated.yaml (the profile) and
# calibrate.txt (the fit, and the held-out plans predicted against measured).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}/calibration
PY=${PYTHON:-python3}
PLANS=${PLANS:-benchmarks/data/gpu-calibration}
mkdir -p "$OUT"
for p in tiny-mb1 llama1b-mb8 llama1b-mb2 llama1b-mb4-recompute; do
    timeout 120 "$PY" -m partita.cli launch "$PLANS/$p.yaml" --steps 15 --metrics "$OUT/$p/metrics.jsonl" \
        >"$OUT/$p.log" 2>&1 || echo "launch of $p failed: see $OUT/$p.log"
    grep -v '^\[rank' "$OUT/$p.log" | tail -4
done
"$PY" -m partita.cli calibrate "$OUT/tiny-mb1" "$OUT/llama1b-mb8" -o "$OUT/h200-calibrated.yaml" \
    --check "$OUT/llama1b-mb2" "$OUT/llama1b-mb4-recompute" 2>&1 | tee "$OUT/calibrate.txt"
