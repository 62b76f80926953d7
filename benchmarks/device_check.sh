#!/usr/bin/env bash
# Every GPU check of this round in one run (a few minutes on an H200), for a session that is lent a CUDA machine.
#
#   bash benchmarks/device_wheels.sh                     # here: the wheels that machine lacks, into .whl/
#   # there (device tool, carry [".whl"]), from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#       PYTHONPATH=/tmp/site:$PWD bash benchmarks/device_check.sh
#
# Writes into $OUT (the device tool's folder) or benchmarks/results:
# - *.log: what each step printed; device_tests.log: the CUDA-only tests (no host sync in the denoising loop under set_sync_debug_mode("error"),
#   varlen attention = recover-scatter, packed mixed-resolution pipelines on CUDA = their solo runs);
# - gpu_suite.json: throughput vs sequential and the batched ceiling at 512x512 and 1024x1024 (issue 18);
# - mixed_resolution_gpu.json: 512x512 + 768x512 + 1024x1024 requests, per-size vs packed (issue 13);
# - profile_steps.json (+ profile_steps_trace.json.gz): where a round of 8 x 20 steps at 512x512 spends its time.
# Each step has its own time limit, so one that hangs leaves the others their time.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__,
      'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
status=0
run() {  # run <seconds> <log name> <command...>: one check under its own time limit, its output also in $out
    local limit=$1 log=$2
    shift 2
    echo "== $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "!! exit $rc from: $*"; status=1; }
}
# NOTE: 540 s in all, inside one 600 s device command; the rounds are fewer than the scripts' defaults for that.
run 90 device_tests.log python3 -m pytest -q -p no:cacheprovider -rs -k cuda tests/test_engine_timing.py \
    tests/test_packing_units.py tests/test_mixed_resolution.py
run 240 gpu_suite.log python3 benchmarks/gpu_suite.py --rounds 2 --warmup-rounds 2 --out "$out/gpu_suite.json"
run 120 mixed_resolution_gpu.log python3 benchmarks/mixed_resolution.py --workloads flux1-width --threads 1 \
    --steps 10 --rounds 2 --warmup-rounds 2 --out "$out/mixed_resolution_gpu.json"
run 90 profile_steps.log python3 benchmarks/profile_steps.py --warmup-rounds 2 --trace "$out/profile_steps_trace.json" \
    --out "$out/profile_steps.json"
[ -f "$out/profile_steps_trace.json" ] && gzip -f "$out/profile_steps_trace.json"
exit $status
