"""One GRPO step with generation, on one GPU: grpo_kit's shared-weight vLLM against a separate engine
copy and stock TRL 1.16 ``GRPOTrainer`` with vLLM colocate.

    python -m grpo_kit bench rl_step [--rows grpo_kit_fp8,grpo_kit_bf16,grpo_kit_adapter,grpo_kit_copy,trl]
                                     [--completion 4096]
                                     [--steps 2] [--model llama-3.1-8b] [--tag h200]
    python -m grpo_kit bench rl_step --rows gen_vllm,gen_hf --models llama-3.1-8b,qwen2.5-1.5b --completion 1024

Each row runs in its own process. Setup (the issue's): the model's architecture with random weights
(generation is fixed-length, ``min_tokens = max_tokens``), bf16, LoRA r=16 (alpha 32) on all linear
layers, 8 generations of one 512-token prompt, beta 0.04, one completion per micro-batch (gradient
accumulation 8: one optimiser step per generation batch), temperature 1.0.

* ``grpo_kit_fp8`` / ``grpo_kit_bf16``: the kit's trainer with its defaults, ``generation_backend=vllm`` with
  shared weights and standby (``vllm_share_weights=true``), KV cache fp8 / bf16, sized by the calculator;
  offloaded checkpointing and the efficient loss. The adapter reaches vLLM merged (``vllm_lora_sync`` null
  resolves to ``merge`` since 2026-12-05): each generation merges it into the shared weights and restores their
  exact bits after it (``grpo_kit.generation.reversible_merge``), so the engine (started without LoRA) decodes
  dense; the merge and restore are the row's ``sync_s``.
* ``grpo_kit_merge``: ``grpo_kit_fp8`` with ``vllm_lora_sync=merge`` set explicitly (the same since it became
  the default; the rows measured before were named so).
* ``grpo_kit_adapter``: ``grpo_kit_fp8`` with ``vllm_lora_sync=adapter``: the adapter handed over in memory
  and run in vLLM's LoRA kernels (the default before 2026-12-05, measured then as ``grpo_kit_fp8``).
* ``grpo_kit_copy``: the same with ``vllm_share_weights=false``: the engine keeps its own copy, LoRA is
  merged into it every step with ``load_weights``, vLLM's level-1 sleep offloads it while training.
* ``trl``: ``GRPOTrainer(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True)`` with TRL's
  defaults otherwise (vllm_gpu_memory_utilization 0.3, HF gradient checkpointing, its chunked log-prob
  head), fixed length through ``generation_kwargs={"min_tokens": C}``. ``--trl-vllm-memory`` sets that share:
  0.3 of an 80 GiB card leaves its engine at most 8.8 GiB of KV cache beside the 15 GiB of weights, under the 20.5 GiB
  that 8 x (512 + 20,480) bf16 tokens need, so vLLM would decode the 8 in turns; 0.3 of an H200 holds them.
* ``grpo_kit_fp8w``: ``grpo_kit_fp8`` with FP8 base weights (``base_weights=fp8``: e4m3, per-channel scales,
  W8A8 forward), LoRA through ``fp8_lora_config``: vLLM's FP8 engine starts on placeholder weights, the training
  model is built on its codes and scales (one FP8 copy, ``grpo_kit.generation.shared_weights``), the kit's codes
  are written into them, and the adapter runs in vLLM's LoRA kernels (a merge would round FP8 weights again).
* ``grpo_kit_fp8w_hf``: FP8 base weights generating with HF ``generate`` (no vLLM), the fallback where the weights
  cannot be shared.
* ``gen_vllm`` / ``gen_hf`` / ``gen_hf_fp8w``: generation alone, 8 completions of one prompt: vLLM (the kit's
  engine, CUDA graphs) against HF ``generate`` on the same architecture, with 16-bit or FP8 base weights.
  ``gen_vllm_fp8w`` generates with an r=16 adapter in vLLM's LoRA kernels, as the FP8 step does (an adapter cannot
  be merged into FP8 codes); ``gen_vllm`` with none, as the 16-bit step's merged adapter leaves it;
  ``gen_vllm_fp8w_dense`` the same FP8 engine with no adapter loaded (not a training configuration: what the
  LoRA kernels cost).

Every row records ``base_weights`` (``bf16`` or ``fp8``).

Long prompts (issue 55): ``--prompt N`` sets the one prompt's length (default 512), ``--micro-batch M`` the sequences
per forward/backward (gradient accumulation 8 / M; TRL's rows too), ``--prefix-sharing auto|true|false`` the kit
rows' ``prefix_sharing``: each micro-batch scores a group's shared prompt once, so sharing pays at ``--micro-batch
8``. Kit rows record ``prefix_sharing``: the setting and the trainer's counts over every scoring and loss pass
(rows scored shared, alone, too short for ``auto``, groups, prompt tokens saved)::

    python -m grpo_kit bench rl_step --rows grpo_kit_bf16 --prompt 63488 --completion 2048 --micro-batch 8 \
        --prefix-sharing true --steps 1

Random weights: the engines start with vLLM's random init (``load_format="dummy"``); the shared model
uses those tensors, the copy row and TRL push the training model's weights at each sync as always.

Memory, ``peak_gib``: device memory in use (``cudaMemGetInfo``), sampled every 5 ms (``--sample-ms``) by a thread
from before the engine starts to the end of the last step, minus what was in use before (the CUDA context):
everything vLLM's pool and PyTorch hold, whichever allocator. Beside it ``torch_max_reserved_gib`` (PyTorch's
``max_memory_reserved``) and ``vllm_pool_gib`` (vLLM's CuMem pool at the end). Kit rows also split the peak by
phase, ``phase_peaks_gib``: ``setup`` (model load, engine start), ``generation`` (inside the generator's
``generate`` and ``sleep``: wake, generation, standby releasing the KV cache), ``scoring`` (the no-grad log-prob
passes: the reference, and the old policy where TRL runs it), ``training`` (the rest of the steps: rewards, the
loss's forward and backward passes, the optimiser); beside it ``phase_torch_gib``, PyTorch's allocated and reserved
bytes at their largest in each phase, its allocator's own peak counters read at each change of phase (reserved over
allocated is the allocator's cache; device use over reserved is memory outside PyTorch's allocator).
``--scoring-batch N`` sets the kit rows' ``scoring_batch_size`` (default ``auto``, as ``grpo_kit train`` resolves
it). ``--memory-history N``: kit rows also keep ``peak_allocations``, the blocks PyTorch's allocator had handed out
at the largest moment of the recorded window (``grpo_kit.memory.live_at_peak``), grouped by the line that made them;
``--memory-history-at scoring`` (or ``generation``) reads the history as the first call of that phase ends, so the
window holds that phase's peak, ``end`` (the default) after the last step. Times per optimiser step:
``generation_s`` (generate, with wake and standby/sleep), ``sync_s`` (weights or adapter to the engine),
``training_s`` (everything else: rewards, reference and old log-probs, 8 forward/backward passes, the optimiser),
``step_s``: the median over the steps after the first (which carries one-off warm-ups: kernel autotuning, first
pinning of host buffers), the first beside it, every step in the JSON, each with ``passes``: the host's view of its
loss passes (from the end of the first micro-batch to the step's end: wall and CPU seconds of the main thread and of
the others, garbage collections; :class:`PassWindow`). ``--profile-training``: kit and TRL rows run one more
optimiser step whose loss passes (micro-batches 2..8 and the optimiser) run under torch.profiler,
``training_profile`` (top ops by GPU and by host time; the step's own times beside them, in no median).
``--gen-tokens N``: the kit rows then also time generation alone in the same process (vLLM with and without the
adapter, HF ``generate``). Results: ``bench/results/data/rl_step.jsonl`` (page ``rl_step.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import KernelProfile, command_line, family_of_model, hardware, lora_targets_of, record_report, sync

ROOT = Path(__file__).resolve().parent.parent
LORA_RANK, LORA_ALPHA = 16, 32  # every row's adapter

# row: (kv_cache_dtype, vllm_share_weights, vllm_lora_sync, base_weights); grpo_kit_fp8w_hf generates with HF
KIT_ROWS = {
    "grpo_kit_fp8": ("fp8", True, None, "16bit"),
    "grpo_kit_bf16": ("auto", True, None, "16bit"),
    "grpo_kit_merge": ("fp8", True, "merge", "16bit"),
    "grpo_kit_adapter": ("fp8", True, "adapter", "16bit"),
    "grpo_kit_copy": ("auto", False, None, "16bit"),
    "grpo_kit_fp8w": ("fp8", True, None, "fp8"),
    "grpo_kit_fp8w_hf": ("auto", "auto", None, "fp8"),
}
IMPL = {
    "grpo_kit_fp8": "grpo_kit",
    "grpo_kit_bf16": "grpo_kit",
    "grpo_kit_merge": "grpo_kit",
    "grpo_kit_adapter": "grpo_kit",
    "grpo_kit_copy": "grpo_kit_copy",
    "grpo_kit_fp8w": "grpo_kit",
    "grpo_kit_fp8w_hf": "grpo_kit",
}
GEN_ROWS = {
    "gen_vllm": "16bit",
    "gen_vllm_fp8w": "fp8",
    "gen_vllm_fp8w_dense": "fp8",
    "gen_hf": "16bit",
    "gen_hf_fp8w": "fp8",
}  # row: base_weights
ROWS = (*KIT_ROWS, "trl", *GEN_ROWS)


def weights_name(base_weights: str) -> str:
    """The recorded ``base_weights``: ``fp8``, or the 16-bit dtype the rows run in (``bf16``)."""
    return "fp8" if base_weights == "fp8" else "bf16"


PROMPT_TOKENS = 512  # the default --prompt
GENERATIONS = 8


class DeviceMemory:
    """Peak of the device memory in use, sampled by a thread, over a baseline taken at start; also per phase:
    ``label`` names what runs now (``phase`` sets it around a call), and each label keeps its own peak.

    PyTorch's own peaks per phase (``torch_peaks``) are its allocator's peak counters, read and reset at each change
    of phase on the calling thread. The sampling thread must not ask the allocator: vLLM's pool allocates through
    Python callbacks while holding the allocator's lock, so a thread holding the GIL and waiting for that lock
    deadlocks the engine's start (seen on an H100 at 1755d89)."""

    def __init__(self, interval_s: float = 0.005):
        import torch

        torch.cuda.init()
        free, self.total = torch.cuda.mem_get_info()
        self.base = self.total - free
        self.peak = self.base
        self.label, self.peaks = "setup", {}
        self.torch_peaks: dict[str, list[int]] = {}  # label -> [allocated, reserved] peaks (PyTorch's allocator)
        self.on_exit: dict[str, object] = {}  # label -> a callable run once, as the first call of that phase ends
        torch.cuda.reset_peak_memory_stats()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._t.start()

    def _run(self, interval_s):
        import torch

        self.thread_id = threading.get_native_id()  # PassWindow names this thread's CPU time
        while not self._stop.is_set():
            free, _ = torch.cuda.mem_get_info()
            used, label = self.total - free, self.label
            self.peak = max(self.peak, used)
            self.peaks[label] = max(self.peaks.get(label, used), used)
            time.sleep(interval_s)

    def labels(self) -> dict[int, str]:
        """``{native thread id: "memory sampler"}`` for :class:`PassWindow` (empty until the thread has started)."""
        tid = getattr(self, "thread_id", None)
        return {} if tid is None else {tid: "memory sampler"}

    def switch(self, label: str) -> None:
        """Fold PyTorch's peaks since the last change into the running phase's, then run ``label``."""
        import torch

        got = self.torch_peaks.setdefault(self.label, [0, 0])
        got[0] = max(got[0], torch.cuda.max_memory_allocated())
        got[1] = max(got[1], torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        self.label = label

    def phase(self, label: str, fn):
        """``fn`` with ``label`` as the running phase during each call (the previous one restored after)."""

        def wrapper(*args, **kwargs):
            before = self.label
            self.switch(label)
            try:
                out = fn(*args, **kwargs)
            finally:
                self.switch(before)
            if label in self.on_exit:  # after a call that returned: a failing hook must not hide the call's error
                self.on_exit.pop(label)()
            return out

        return wrapper

    def stop(self) -> float:
        """GiB over the baseline."""
        self._stop.set()
        self._t.join()
        self.switch(self.label)
        return (self.peak - self.base) / 2**30

    def torch_max_reserved(self) -> float:
        """GiB PyTorch's allocator reserved at its largest over every phase (its peak counter is reset per phase)."""
        return max((r for _, r in self.torch_peaks.values()), default=0) / 2**30

    def phase_peaks(self) -> dict[str, float]:
        """``{label: GiB over the baseline}``, each label's own peak."""
        return {k: round((v - self.base) / 2**30, 3) for k, v in self.peaks.items()}

    def phase_torch_peaks(self) -> dict[str, dict[str, float]]:
        """``{label: {"allocated": GiB, "reserved": GiB}}``: PyTorch's allocator's peaks per phase (whole
        figures, no baseline: an engine's pool counts as PyTorch sees it)."""
        return {
            k: {"allocated": round(a / 2**30, 3), "reserved": round(r / 2**30, 3)}
            for k, (a, r) in self.torch_peaks.items()
        }


def _prompt_text(tok, n: int) -> str:
    """A text the tokenizer turns into exactly ``n`` tokens (special tokens included)."""
    k = n - (len(tok(" hello" * n)["input_ids"]) - n)
    text = " hello" * k
    assert len(tok(text)["input_ids"]) == n, "the prompt text does not tokenize to the asked length"
    return text


def _timed_into(totals: dict, fn):
    """``fn`` with its synchronised wall time added to ``totals["sync"]``."""
    import torch

    totals.setdefault("sync", 0.0)

    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            totals["sync"] += time.perf_counter() - t

    return wrapper


def _reward(prompts, completions, **kw):
    # Random weights score nothing on a task; a reward with spread keeps the advantages (and the update) real.
    return [(sum(map(ord, c if isinstance(c, str) else str(c))) % 7) / 6.0 for c in completions]


def thread_cpu_s() -> dict[int, tuple[str, float]]:
    """``{thread id: (name, CPU seconds so far)}`` of this process's threads (Linux ``/proc``; empty elsewhere)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(rest[11]) + int(rest[12])) / tick)  # utime + stime (fields 14, 15)
    return out


class PassWindow:
    """Where the time of the loss's passes goes on the host, from the end of a step's first micro-batch (after
    generation and the reference pass) to the step's end: wall seconds, the main thread's CPU seconds, the other
    threads' (and the three busiest, by their OS name or by ``labels``: {native thread id: label}), and Python's
    garbage collections (seconds, and how many were full). A main thread busy for most of the wall time means the
    passes wait on the host; another thread's CPU time, or a full collection, is a stall the GPU work does not
    explain. ``micro_batches``: how many the window covered (the first one ends as it opens)."""

    def __init__(self, labels: dict[int, str] | None = None):
        import gc

        self.labels, self._t0, self._cpu0, self._subs = {} if labels is None else labels, None, None, 0
        self._gc = {"s": 0.0, "full": 0}
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_t = time.perf_counter()
        elif self._t0 is not None:
            self._gc["s"] += time.perf_counter() - self._gc_t
            self._gc["full"] += info["generation"] == 2

    def begin(self) -> bool:
        """At each micro-batch's end but the step's last: opens the window at the first (True), counts the rest."""
        if self._t0 is not None:
            self._subs += 1
            return False
        self._gc, self._subs = {"s": 0.0, "full": 0}, 0
        self._cpu0, self._t0 = thread_cpu_s(), time.perf_counter()
        return True

    def end(self) -> dict | None:
        """The window's figures (None if it never began), and a new window."""
        if self._t0 is None:
            return None
        wall, cpu1, main = time.perf_counter() - self._t0, thread_cpu_s(), threading.get_native_id()
        used = {
            tid: (self.labels.get(tid, name), t - self._cpu0.get(tid, (name, 0.0))[1])
            for tid, (name, t) in cpu1.items()
        }
        others = sorted(((t, name) for tid, (name, t) in used.items() if tid != main), reverse=True)
        self._t0 = None
        return {
            "wall_s": round(wall, 3),
            "main_cpu_s": round(used.get(main, ("", 0.0))[1], 3),
            "other_cpu_s": round(sum(t for t, _ in others), 3),
            "busiest_others": [[name, round(t, 3)] for t, name in others[:3]],
            "gc_s": round(self._gc["s"], 3),
            "gc_full": self._gc["full"],
            "micro_batches": self._subs + 1,
        }


class StepTimes:
    """Per optimiser step: seconds in the wrapped phases (bench/trainer_gpu.time_phases) and the step, and the
    host's view of its loss passes (``passes``: :class:`PassWindow`, with ``labels`` for known threads).
    ``profile_step`` (1-based): that step's pass window also runs under torch.profiler; ``profile`` is then
    :class:`KernelProfile`'s summary with the window's ``micro_batches``."""

    def __init__(
        self, totals, labels: dict[int, str] | None = None, profile_step: int | None = None, dev: str = "cuda"
    ):
        from transformers import TrainerCallback

        self.totals, self.steps, self.window, outer = totals, [], PassWindow(labels), self
        self.profile_step, self.profile, self._prof = profile_step, None, None

        class CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                outer._t0 = time.perf_counter()

            def on_substep_end(self, args, state, control, **kw):
                if outer.window.begin() and state.global_step + 1 == outer.profile_step:
                    outer._prof = KernelProfile(dev, top=30)
                    outer._prof.start()

            def on_step_end(self, args, state, control, **kw):
                sync(dev)
                step_s, passes = time.perf_counter() - outer._t0, outer.window.end()
                outer.steps.append(dict(outer.totals, step_s=step_s, passes=passes))
                print("STEP " + json.dumps(outer.steps[-1]), flush=True)  # kept by the parent if the row times out
                for k in outer.totals:
                    outer.totals[k] = 0.0
                if outer._prof is not None:  # after the step's times: the profiler's own summary takes seconds
                    outer.profile = dict(outer._prof.stop(), micro_batches=passes["micro_batches"])
                    outer._prof = None

        self.callback = CB()


def _steps_run(a) -> int:
    """Optimiser steps a row runs: the timed ones, and one more under the profiler with ``--profile-training``."""
    return a.steps + bool(a.profile_training)


def _row_inputs(tok, mem: DeviceMemory, totals, a):
    """What the kit and TRL rows train on and time with: the dataset (one fixed prompt, enough rows for every step
    the row runs and one more) and the :class:`StepTimes` (the memory sampler's thread named, the extra step
    profiled with ``--profile-training``)."""
    from datasets import Dataset

    ds = Dataset.from_dict({"prompt": [_prompt_text(tok, a.prompt)] * (GENERATIONS * (_steps_run(a) + 1))})
    return ds, StepTimes(totals, mem.labels(), profile_step=_steps_run(a) if a.profile_training else None)


def _cumem_gib() -> float | None:
    try:
        from vllm.device_allocator.cumem import CuMemAllocator

        inst = CuMemAllocator.instance
        return None if inst is None else inst.get_current_usage() / 2**30
    except Exception:
        return None


def kit_row(name: str, a) -> dict:
    import dataclasses

    import torch
    from peft import LoraConfig
    from trainer_gpu import time_phases
    from trl import GRPOTrainer

    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.app.run import grpo_args
    from grpo_kit.generation.plan import lora_sync_mode, plan_generation, start_generation
    from grpo_kit.model.fp8 import fp8_lora_config
    from grpo_kit.model.loading import load_model, load_tokenizer, model_config
    from grpo_kit.trainer.channel import channel as kit_channel
    from grpo_kit.trainer.generation_hook import KitGenerationMixin
    from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer, make_trainer

    kv, share, lora_sync, base_weights = KIT_ROWS[name]
    C = a.completion
    cfg = GRPOKitConfig(
        model=a.model,
        output_dir=a.run_dir,
        max_prompt_length=a.prompt,
        max_completion_length=C,
        num_generations=GENERATIONS,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=GENERATIONS // a.micro_batch,
        beta=0.04,
        prefix_sharing=a.prefix_sharing,
        lora_rank=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        kv_cache_dtype=kv,
        vllm_share_weights=share,
        vllm_lora_sync=lora_sync,
        base_weights=base_weights,
        generation_backend="hf" if name == "grpo_kit_fp8w_hf" else "vllm",
        gradient_checkpointing=True,
        max_steps=_steps_run(a),
        dtype="bf16",
        device="cuda",
        temperature=1.0,
        save_steps=0,
        num_eval_samples=0,
        learning_rate=1e-5,
        warmup_steps=0,
        logging_steps=1,
    )
    lora_sync = lora_sync_mode(cfg)  # the row's mode, the kit's default resolved
    if lora_sync == "adapter":  # the option applies to vLLM's LoRA kernels only
        cfg.vllm_lora_dual_stream = {"on": True, "off": False, "auto": None}[a.lora_dual_stream]
    if a.scoring_batch != "auto":
        cfg.scoring_batch_size = int(a.scoring_batch)
    cfg.validate()
    mem = DeviceMemory(a.sample_ms / 1e3)
    tok = load_tokenizer(a.model)
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    plan = plan_generation(cfg, model_config=model_config(a.model), device="cuda", dtype=dtype)
    gen, model, info = start_generation(
        plan,
        tokenizer=tok,
        dtype=dtype,
        load_model=lambda: load_model(a.model, dtype=dtype, device="cuda", base_weights=base_weights)[0],
    )
    setup_s = time.perf_counter() - t0
    totals = time_phases((GRPOTrainer, KitGenerationMixin, EfficientGRPOTrainer))
    gen.sync_weights = _timed_into(totals, gen.sync_weights)
    if lora_sync == "merge":  # the merge and restore inside each generate call are the row's weight sync
        from grpo_kit.generation.reversible_merge import ReversibleLoraMerge

        ReversibleLoraMerge.merge = _timed_into(totals, ReversibleLoraMerge.merge)
        ReversibleLoraMerge.restore = _timed_into(totals, ReversibleLoraMerge.restore)
    ds, times = _row_inputs(tok, mem, totals, a)
    gen.generate = mem.phase("generation", gen.generate)  # the engine's part of the peak apart from training's
    gen.sleep = mem.phase("generation", gen.sleep)  # until standby has released the KV cache, it is generation's
    trainer = make_trainer(
        cfg,
        model=model,
        tokenizer=tok,
        reward_funcs=[_reward],
        args=grpo_args(cfg, "cuda", dtype),
        train_dataset=ds,
        callbacks=[times.callback],
        generator=gen,
        peft_config=(fp8_lora_config if base_weights == "fp8" else lambda c: c)(
            LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=lora_targets_of(a.model))
        ),
        memory_plan=plan.memory,
    )  # scoring_batch_size resolved as `grpo_kit train` resolves it
    trainer.kit_sampling = dataclasses.replace(trainer.kit_sampling, min_tokens=C)  # fixed length
    # the no-grad log-prob passes (reference; old policy where TRL runs it) apart from the loss's passes
    trainer._get_per_token_logps_and_entropies = mem.phase("scoring", trainer._get_per_token_logps_and_entropies)
    mem.switch("training")
    peak_allocations = None

    def read_history():
        nonlocal peak_allocations
        from grpo_kit.memory import live_at_peak

        peak_allocations = dict(
            live_at_peak(torch.cuda.memory._snapshot(), device=torch.cuda.current_device(), top=25),
            at=a.memory_history_at,
        )
        torch.cuda.memory._record_memory_history(enabled=None)

    if a.memory_history:  # PyTorch's allocator history, Python frames only (C++ stacks would slow every allocation)
        torch.cuda.memory._record_memory_history(max_entries=a.memory_history, stacks="python")
        if a.memory_history_at != "end":
            mem.on_exit[a.memory_history_at] = read_history
    trainer.train()
    peak = mem.stop()
    if a.memory_history and peak_allocations is None:  # at the end, or the phase never ran
        read_history()
    steps, profiled = _profiled_step(times.steps, times, a)
    try:  # an extra measurement: its failure must not lose the row's step measurements
        gen_alone = generation_alone(gen, trainer.model, tok, a.gen_tokens, a.prompt) if a.gen_tokens else None
    except Exception as e:
        gen_alone = {"error": f"{type(e).__name__}: {e}"}
    out = dict(
        gen_alone=gen_alone,
        impl=IMPL[name],
        weights_shared=bool(getattr(gen, "share_weights", False)),
        base_weights=weights_name(base_weights),
        quantization=getattr(model, "grpo_kit_quantization", None),
        lora_dual_stream=getattr(gen, "lora_dual_stream", None),
        lora_sync=getattr(gen, "lora_sync", None),
        last_merge=getattr(gen, "last_merge", None),
        kv_cache_dtype="fp8" if kv == "fp8" else "bf16",
        setup_s=setup_s,
        generation=info,
        steps=steps,
        peak_gib=peak,
        phase_peaks_gib=mem.phase_peaks(),
        phase_torch_gib=mem.phase_torch_peaks(),
        torch_max_reserved_gib=mem.torch_max_reserved(),
        vllm_pool_gib=_cumem_gib(),
        sync_modes=[e["mode"] for e in kit_channel(trainer).sync_log],
        completion_tokens=GENERATIONS * C,
        scoring_batch_size=trainer.scoring_batch_size,
        prefix_sharing=dict(setting=a.prefix_sharing, **trainer.prefix_sharing_stats),
        peak_allocations=peak_allocations,
        training_profile=profiled,
        # the rollout-trainer mismatch per step: |dlogp| mean / max and the importance ratio's min / mean / max
        sampling=[
            {k.split("/", 1)[1]: v for k, v in h.items() if k.startswith("sampling/")}
            for h in trainer.state.log_history
            if any(k.startswith("sampling/") for k in h)
        ],
    )
    gen.close()
    return out


def _profiled_step(steps: list[dict], times: StepTimes, a) -> tuple[list[dict], dict | None]:
    """The timed steps, and the profiled extra one (``--profile-training``) apart from them: its phase times
    beside the profiler's summary (the profiler slows the step: it joins no median)."""
    if not a.profile_training:
        return steps, None
    extra = steps[a.steps :]
    return steps[: a.steps], dict(
        times.profile or {"error": "the profiled step did not end"}, step=extra[0] if extra else None
    )


def _timed_generate(eng, prompt, sampling) -> dict:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    res = eng.generate([prompt], GENERATIONS, sampling)
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    n = res.num_completion_tokens
    return dict(generation_s=s, completion_tokens=n, tokens_per_s=n / s)


def generation_alone(gen, model, tok, tokens: int, prompt_tokens: int) -> dict:
    """Generation alone after the row's training, in the same process: 8 completions of ``tokens`` tokens of
    the row's ``prompt_tokens``-token prompt by the row's engine with the trained adapter (as in the step) and with none (the
    bare base weights), and by HF ``generate`` on the training model (adapter on). Each after a warm-up."""
    import torch

    from grpo_kit.generation import HFGenerator, SamplingConfig

    prompt = tok(_prompt_text(tok, prompt_tokens))["input_ids"][:prompt_tokens]
    sampling = SamplingConfig(temperature=1.0, max_tokens=tokens, min_tokens=tokens)
    warm = SamplingConfig(temperature=1.0, max_tokens=16, min_tokens=16)
    out = {}
    if gen.needs_sync:
        gen.sync_weights(model)
    gen.generate([prompt], GENERATIONS, warm)
    out["vllm_adapter"] = _timed_generate(gen, prompt, sampling)
    # the engine's base weights: no LoRA kernels' work, no merge
    (adapter, gen._lora_request), (merge, gen._merge) = (gen._lora_request, None), (gen._merge, None)
    out["vllm_no_adapter"] = _timed_generate(gen, prompt, sampling)
    gen._lora_request, gen._merge = adapter, merge
    gen.sleep()
    hf = HFGenerator(model.eval(), tok)
    with torch.no_grad():
        hf.generate([prompt], GENERATIONS, warm)
        out["hf_adapter"] = _timed_generate(hf, prompt, sampling)
    out["vllm_over_hf"] = out["vllm_adapter"]["tokens_per_s"] / out["hf_adapter"]["tokens_per_s"]
    return out


def trl_row(a) -> dict:
    import torch
    import trl.generation.vllm_generation as vg
    from peft import LoraConfig
    from trainer_gpu import time_phases
    from trl import GRPOConfig, GRPOTrainer

    from grpo_kit.generation.plan import generation_model_dir
    from grpo_kit.model.loading import build_random_model, load_tokenizer

    C = a.completion
    folder, _ = generation_model_dir(a.model, "cuda")
    start_llm = vg.LLM
    vg.LLM = lambda *args, **kw: start_llm(*args, **{**kw, "load_format": "dummy"})  # TRL pushes the weights itself
    totals = time_phases((GRPOTrainer,))
    vg.VLLMGeneration.sync_weights = _timed_into(totals, vg.VLLMGeneration.sync_weights)
    mem = DeviceMemory(a.sample_ms / 1e3)
    tok = load_tokenizer(a.model)
    tok.padding_side = "left"
    t0 = time.perf_counter()
    model = build_random_model(a.model, dtype=torch.bfloat16, device="cuda")
    model.name_or_path = str(folder)  # TRL's colocated engine starts from here
    model.config._name_or_path = str(folder)
    args = GRPOConfig(
        output_dir=a.run_dir,
        max_steps=_steps_run(a),
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=GENERATIONS // a.micro_batch,
        num_generations=GENERATIONS,
        max_completion_length=C,
        beta=0.04,
        bf16=True,
        gradient_checkpointing=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=True,
        vllm_max_model_length=a.prompt + C,
        generation_kwargs={"min_tokens": C},
        use_bias_correction_kl=False,
        learning_rate=1e-5,
        warmup_steps=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        temperature=1.0,
        seed=0,
        disable_tqdm=True,
        vllm_gpu_memory_utilization=a.trl_vllm_memory,
    )
    ds, times = _row_inputs(tok, mem, totals, a)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[_reward],
        args=args,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[times.callback],
        peft_config=LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=lora_targets_of(a.model)),
    )
    setup_s = time.perf_counter() - t0
    trainer.train()
    peak = mem.stop()
    steps, profiled = _profiled_step(times.steps, times, a)
    # TRL syncs inside generation (after its level-2 sleep the weights must be pushed again)
    return dict(
        impl="trl",
        weights_shared=False,
        base_weights="bf16",
        kv_cache_dtype="bf16",
        setup_s=setup_s,
        steps=steps,
        training_profile=profiled,
        peak_gib=peak,
        torch_max_reserved_gib=mem.torch_max_reserved(),
        vllm_pool_gib=_cumem_gib(),
        completion_tokens=GENERATIONS * C,
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
    )


# Kernel names by what they do in a decode step (vLLM 0.26 on Hopper): the LoRA kernels are Triton's
# ``_lora_shrink_kernel`` / ``_lora_expand_kernel``; FP8 GEMMs are CUTLASS ``scaled_mm`` (e4m3) kernels;
# the activations' per-token FP8 quantisation is its own small kernel before each of them.
DECODE_KINDS = (
    ("lora", ("lora", "sgmv", "bgmv", "punica")),
    ("kv_write", ("reshape_and_cache",)),  # its template names the FP8 KV type even for bf16
    # before fp8_gemm: the quantiser's template names e4m3, and Inductor names its fused
    # norm + quantise kernels after the GEMM they feed (..._abs_clamp_cutlass_scaled_mm_div_...)
    ("quantise", ("quant", "abs_clamp")),
    ("fp8_gemm", ("scaled_mm", "e4m3", "fp8", "cutlass_w8a8")),
    ("attention", ("flash", "fmha", "attn", "paged")),
    ("gemm", ("gemm", "nvjet", "cublas", "xmma", "cutlass")),
    ("norm_act", ("norm", "silu", "act_and_mul", "rotary")),
    ("sampling", ("topk", "top_k", "sampl", "softmax", "argmax", "sort", "exponential")),
)


def decode_kind(kernel: str) -> str:
    """The kind of a GPU kernel in a decode step, by its name (``DECODE_KINDS``; ``other`` if none)."""
    low = kernel.lower()
    return next((kind for kind, keys in DECODE_KINDS if any(k in low for k in keys)), "other")


def decode_profile(eng, prompt, tokens: int) -> dict:
    """Where one decode step's GPU time goes: 8 completions of ``tokens`` tokens (after the 512-token
    prompt) by ``eng`` under torch.profiler (CUDA activity, kernels inside CUDA graphs included), the kernels'
    time summed by kind (``decode_kind``) and divided by the decode steps; the 15 largest kernels with their
    launch counts per step. The prefill's kernels are in the sums (one step in ``tokens``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from grpo_kit.generation import SamplingConfig

    sampling = SamplingConfig(temperature=1.0, max_tokens=tokens, min_tokens=tokens)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed = _timed_generate(eng, prompt, sampling)
    per_kernel: dict[str, list] = {}  # name -> [microseconds, launches, kind]
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            t = per_kernel.setdefault(ev.name, [0.0, 0, decode_kind(ev.name)])
            t[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            t[1] += 1
    kinds: dict[str, float] = {}
    for us, _, kind in per_kernel.values():
        kinds[kind] = kinds.get(kind, 0.0) + us
    gpu_us = sum(kinds.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    return dict(
        decode_steps=tokens,
        wall_ms_per_step=1e3 * timed["generation_s"] / tokens,
        gpu_ms_per_step=gpu_us / 1e3 / tokens,
        kinds_ms_per_step={k: round(v / 1e3 / tokens, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        top_kernels=[
            dict(
                name=n[:120], kind=kind, ms_per_step=round(us / 1e3 / tokens, 4), launches_per_step=round(c / tokens, 2)
            )
            for n, (us, c, kind) in top
        ],
    )


def gen_engine_options(name: str, dual_stream: bool) -> tuple[dict, bool]:
    """The ``VLLMGenerator`` options of generation row ``name`` (a ``gen_vllm*`` row) and whether it loads an
    adapter. The FP8 rows start the engine an FP8 training step starts (shared codes, ``lora_sync="adapter"``:
    vLLM's LoRA support on); ``gen_vllm_fp8w_dense`` then loads no adapter, so vLLM runs the CUDA graphs it
    captured without LoRA ops (``cudagraph_specialize_lora``, on by default). ``gen_vllm``: the 16-bit engine as
    the merged step leaves it, no LoRA support."""
    fp8 = GEN_ROWS[name] == "fp8"  # the engine on the training model's FP8 codes
    adapter = fp8 and not name.endswith("_dense")
    return dict(
        base_weights=GEN_ROWS[name],
        share_weights=fp8,
        lora_sync="adapter" if fp8 else "merge",
        lora_dual_stream=adapter and dual_stream,
    ), adapter


def gen_row(name: str, a) -> dict:
    import torch

    from grpo_kit.generation import HFGenerator, SamplingConfig
    from grpo_kit.model.loading import load_model, load_tokenizer

    C = a.completion
    tok = load_tokenizer(a.model)
    prompt = tok(_prompt_text(tok, a.prompt))["input_ids"][: a.prompt]
    sampling = SamplingConfig(temperature=1.0, max_tokens=C, min_tokens=C)
    warm = SamplingConfig(temperature=1.0, max_tokens=16, min_tokens=16)
    if name.startswith("gen_vllm"):
        from grpo_kit.generation.plan import LORA_DUAL_STREAM_DEFAULT, generation_model_dir
        from grpo_kit.generation.vllm_backend import VLLMGenerator
        from grpo_kit.memory import formulas as F
        from grpo_kit.memory import resolve_arch
        from grpo_kit.model.loading import model_config

        folder, _ = generation_model_dir(a.model, "cuda")
        kv = F.kv_cache_bytes(resolve_arch(a.model), F.vllm_kv_tokens(a.prompt, C, GENERATIONS, 1), 2)
        opts, adapter = gen_engine_options(
            name, {"on": True, "off": False, "auto": LORA_DUAL_STREAM_DEFAULT}[a.lora_dual_stream]
        )
        eng = VLLMGenerator(
            folder,
            tokenizer=tok,
            dtype="bfloat16",
            dummy_weights=True,
            max_model_len=a.prompt + C,
            max_num_seqs=GENERATIONS,
            kv_cache_memory_bytes=int(kv),
            gpu_memory_utilization=0.5,
            max_lora_rank=LORA_RANK,
            **opts,
        )
        fp8 = opts["base_weights"] == "fp8"
        if fp8 and not adapter:  # the FP8 codes, no adapter loaded: what the LoRA kernels cost the FP8 engine
            eng.training_model(model_config(a.model), torch.bfloat16)
        elif fp8:  # an adapter in place, so generation runs through vLLM's LoRA kernels as in the step
            from peft import LoraConfig, get_peft_model

            from grpo_kit.model.fp8 import fp8_lora_config

            conf = fp8_lora_config(
                LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=lora_targets_of(a.model))
            )
            eng.sync_weights(get_peft_model(eng.training_model(model_config(a.model), torch.bfloat16), conf))
    else:  # gen_hf_fp8w: the FP8 layers quantised on the GPU layer by layer, W8A8 through torch._scaled_mm
        model = load_model(a.model, dtype=torch.bfloat16, device="cuda", base_weights=GEN_ROWS[name])[0]
        eng = HFGenerator(model.eval(), tok)
    eng.generate([prompt], GENERATIONS, warm)
    row = dict(impl=name, base_weights=weights_name(GEN_ROWS[name]), **_timed_generate(eng, prompt, sampling))
    if a.profile_decode:
        row["decode_profile"] = decode_profile(eng, prompt, a.profile_decode)
    return row


def one(name: str, a) -> dict:
    if name in KIT_ROWS:
        return kit_row(name, a)
    if name == "trl":
        return trl_row(a)
    return gen_row(name, a)


def _split(step: dict) -> dict:
    gen_s = step["generate"] - step.get("sync", 0.0)  # the sync runs inside _generate_single_turn
    return dict(
        generation_s=gen_s, sync_s=step.get("sync"), training_s=step["step_s"] - step["generate"], step_s=step["step_s"]
    )


def _summarise(r: dict) -> dict:
    """The issue's row fields from one child's result: the median over the steps after the first (the
    first carries one-off warm-ups: kernel autotuning, first host-buffer pinning), or the one step."""
    if r.get("status") == "failed" or "steps" not in r:
        return r
    import statistics

    splits = [_split(s) for s in r["steps"]]
    later = splits[1:] or splits
    med = {k: statistics.median(x[k] for x in later if x[k] is not None) for k in later[0] if later[0][k] is not None}
    gen_s = med["generation_s"]
    return dict(
        r,
        **med,
        sync_last_s=splits[-1]["sync_s"],
        first_step=splits[0],
        steps_in_median=len(later),
        tokens_per_s=r["completion_tokens"] / gen_s if gen_s > 0 else None,
    )


def _sharing(r: dict) -> str:
    """A row's prefix sharing for the table: the setting and the rows it shared (``true, 8/8 rows``); empty for
    rows measured before the option (the unshared path) and for TRL's and the generation rows."""
    ps = r.get("prefix_sharing")
    if not isinstance(ps, dict):
        return ""
    rows = ps.get("shared_rows", 0) + ps.get("alone_rows", 0) + ps.get("short_rows", 0) + ps.get("layout_rows", 0)
    return f"{str(ps['setting']).lower()}, {ps.get('shared_rows', 0)} of {rows} rows scored shared"


def write(earlier: list[dict], results: list[dict], a, cmd: str) -> None:
    tag = a.tag
    hw = hardware()
    rows = earlier + results
    lines = [
        f"# bench rl_step ({tag})",
        "",
        f"Command: `{cmd}`" + (" (rows appended to an earlier run's: each row has its own command)" if earlier else ""),
        f"Hardware: {hw}",
        "",
        "| impl | model | base weights | KV | prompt | completion | micro-batch | prefix sharing | weights shared | "
        "peak GiB | generation s | sync s | training s | step s | first step s | tokens/s | status |",
        "|" + "---|" * 17,
    ]
    for r in rows:
        f = lambda k, d=2: (f"{r[k]:.{d}f}" if isinstance(r.get(k), (int, float)) else "")  # noqa: E731
        first = f"{r['first_step']['step_s']:.2f}" if r.get("first_step") else ""
        lines.append(
            f"| {r.get('impl', r.get('row'))} ({r.get('row')}) | {r.get('model')} | "
            f"{r.get('base_weights', 'bf16')} | {r.get('kv_cache_dtype', '')} | {r.get('prompt_len')} | "
            f"{r.get('completion_len')} | {r.get('micro_batch', 1)} | {_sharing(r)} | "
            f"{r.get('weights_shared', '')} | {f('peak_gib')} | "
            f"{f('generation_s')} | {f('sync_last_s', 3)} | {f('training_s')} | {f('step_s')} | {first} | "
            f"{f('tokens_per_s', 0)} | {r.get('status', 'ok')} |"
        )
    alone = [r for r in rows if r.get("gen_alone") and "error" not in r["gen_alone"]]
    if alone:
        lines += [
            "",
            "Generation alone, same process after the row's training (8 completions):",
            "",
            "| impl | KV | tokens | vLLM + adapter tok/s | vLLM, no adapter tok/s | HF generate + adapter tok/s | "
            "vLLM / HF |",
            "|" + "---|" * 7,
        ]
        for r in alone:
            g = r["gen_alone"]
            lines.append(
                f"| {r['impl']} ({r.get('row')}) | {r.get('kv_cache_dtype')} | {g['vllm_adapter']['completion_tokens']} | "
                f"{g['vllm_adapter']['tokens_per_s']:.0f} | {g['vllm_no_adapter']['tokens_per_s']:.0f} | "
                f"{g['hf_adapter']['tokens_per_s']:.0f} | {g['vllm_over_hf']:.1f}x |"
            )
    profiled = [r for r in rows if r.get("decode_profile")]
    if profiled:
        kinds = [k for k, _ in DECODE_KINDS] + ["other"]
        lines += [
            "",
            "One decode step's GPU time by kind of kernel, ms (`--profile-decode`; batch 8):",
            "",
            "| impl | wall ms/step | GPU ms/step | " + " | ".join(kinds) + " |",
            "|" + "---|" * (3 + len(kinds)),
        ]
        for r in profiled:
            d = r["decode_profile"]
            lines.append(
                f"| {r['impl']} | {d['wall_ms_per_step']:.2f} | {d['gpu_ms_per_step']:.2f} | "
                + " | ".join(f"{d['kinds_ms_per_step'].get(k, 0):.3f}" for k in kinds)
                + " |"
            )
    lines += ["", "Per-step times, peaks and the generation plan of each row are in the JSON."]
    record_report("rl_step", {"command": cmd, "hardware": hw, "rows": rows}, lines, a.out_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="grpo_kit_fp8,grpo_kit_bf16,grpo_kit_copy,trl")
    p.add_argument("--models", default="llama-3.1-8b")
    p.add_argument("--completion", type=int, default=4096)
    p.add_argument(
        "--prompt",
        type=int,
        default=PROMPT_TOKENS,
        help="prompt tokens, one prompt shared by the group's 8 completions (default %(default)s)",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=1,
        choices=(1, 2, 4, 8),
        help="sequences per forward/backward (kit and TRL rows; gradient accumulation 8 / this); "
        "prefix sharing scores a prompt once per micro-batch, so it pays at 8 (the whole group)",
    )
    p.add_argument(
        "--prefix-sharing",
        default="auto",
        choices=("auto", "true", "false"),
        help="kit rows: prefix_sharing (the group's prompt scored once; auto: where it pays)",
    )
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tag", default="h200")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--timeout", type=int, default=560, help="seconds per row")
    p.add_argument(
        "--gen-tokens",
        type=int,
        default=0,
        help="kit rows: after training, time generation alone (vLLM with / without the adapter, HF "
        "generate) of 8 completions of this many tokens; 0: skip",
    )
    p.add_argument(
        "--lora-dual-stream",
        choices=("auto", "on", "off"),
        default="auto",
        help="kit rows with the adapter in vLLM's LoRA kernels (grpo_kit_adapter): "
        "vllm_lora_dual_stream; auto: the kit's default",
    )
    p.add_argument(
        "--trl-vllm-memory",
        type=float,
        default=0.3,
        help="trl row: GRPOConfig.vllm_gpu_memory_utilization (TRL's default 0.3), the share of the card "
        "its colocated engine takes",
    )
    p.add_argument(
        "--scoring-batch",
        default="auto",
        help="kit rows: scoring_batch_size (sequences per no-grad reference forward); auto: as "
        "`grpo_kit train` resolves it from the memory plan",
    )
    p.add_argument(
        "--memory-history",
        type=int,
        default=0,
        metavar="N",
        help="kit rows: record PyTorch's allocator history over the steps (at most N events) and keep "
        "what was allocated at its largest moment, by the line that allocated it "
        "(peak_allocations; grpo_kit.memory.live_at_peak); 0: off",
    )
    p.add_argument(
        "--sample-ms",
        type=float,
        default=5.0,
        help="milliseconds between the device-memory samples (cudaMemGetInfo from a second thread); "
        "larger: fewer driver calls beside the step's own",
    )
    p.add_argument(
        "--profile-training",
        action="store_true",
        help="kit and TRL rows: one more optimiser step, its loss passes (micro-batches 2..8 and the "
        "optimiser) under torch.profiler; top ops by GPU and host time in training_profile, the "
        "step kept out of the medians",
    )
    p.add_argument(
        "--profile-decode",
        type=int,
        default=0,
        metavar="TOKENS",
        help="generation rows: after the timed generation, generate TOKENS more tokens per sequence "
        "under torch.profiler and keep where each decode step's GPU time goes (decode_profile: "
        "LoRA kernels, FP8 and 16-bit GEMMs, attention, ...); 0: off",
    )
    p.add_argument(
        "--memory-history-at",
        default="end",
        choices=("end", "scoring", "generation"),
        help="kit rows with --memory-history: read the history at the end of the steps, or as the "
        "first call of that phase ends (its peak inside the ring buffer's window; generation: the "
        "first generate call, before standby; reading it adds seconds to that step's time)",
    )
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.scoring_batch != "auto" and not (a.scoring_batch.isdigit() and int(a.scoring_batch) >= 1):
        p.error(f"--scoring-batch {a.scoring_batch!r}: a whole number >= 1, or auto")
    if not a.sample_ms > 0:
        p.error(f"--sample-ms {a.sample_ms}: a number of milliseconds > 0")
    if a.memory_history < 0:
        p.error(f"--memory-history {a.memory_history}: a number of events >= 1, or 0 (off)")
    if a.prompt < 1:
        p.error(f"--prompt {a.prompt}: a number of tokens >= 1")
    from grpo_kit.model.prefix import check_prefix_sharing  # lazy: torch only once the arguments parsed

    a.prefix_sharing = check_prefix_sharing(a.prefix_sharing)  # the kit's own reading of auto / true / false
    if a.gen_tokens > a.completion:  # the row's engine holds prompt + completion tokens per sequence, no more
        p.error(
            f"--gen-tokens {a.gen_tokens} must be at most --completion {a.completion} (the engine's context is "
            "sized for the row's completion length)"
        )
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if a.one:
        res = one(a.one, a)
        print("ROW " + json.dumps(res, default=str), flush=True)
        return 0
    cmd = command_line("rl_step", argv)
    results = []
    for model in a.models.split(","):
        for name in a.rows.split(","):
            if name not in ROWS:
                raise SystemExit(f"unknown row {name!r}; rows: {', '.join(ROWS)}")
            with tempfile.TemporaryDirectory() as run_dir:
                child = [
                    sys.executable,
                    __file__,
                    "--one",
                    name,
                    "--model",
                    model,
                    "--run-dir",
                    run_dir,
                    "--completion",
                    str(a.completion),
                    "--prompt",
                    str(a.prompt),
                    "--micro-batch",
                    str(a.micro_batch),
                    "--prefix-sharing",
                    str(a.prefix_sharing).lower(),
                    "--steps",
                    str(a.steps),
                    "--gen-tokens",
                    str(a.gen_tokens),
                    "--lora-dual-stream",
                    a.lora_dual_stream,
                    "--trl-vllm-memory",
                    str(a.trl_vllm_memory),
                    "--scoring-batch",
                    a.scoring_batch,
                    "--memory-history",
                    str(a.memory_history),
                    "--memory-history-at",
                    a.memory_history_at,
                    "--sample-ms",
                    str(a.sample_ms),
                    "--profile-decode",
                    str(a.profile_decode),
                ] + ["--profile-training"] * a.profile_training
                t0 = time.perf_counter()
                try:
                    r = subprocess.run(child, capture_output=True, text=True, cwd=ROOT, timeout=a.timeout)
                    out, err, rc = r.stdout, r.stderr, r.returncode
                except subprocess.TimeoutExpired as e:
                    out, err, rc = (
                        (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""),
                        "timeout",
                        -1,
                    )
                wall = time.perf_counter() - t0
            line = [ln for ln in out.splitlines() if ln.startswith("ROW ")]
            base = dict(
                row=name,
                model=model,
                family=family_of_model(model),
                completion_len=a.completion,
                prompt_len=a.prompt,
                micro_batch=a.micro_batch,
                generations=GENERATIONS,
                wall_s=wall,
                command=cmd,
            )
            impl = "trl" if name == "trl" else IMPL.get(name, name)
            if rc != 0 or not line:
                done = [json.loads(ln.removeprefix("STEP ")) for ln in out.splitlines() if ln.startswith("STEP ")]
                res = dict(base, impl=impl, status="failed", error=(err or out)[-3000:], steps_done=done)
            else:
                res = _summarise(dict(base, **json.loads(line[-1].removeprefix("ROW "))))
            results.append(res)
            print(
                json.dumps(
                    {
                        k: res.get(k)
                        for k in (
                            "row",
                            "model",
                            "status",
                            "peak_gib",
                            "generation_s",
                            "training_s",
                            "step_s",
                            "tokens_per_s",
                            "wall_s",
                            "error",
                        )
                    },
                    default=str,
                )[:3000],
                flush=True,
            )
            write([], [res], a, cmd)  # each row appended to the data file as it finishes
    return 0


if __name__ == "__main__":
    sys.exit(main())
