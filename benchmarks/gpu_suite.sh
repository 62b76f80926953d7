#!/usr/bin/env bash
# One prepared GPU check: run from the repository root on a CUDA machine with torch and diffusers installed
# (no Hub access needed). Prints JSON and writes benchmarks/results/gpu_suite.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
python -c "import diffusers_stepbatch" 2>/dev/null || pip install --quiet -e .
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python benchmarks/gpu_suite.py "$@"
