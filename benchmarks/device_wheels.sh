#!/usr/bin/env bash
# Wheels for the GPU machine of this workplace (Python 3.12, torch and most libraries installed, no network):
# the ones its image lacks (diffusers, importlib_metadata), and transformers and peft at this project's versions
# with the regex that transformers checks for at import.
# Run here, from the repository root; .whl/ is git-ignored and travels with `carry: [".whl"]`.
set -euo pipefail
cd "$(dirname "$0")/.."
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
    "diffusers==$(version diffusers)" "transformers==$(version transformers)" \
    "importlib_metadata==$(version importlib_metadata)" "peft==$(version peft)" "regex==$(version regex)"
ls -l .whl
