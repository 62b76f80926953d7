#!/usr/bin/env bash
# Every GPU check in one run (a few minutes on an H200), for a CUDA machine without network access.
#
#   bash benchmarks/device_wheels.sh                     # here: the wheels that machine lacks, into .whl/
#   bash benchmarks/device_preflight.sh                  # here: they import on that image's versions
#   # there, with .whl/ copied along, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
#       PYTHONPATH=/tmp/site:$PWD bash benchmarks/device_check.sh
#
# Writes into $OUT or benchmarks/results (5 or 6 files):
# - device_check.log: everything printed, the CUDA-only tests' results first (no host sync in the denoising loop
#   under set_sync_debug_mode("error"), varlen attention = recover-scatter, packed mixed-resolution pipelines on
#   CUDA = their solo runs);
# - gpu_suite.json: throughput vs sequential and the batched ceiling at 512x512 and 1024x1024;
# - packed_forward_gpu.json: the transformer alone, 512 + 768x512 + 1024 rows per size vs packed with
#   recover-scatter, flex and varlen attention (which `packed_attention="auto"` should pick on CUDA);
# - mixed_resolution_gpu.json (MIXED_RESOLUTION=1 only): the same sizes end to end, per-size vs packed;
# - profile_steps.json (+ profile_steps_trace.json.gz): where a round of 8 x 20 steps at 512x512 spends its time.
# Each step has its own time limit, so one that hangs leaves the others their time.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
status=0
log="$out/device_check.log"
python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__,
      'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA',
      '| date', __import__('time').strftime('%Y-%m-%d'))" 2>&1 | tee "$log"
run() {  # run <seconds> <command...>: one check under its own time limit; its output also goes to the log
    local limit=$1
    shift
    echo "== $*" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "!! exit $rc from: $*" | tee -a "$log"; status=1; }
}
# NOTE: 460 s in all at most, inside one device command of under 8 minutes (a lease is 15 minutes, starts included);
# the profile runs before the long throughput suite. Three warm-up rounds: on CUDA each row count's first call is
# a warm-up, so a closed loop's encode and decode groups (one per round) settle by their fourth round.
run 80 python3 -m pytest -q -p no:cacheprovider -rs -k cuda tests/test_engine_timing.py tests/test_packing_units.py \
    tests/test_mixed_resolution.py
run 120 python3 benchmarks/profile_steps.py --warmup-rounds 3 --trace "$out/profile_steps_trace.json" \
    --out "$out/profile_steps.json"
run 40 python3 benchmarks/packed_forward.py --workloads flux1-width --out "$out/packed_forward_gpu.json"
run 220 python3 benchmarks/gpu_suite.py --rounds 3 --warmup-rounds 3 --out "$out/gpu_suite.json"
if [ "${MIXED_RESOLUTION:-0}" = 1 ]; then  # mixed resolutions end to end: 110 s more
    run 110 python3 benchmarks/mixed_resolution.py --workloads flux1-width --threads 1 --steps 10 --rounds 2 \
        --warmup-rounds 2 --out "$out/mixed_resolution_gpu.json"
fi
[ -f "$out/profile_steps_trace.json" ] && gzip -f "$out/profile_steps_trace.json"
exit $status
