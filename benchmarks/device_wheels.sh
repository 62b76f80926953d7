#!/usr/bin/env bash
# Wheels for the GPU machine of this workplace (Python 3.12, torch and most libraries installed, no network):
# the ones its image lacks (diffusers, importlib_metadata), and transformers and peft at this project's versions
# with what transformers checks for at import: regex, and huggingface_hub 2.x (the image has 1.x) with the HTTP
# client it needs (httpx2, httpcore2, truststore).
# Run here, from the repository root; .whl/ is git-ignored and travels with `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
    "diffusers==$(version diffusers)" "transformers==$(version transformers)" \
    "importlib_metadata==$(version importlib_metadata)" "peft==$(version peft)" "regex==$(version regex)" \
    "huggingface_hub==$(version huggingface_hub)" "httpx2==$(version httpx2)" "httpcore2==$(version httpcore2)" \
    "truststore==$(version truststore)"
ls -l .whl
