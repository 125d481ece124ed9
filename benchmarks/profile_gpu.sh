#!/usr/bin/env bash
# One command for a GPU session: profile llama-3-8b and llama-2-70b into configs/profiles/h200-*.yaml
# and print the measured-vs-analytic tables and the timing summary. Run from the repository root.
#   bash benchmarks/profile_gpu.sh            (add --quick for a smoke test)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU'; print(torch.cuda.get_device_name(0), torch.__version__)"
"$PY" benchmarks/profile_gpu.py "$@" 2>&1 | tee configs/profiles/profile_gpu.log
