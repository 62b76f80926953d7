#!/usr/bin/env bash
# Before spending device time: does benchmarks/device_check.sh import and start with the wheels in .whl/ on top of
# the GPU machine's own packages? Run here, after `bash benchmarks/device_wheels.sh`, from the repository root.
#
# A CPU venv stands in for the device image: the versions its package list gives for the libraries our wheels sit
# on (huggingface_hub, transformers, accelerate, tokenizers, safetensors; torch is this machine's CPU build), then
# the wheels go into a target folder ahead of them on PYTHONPATH, as there. What it catches: an import that fails
# (transformers 5.25 refuses huggingface_hub 1.33), a wheel that needs another. What it
# cannot: anything CUDA or torch-version specific.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .whl ] || { echo "no .whl/: run bash benchmarks/device_wheels.sh first" >&2; exit 2; }
venv=${PREFLIGHT_VENV:-/tmp/stepbatch-device-preflight}
site=$venv-site
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet torch==2.13.0
    # NOTE: the device image's versions of the libraries our wheels sit on
    "$venv/bin/pip" install --quiet "huggingface_hub==1.33.0" "transformers==5.17.0" "accelerate==1.15.0" \
        "tokenizers==0.23.2" "safetensors==0.8.0" numpy pillow pytest pytest-timeout hypothesis requests psutil \
        pyyaml tqdm sentencepiece
fi
rm -rf "$site"
# NOTE: the wheels built for the device's Python (cp312) are left out here; this venv has its own build of them
wheels=$(ls .whl/*.whl | grep -v -- '-cp3[0-9]*-')
"$venv/bin/python" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" $wheels
export PYTHONPATH=$site:$PWD HF_HUB_OFFLINE=1
"$venv/bin/python" -c "
import diffusers, huggingface_hub, transformers
from diffusers_stepbatch.testing import tiny_flux_pipeline
tiny_flux_pipeline(guidance_embeds=True)
print('imports and a tiny pipeline: ok (transformers', transformers.__version__, '| huggingface_hub',
      huggingface_hub.__version__, '| diffusers', diffusers.__version__ + ')')"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -k cuda tests/test_engine_timing.py tests/test_packing_units.py \
    tests/test_mixed_resolution.py
"$venv/bin/python" benchmarks/profile_steps.py --smoke --out "$venv/profile_steps_smoke.json" >/dev/null
echo "preflight: ok"
